// Kernels for the tools and GPU tests, compiled to PTX at build time and
// loaded through the driver, so nothing here links the CUDA runtime.
// Values are base + i * step, so a zero, a stale or a shifted element shows.

extern "C" __global__ void tk_fill_i32(int *p, unsigned long long n, int base, int step) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    p[i] = base + (int)i * step;
}

// Spins for spin_ns on the GPU's clock, then fills: a long producer kernel.
extern "C" __global__ void tk_spin_fill_i32(int *p, unsigned long long n, int base, int step,
                                            unsigned long long spin_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < spin_ns);
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    p[i] = base + (int)i * step;
}

extern "C" __global__ void tk_count_bad_i32(const int *p, unsigned long long n, int base, int step,
                                            unsigned long long *bad) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    if (p[i] != base + (int)i * step) atomicAdd(bad, 1ULL);
}
