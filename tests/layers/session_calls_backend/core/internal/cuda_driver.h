void ts_cuda_push(void);
