/* u64map.h */
