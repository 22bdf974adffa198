void launcher_log(void);
