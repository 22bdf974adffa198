/* error_detail.h */
