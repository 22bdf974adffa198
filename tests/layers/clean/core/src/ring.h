int ts_ring_size(void);
