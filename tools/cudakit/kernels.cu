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

// Reads n 16-byte words once, four loads in flight per thread, and adds every
// 32-bit word into *out: a kernel bound by memory bandwidth alone.
extern "C" __global__ void tk_read_sum_u32(const uint4 *p, unsigned long long n, unsigned long long *out) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  unsigned long long acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
    acc += (unsigned long long)a.x + a.y + (unsigned long long)a.z + a.w;
    acc += (unsigned long long)b.x + b.y + (unsigned long long)b.z + b.w;
    acc += (unsigned long long)c.x + c.y + (unsigned long long)c.z + c.w;
    acc += (unsigned long long)d.x + d.y + (unsigned long long)d.z + d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = p[i];
    acc += (unsigned long long)a.x + a.y + (unsigned long long)a.z + a.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
