# The Python package (python/): which interpreter it is built for.
#
# TSHARE_WITH_PYTHON: AUTO (build it where an interpreter with its C headers
# is found), ON (fail if none is) or OFF. TSHARE_PYTHON names the interpreter;
# left empty, the first of $TSHARE_PYTHON, python3 on PATH, /usr/bin/python3
# and /usr/local/bin/python3 that imports torch is taken (Debian's python3-torch
# installs into /usr/bin/python3, which need not be the python3 first on PATH).
# When none imports torch, the package is still built for the first with
# headers, and its tests skip saying so.
set(TSHARE_WITH_PYTHON AUTO CACHE STRING "Python package: AUTO, ON or OFF")
set_property(CACHE TSHARE_WITH_PYTHON PROPERTY STRINGS AUTO ON OFF)
set(TSHARE_PYTHON "" CACHE FILEPATH "Interpreter to build the Python package for (empty: the first that imports torch)")
string(TOUPPER "${TSHARE_WITH_PYTHON}" TSHARE_WITH_PYTHON)

set(TSHARE_HAVE_PYTHON OFF)
set(TSHARE_PYTHON_HAS_TORCH OFF)
if(TSHARE_WITH_PYTHON STREQUAL "OFF")
  message(STATUS "tshare: Python package disabled (TSHARE_WITH_PYTHON=OFF)")
  return()
endif()
if(TSHARE_SANITIZE)
  # The interpreter is not built with the sanitizer: it could not load the module.
  message(STATUS "tshare: Python package not built under TSHARE_SANITIZE (the interpreter is not instrumented)")
  return()
endif()

set(_tshare_py_candidates "")
if(TSHARE_PYTHON)
  list(APPEND _tshare_py_candidates "${TSHARE_PYTHON}")
else()
  if(DEFINED ENV{TSHARE_PYTHON})
    list(APPEND _tshare_py_candidates "$ENV{TSHARE_PYTHON}")
  endif()
  find_program(_tshare_path_python3 python3 NO_CACHE)
  foreach(p "${_tshare_path_python3}" /usr/bin/python3 /usr/local/bin/python3)
    if(p AND EXISTS "${p}")
      list(APPEND _tshare_py_candidates "${p}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _tshare_py_candidates)
endif()

set(_tshare_py_with_headers "")
set(_tshare_py_chosen "")
foreach(p IN LISTS _tshare_py_candidates)
  execute_process(COMMAND "${p}" -c "import sysconfig, os; print(os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"
    OUTPUT_VARIABLE _h RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0 OR NOT _h STREQUAL "True")
    continue()
  endif()
  if(NOT _tshare_py_with_headers)
    set(_tshare_py_with_headers "${p}")
  endif()
  execute_process(COMMAND "${p}" -c "import torch; print(torch.__version__)"
    OUTPUT_VARIABLE _v RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_rc EQUAL 0)
    set(_tshare_py_chosen "${p}")
    set(TSHARE_PYTHON_HAS_TORCH ON)
    message(STATUS "tshare: Python package built for ${p} (torch ${_v})")
    break()
  endif()
endforeach()
if(NOT _tshare_py_chosen AND _tshare_py_with_headers)
  set(_tshare_py_chosen "${_tshare_py_with_headers}")
  message(STATUS "tshare: no Python interpreter imports torch (tried: ${_tshare_py_candidates}); the Python "
                 "package is built for ${_tshare_py_chosen} but its tests skip. Install torch for it "
                 "(Debian: apt-get install python3-torch) or set TSHARE_PYTHON.")
endif()
if(NOT _tshare_py_chosen)
  if(TSHARE_WITH_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "tshare: TSHARE_WITH_PYTHON=ON but no Python interpreter with its C headers was found "
                        "(tried: ${_tshare_py_candidates}). Debian: apt-get install python3-dev.")
  endif()
  message(STATUS "tshare: no Python interpreter with C headers (tried: ${_tshare_py_candidates}); the Python "
                 "package is not built (Debian: apt-get install python3-dev python3-torch)")
  return()
endif()

set(Python3_EXECUTABLE "${_tshare_py_chosen}")
find_package(Python3 COMPONENTS Interpreter Development.Module)
if(NOT Python3_Development.Module_FOUND)
  message(STATUS "tshare: CMake found no Python development module for ${_tshare_py_chosen}; no Python package")
  return()
endif()
set(TSHARE_HAVE_PYTHON ON)
set(TSHARE_PYTHON_EXECUTABLE "${_tshare_py_chosen}")
