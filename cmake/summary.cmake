# What this build holds, said once where nobody can miss it.
#
# Included at the end of configure: prints one block naming every part built
# and every part left out, with why and the fix, writes it to
# tshare-summary.txt in the build tree, and adds the target demo_programs
# (what make demo runs, and nothing else: tests build with make test).
#
# Run as a script at the end of make test, it repeats that block under the
# run's counts, skipped tests counted per reason (the first "SKIP: ..." line
# of each test's output, from ctest's JUnit file):
#   cmake -DBUILD_DIR=build -P cmake/summary.cmake

# --- configure: the parts --------------------------------------------------------

function(tshare_summary_built part)
  set_property(GLOBAL APPEND PROPERTY tshare_summary_lines "  built:     ${part}")
endfunction()

function(tshare_summary_left_out part why fix)
  set_property(GLOBAL APPEND PROPERTY tshare_summary_lines "  left out:  ${part}: ${why}" "             fix: ${fix}")
endfunction()

function(tshare_summary_cuda)
  set(part "GPU shares (CUDA IPC), tshare-zeroing-check and the GPU tests")
  if(TSHARE_HAVE_CUDA)
    tshare_summary_built("${part} (CUDA ${CUDAToolkit_VERSION}, the GPU tests skip where no device is usable)")
  elseif(TSHARE_WITH_CUDA STREQUAL "OFF")
    tshare_summary_left_out("${part}" "TSHARE_WITH_CUDA=OFF" "configure with -DTSHARE_WITH_CUDA=AUTO")
  else()
    tshare_summary_left_out("${part}" "no CUDA toolkit found"
      "install the CUDA toolkit (nvcc and headers), or set CUDAToolkit_ROOT to it")
  endif()
endfunction()

function(tshare_summary_torch)
  set(part "LibTorch bridge (tshare::torch)")
  if(TSHARE_BUILD_EXAMPLES)
    string(APPEND part ", its examples")
  endif()
  if(TSHARE_BUILD_TESTS)
    string(APPEND part ", its tests")
  endif()
  set(fix "apt-get install libtorch-dev (Debian, CPU-only), or set Torch_DIR to LibTorch's share/cmake/Torch")
  if(TSHARE_HAVE_TORCH)
    tshare_summary_built("${part} (LibTorch ${Torch_VERSION})")
    if(TSHARE_HAVE_CUDA AND NOT TSHARE_HAVE_TORCH_CUDA)
      tshare_summary_left_out("CUDA tensors through the bridge" "this LibTorch has no CUDA (no c10_cuda)"
        "set Torch_DIR to a CUDA build of LibTorch")
    endif()
  elseif(TSHARE_WITH_TORCH STREQUAL "OFF")
    tshare_summary_left_out("${part}" "TSHARE_WITH_TORCH=OFF" "configure with -DTSHARE_WITH_TORCH=AUTO")
  elseif(NOT CMAKE_CXX_COMPILER)
    tshare_summary_left_out("${part}" "no C++ compiler" "apt-get install g++")
  else()
    tshare_summary_left_out("${part}" "LibTorch not found (Torch_DIR, python3's torch, the system)" "${fix}")
  endif()
endfunction()

# The variables read here are TsharePython.cmake's, in this same scope.
# (No part's text holds a semicolon: it would split the list of lines.)
function(tshare_summary_python)
  set(part "Python package (import tshare) and its tests")
  if(TSHARE_HAVE_PYTHON AND TSHARE_PYTHON_HAS_TORCH)
    tshare_summary_built("${part} (for ${TSHARE_PYTHON_EXECUTABLE})")
  elseif(TSHARE_HAVE_PYTHON)
    tshare_summary_built("Python package (for ${TSHARE_PYTHON_EXECUTABLE})")
    tshare_summary_left_out("the Python tests (they skip)" "${TSHARE_PYTHON_EXECUTABLE} has no torch"
      "apt-get install python3-torch (for /usr/bin/python3), or -DTSHARE_PYTHON=an interpreter with torch")
  elseif(TSHARE_WITH_PYTHON STREQUAL "OFF")
    tshare_summary_left_out("${part}" "TSHARE_WITH_PYTHON=OFF" "configure with -DTSHARE_WITH_PYTHON=AUTO")
  elseif(TSHARE_SANITIZE)
    tshare_summary_left_out("${part}" "TSHARE_SANITIZE is set (the interpreter is not instrumented)"
      "make test, without sanitizers, builds and runs it")
  elseif(NOT _tshare_py_with_headers)
    tshare_summary_left_out("${part}" "no Python interpreter with its C headers (tried: ${_tshare_py_candidates})"
      "apt-get install python3-dev python3-torch, or -DTSHARE_PYTHON=an interpreter with both")
  else()
    tshare_summary_left_out("${part}" "CMake found no Python development module for ${_tshare_py_chosen}"
      "apt-get install python3-dev")
  endif()
endfunction()

# UCX is opened at run time (dlopen): the library always builds the ucx://
# transport; whether this machine can run it is what is looked for here.
function(tshare_summary_ucx)
  set(part "channels across hosts (ucx:// addresses, UCX opened at run time)")
  find_library(TSHARE_UCP_LIBRARY NAMES libucp.so.0 ucp)
  if(TSHARE_UCP_LIBRARY)
    tshare_summary_built("${part} (${TSHARE_UCP_LIBRARY})")
  else()
    tshare_summary_left_out("${part}: built, but its tests skip" "no libucp.so.0 on this machine"
      "apt-get install libucx-dev ucx-utils (or scripts/install-deps.sh)")
  endif()
endfunction()

function(tshare_summary_bench_and_examples)
  if(NOT TSHARE_BUILD_BENCH)
    tshare_summary_left_out("tshare-bench (make bench)" "TSHARE_BUILD_BENCH=OFF" "configure with -DTSHARE_BUILD_BENCH=ON")
  endif()
  if(NOT TSHARE_BUILD_EXAMPLES)
    tshare_summary_left_out("the C and LibTorch examples" "TSHARE_BUILD_EXAMPLES=OFF"
      "configure with -DTSHARE_BUILD_EXAMPLES=ON")
  endif()
endfunction()

function(tshare_summary_tests)
  if(NOT TSHARE_BUILD_TESTS)
    tshare_summary_left_out("the tests" "TSHARE_BUILD_TESTS=OFF" "configure with -DTSHARE_BUILD_TESTS=ON")
    return()
  endif()
  tshare_summary_built("the tests (make test)")
  if(TARGET tshare_fuzz_decoder)
    tshare_summary_built("the libFuzzer targets (make fuzz)")
  elseif(NOT TSHARE_CLANG)
    tshare_summary_left_out("the libFuzzer targets (make fuzz, the corpus replay still runs)" "no clang"
      "apt-get install clang")
  else()
    tshare_summary_left_out("the libFuzzer targets (make fuzz, the corpus replay still runs)"
      "${TSHARE_CLANG} cannot link a libFuzzer program" "install clang's compiler-rt runtimes (Debian: apt-get install clang)")
  endif()
  find_program(TSHARE_PKG_CONFIG pkg-config)
  if(NOT TSHARE_PKG_CONFIG)
    tshare_summary_left_out("the package test's pkg-config half" "no pkg-config" "apt-get install pkg-config")
  endif()
endfunction()

function(tshare_summary_print)
  get_property(lines GLOBAL PROPERTY tshare_summary_lines)
  set(kind "${CMAKE_BUILD_TYPE}")
  if(TSHARE_SANITIZE)
    string(APPEND kind ", sanitizers ${TSHARE_SANITIZE}")
  endif()
  list(PREPEND lines "tshare ${PROJECT_VERSION} (${kind}) in ${PROJECT_BINARY_DIR}:")
  foreach(line IN LISTS lines)
    message(STATUS "${line}")
  endforeach()
  string(REPLACE ";" "\n" text "${lines}")
  file(WRITE ${PROJECT_BINARY_DIR}/tshare-summary.txt "${text}\n")
endfunction()

# What make demo runs: tshare-launch (its demo role), the C examples, and the
# LibTorch examples and Python package where built (run_demo.sh).
function(tshare_add_demo_programs)
  add_custom_target(demo_programs)
  foreach(t tshare-launch batch_producer batch_consumer weights_server inference_worker weight_sync_trainer
           weight_sync_worker tshare_python)
    if(TARGET ${t})
      add_dependencies(demo_programs ${t})
    endif()
  endforeach()
endfunction()

# --- make test: the summary again, with the run's counts --------------------------

# "SKIP: no CUDA device: the driver ... (...)" counts as "no CUDA device".
function(tshare_skip_reason testcase out)
  if(testcase MATCHES "SKIP: ([^\n<]*)")
    string(REGEX REPLACE "(: | \\().*" "" reason "${CMAKE_MATCH_1}")
  elseif(testcase MATCHES "<skipped message=\"Unable to find executable")
    set(reason "its program is not built (make test builds every one)")
  elseif(testcase MATCHES "<skipped message=\"([^\"]*)\"" AND NOT CMAKE_MATCH_1 MATCHES "SKIP_RETURN_CODE")
    set(reason "ctest: ${CMAKE_MATCH_1}")
  else()
    set(reason "exited 77 without saying why")
  endif()
  set(${out} "${reason}" PARENT_SCOPE)
endfunction()

function(tshare_print_test_counts junit)
  file(READ "${junit}" xml)
  string(REPLACE ";" "," xml "${xml}") # the list separator, out of the way
  # Square brackets in test output would keep CMake from splitting the list there.
  string(REPLACE "[" "(" xml "${xml}")
  string(REPLACE "]" ")" xml "${xml}")
  string(REPLACE "<testcase " ";<testcase " cases "${xml}")
  list(POP_FRONT cases)
  set(failed 0)
  set(skipped 0)
  set(reasons "")
  foreach(c IN LISTS cases)
    if(c MATCHES "status=\"fail\"")
      math(EXPR failed "${failed} + 1")
    elseif(c MATCHES "<skipped")
      math(EXPR skipped "${skipped} + 1")
      tshare_skip_reason("${c}" reason)
      list(APPEND reasons "${reason}")
    endif()
  endforeach()
  list(LENGTH cases total)
  math(EXPR passed "${total} - ${failed} - ${skipped}")
  message("tshare: ${total} tests: ${passed} passed, ${failed} failed, ${skipped} skipped")
  set(unique "${reasons}")
  list(REMOVE_DUPLICATES unique)
  foreach(reason IN LISTS unique)
    set(n 0)
    foreach(r IN LISTS reasons)
      if(r STREQUAL reason)
        math(EXPR n "${n} + 1")
      endif()
    endforeach()
    message("  skipped ${n}: ${reason}")
  endforeach()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)
  if(EXISTS "${BUILD_DIR}/tshare-summary.txt")
    file(READ "${BUILD_DIR}/tshare-summary.txt" text)
    message("\n${text}")
  endif()
  if(EXISTS "${BUILD_DIR}/Testing/junit.xml")
    tshare_print_test_counts("${BUILD_DIR}/Testing/junit.xml")
  endif()
  return()
endif()

if(TARGET batch_producer)
  tshare_summary_built("core library (libtshare.a, libtshare.so), host shares, tshare-launch, the C examples")
else()
  tshare_summary_built("core library (libtshare.a, libtshare.so), host shares, tshare-launch")
endif()
tshare_summary_cuda()
tshare_summary_torch()
tshare_summary_python()
tshare_summary_ucx()
tshare_summary_bench_and_examples()
tshare_summary_tests()
tshare_summary_print()
if(PROJECT_IS_TOP_LEVEL) # a parent project's target of that name is left alone
  tshare_add_demo_programs()
endif()
