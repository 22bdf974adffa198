/* cuda_internal.h */
