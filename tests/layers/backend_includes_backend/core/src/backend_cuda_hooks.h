/* backend_cuda_hooks.h */
