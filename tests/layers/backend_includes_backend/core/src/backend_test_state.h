/* backend_test_state.h */
