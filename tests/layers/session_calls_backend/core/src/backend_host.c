int ts_host_map(ts_channel *ch, int flags) { return ts_cuda_flush(ch) + flags; }
