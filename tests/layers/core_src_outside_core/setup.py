include_dirs = ["core/include", "core/src"]
