void ts_log(const char *what);
