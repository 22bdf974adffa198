typedef struct ts_channel ts_channel;
