/* cuda_hooks.h */
