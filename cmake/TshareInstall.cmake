# Install rules, the CMake package (find_package(tshare) -> tshare::core, the
# static library, and tshare::shared) and a pkg-config file (pkg-config
# --cflags --libs tshare: the shared library).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set_target_properties(tshare_core PROPERTIES EXPORT_NAME core)
set_target_properties(tshare_shared PROPERTIES EXPORT_NAME shared)
install(TARGETS tshare_core tshare_shared EXPORT tshareTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/core/include/tshare DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS tshare-launch RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES ${PROJECT_SOURCE_DIR}/docs/man/tshare-launch.1 DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
if(TARGET tshare-zeroing-check)
  install(FILES ${PROJECT_SOURCE_DIR}/docs/man/tshare-zeroing-check.1 DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)
endif()

install(EXPORT tshareTargets NAMESPACE tshare:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tshare)

# The bridge has its own export set: the package loads it only for projects
# that use C++ (or ask for the torch component), since it needs LibTorch.
set(TSHARE_TORCH_DIR_HINT "")
if(TARGET tshare_torch)
  install(TARGETS tshare_torch tshare_torch_shared EXPORT tshareTorchTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(FILES ${PROJECT_SOURCE_DIR}/torch_bridge/include/tshare/torch.h
    ${PROJECT_SOURCE_DIR}/torch_bridge/include/tshare/torch_set.h
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tshare)
  install(EXPORT tshareTorchTargets NAMESPACE tshare:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tshare)
  set(TSHARE_TORCH_DIR_HINT "${Torch_DIR}")
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tshareConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tshareConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tshare)
# version.h's ABI rule: while the major version is 0, each minor version is
# an ABI of its own, so find_package(tshare 0.1) accepts 0.1.x only.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(tshare_version_compatibility SameMinorVersion)
else()
  set(tshare_version_compatibility SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tshareConfigVersion.cmake
  COMPATIBILITY ${tshare_version_compatibility})
install(FILES ${PROJECT_BINARY_DIR}/tshareConfig.cmake ${PROJECT_BINARY_DIR}/tshareConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/tshare)
# Relative to the .pc file, so the package works wherever the prefix is moved.
file(RELATIVE_PATH TSHARE_PC_TO_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
string(REGEX REPLACE "/$" "" TSHARE_PC_TO_PREFIX "${TSHARE_PC_TO_PREFIX}")
# A static link adds what tshare::core's link interface adds
# (core/CMakeLists.txt): the threads library where libc lacks pthreads, and
# the dynamic loader's library when CUDA shares dlopen the driver.
set(TSHARE_PC_LIBS_PRIVATE ${CMAKE_THREAD_LIBS_INIT})
if(TSHARE_HAVE_CUDA)
  foreach(lib IN LISTS CMAKE_DL_LIBS)
    list(APPEND TSHARE_PC_LIBS_PRIVATE -l${lib})
  endforeach()
endif()
list(JOIN TSHARE_PC_LIBS_PRIVATE " " TSHARE_PC_LIBS_PRIVATE)
configure_file(${PROJECT_SOURCE_DIR}/cmake/tshare.pc.in ${PROJECT_BINARY_DIR}/tshare.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/tshare.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
