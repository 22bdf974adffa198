/* backend_host.h */
