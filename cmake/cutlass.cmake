# CUTLASS (header-only) for the CUDA expert kernels (src/experts/cuda).
#
# Looked up, in order, in MOELINK_CUTLASS_DIR (CMake variable or the
# environment variable of that name, or CUTLASS_HOME): a CUTLASS checkout or
# install with include/cutlass/cutlass.h; then in the nvidia-cutlass Python
# wheel (site-packages/cutlass_library/source/include of the Python CMake
# finds). Needs CUDA: a CPU-only build never looks.
#
# Sets MOELINK_CUTLASS_FOUND and, when found, MOELINK_CUTLASS_INCLUDE_DIR and
# MOELINK_CUTLASS_VERSION. CI pins the wheel (.ci/run: nvidia-cutlass==4.2.0.0).
set(MOELINK_CUTLASS_DIR "" CACHE PATH "CUTLASS checkout or install (include/cutlass/cutlass.h); else the nvidia-cutlass wheel")
set(MOELINK_CUTLASS_FOUND OFF)
if(NOT MOELINK_WITH_CUDA)
  return()
endif()

set(_moelink_cutlass_hints)
foreach(_v MOELINK_CUTLASS_DIR CUTLASS_HOME)
  if(${_v})
    list(APPEND _moelink_cutlass_hints "${${_v}}")
  elseif(DEFINED ENV{${_v}} AND NOT "$ENV{${_v}}" STREQUAL "")
    list(APPEND _moelink_cutlass_hints "$ENV{${_v}}")
  endif()
endforeach()

include(${CMAKE_CURRENT_LIST_DIR}/site_packages.cmake)
moelink_find_in_site_packages(_moelink_cutlass_wheel cutlass_library/source include/cutlass/cutlass.h)
if(_moelink_cutlass_wheel)
  list(APPEND _moelink_cutlass_hints "${_moelink_cutlass_wheel}")
endif()
set(_moelink_cutlass_py "${MOELINK_SITE_PYTHON}")

find_path(MOELINK_CUTLASS_INCLUDE_DIR cutlass/cutlass.h
  HINTS ${_moelink_cutlass_hints}
  PATH_SUFFIXES include
  NO_DEFAULT_PATH)
if(NOT MOELINK_CUTLASS_INCLUDE_DIR)
  message(STATUS "moelink: CUTLASS not found (pip install nvidia-cutlass for "
                 "${_moelink_cutlass_py}, or set MOELINK_CUTLASS_DIR): Experts device=cuda is a "
                 "stand-in. Looked in: ${_moelink_cutlass_hints}")
  return()
endif()
file(STRINGS "${MOELINK_CUTLASS_INCLUDE_DIR}/cutlass/version.h" _moelink_cutlass_v
     REGEX "define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
       MOELINK_CUTLASS_VERSION "${_moelink_cutlass_v}")
if(MOELINK_CUTLASS_VERSION VERSION_LESS 3.9)
  message(STATUS "moelink: CUTLASS ${MOELINK_CUTLASS_VERSION} in ${MOELINK_CUTLASS_INCLUDE_DIR} is "
                 "older than 3.9 (no Hopper grouped GEMM with blockwise scaling): Experts "
                 "device=cuda is a stand-in")
  return()
endif()
set(MOELINK_CUTLASS_FOUND ON)
message(STATUS "moelink: CUTLASS ${MOELINK_CUTLASS_VERSION} from ${MOELINK_CUTLASS_INCLUDE_DIR}: "
               "CUDA expert kernels built")
