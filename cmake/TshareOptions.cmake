# Build options. TSHARE_WITH_CUDA and TSHARE_WITH_TORCH take AUTO, ON or OFF:
# AUTO uses what it finds and says what it found; ON fails when it is missing.
set(TSHARE_WITH_CUDA AUTO CACHE STRING "CUDA IPC shares: AUTO, ON or OFF")
set(TSHARE_WITH_TORCH AUTO CACHE STRING "LibTorch bridge: AUTO, ON or OFF")
set_property(CACHE TSHARE_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set_property(CACHE TSHARE_WITH_TORCH PROPERTY STRINGS AUTO ON OFF)
# Tests (fuzz targets among them), the bench and the examples are on where
# tshare is the top-level project, off where another project adds it with
# add_subdirectory (which may still turn them on).
option(TSHARE_BUILD_TESTS "Build the tests and fuzz targets" ${PROJECT_IS_TOP_LEVEL})
option(TSHARE_BUILD_BENCH "Build tshare-bench" ${PROJECT_IS_TOP_LEVEL})
option(TSHARE_BUILD_EXAMPLES "Build the C and LibTorch examples" ${PROJECT_IS_TOP_LEVEL})
if(TSHARE_BUILD_TESTS AND NOT TSHARE_BUILD_EXAMPLES)
  message(STATUS "tshare: the examples are built anyway: the tests run them")
  set(TSHARE_BUILD_EXAMPLES ON)
endif()
set(TSHARE_SANITIZE "" CACHE STRING "Sanitizers to build with, e.g. address,undefined")
option(TSHARE_WERROR "Treat warnings as errors (CI)" OFF)
# ctest's per-test limits, and the launcher deadline of the example test that
# starts LibTorch in four processes, scale by this factor: make valgrind
# raises it, since one LibTorch start there alone takes about 40 s.
set(TSHARE_TEST_SLOWDOWN 1 CACHE STRING "Factor for the tests' time limits (slow runners such as valgrind)")

foreach(opt TSHARE_WITH_CUDA TSHARE_WITH_TORCH)
  string(TOUPPER "${${opt}}" _v)
  if(NOT _v MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${opt}=${${opt}}: use AUTO, ON or OFF")
  endif()
  set(${opt} ${_v})
endforeach()

# CUDA: the toolkit is looked for now; CUDA shares build on it.
set(TSHARE_HAVE_CUDA OFF)
if(NOT TSHARE_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(TSHARE_HAVE_CUDA ON)
    message(STATUS "tshare: CUDA toolkit ${CUDAToolkit_VERSION} found at ${CUDAToolkit_BIN_DIR} ")
  elseif(TSHARE_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "tshare: TSHARE_WITH_CUDA=ON but no CUDA toolkit was found. "
                        "Install the CUDA toolkit or set CUDAToolkit_ROOT, or use TSHARE_WITH_CUDA=AUTO/OFF.")
  else()
    message(STATUS "tshare: CUDA toolkit not found; building host-memory shares only")
  endif()
else()
  message(STATUS "tshare: CUDA disabled (TSHARE_WITH_CUDA=OFF)")
endif()

# LibTorch: the bridge builds on it. Looked for in this order: Torch_DIR,
# python3's torch (torch.utils.cmake_prefix_path), then the system (Debian's
# libtorch-dev, which scripts/install-deps.sh installs where it can).
set(TSHARE_HAVE_TORCH OFF)
set(TSHARE_HAVE_TORCH_CUDA OFF)
if(NOT TSHARE_WITH_TORCH STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CXX)
  if(CMAKE_CXX_COMPILER)
    enable_language(CXX)
    if(NOT Torch_DIR AND NOT DEFINED ENV{Torch_DIR})
      find_program(TSHARE_PYTHON3 python3)
      if(TSHARE_PYTHON3)
        execute_process(COMMAND ${TSHARE_PYTHON3} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
          OUTPUT_VARIABLE _tshare_py_torch RESULT_VARIABLE _tshare_py_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
        if(_tshare_py_rc EQUAL 0 AND IS_DIRECTORY "${_tshare_py_torch}")
          list(APPEND CMAKE_PREFIX_PATH "${_tshare_py_torch}")
        endif()
      endif()
    endif()
    find_package(Torch QUIET)
  endif()
  if(Torch_FOUND)
    set(TSHARE_HAVE_TORCH ON)
    if(TSHARE_HAVE_CUDA AND TARGET c10_cuda)
      set(TSHARE_HAVE_TORCH_CUDA ON)
    endif()
    message(STATUS "tshare: LibTorch ${Torch_VERSION} found at ${Torch_DIR}; "
                   "the bridge is built (CUDA tensors: ${TSHARE_HAVE_TORCH_CUDA})")
  elseif(TSHARE_WITH_TORCH STREQUAL "ON")
    message(FATAL_ERROR "tshare: TSHARE_WITH_TORCH=ON but LibTorch was not found. Set Torch_DIR to LibTorch's "
                        "share/cmake/Torch, install torch for python3, or install libtorch-dev; or use "
                        "TSHARE_WITH_TORCH=AUTO/OFF.")
  else()
    message(STATUS "tshare: LibTorch not found (Torch_DIR, python3's torch, system); the torch bridge is not built")
  endif()
else()
  message(STATUS "tshare: LibTorch bridge disabled (TSHARE_WITH_TORCH=OFF)")
endif()
