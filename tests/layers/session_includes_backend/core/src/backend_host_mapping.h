/* backend_host_mapping.h */
