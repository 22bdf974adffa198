int ts_cuda_flush(ts_channel *ch) { return ch != 0; }
