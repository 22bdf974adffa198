int ts_host_map(void);
