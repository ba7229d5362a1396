# moelink_find_in_site_packages(<var> <relative path> <marker file>): the
# first site-packages directory (system, user, purelib, platlib) of the
# Python CMake knows (Python_EXECUTABLE, Python3_EXECUTABLE, else python3 on
# PATH) holding <relative path>/<marker file>; <var> gets that
# <site-packages>/<relative path>, or stays empty. How cmake/nvshmem.cmake and
# cmake/cutlass.cmake find the libraries their wheels install.
function(moelink_find_in_site_packages var rel marker)
  set(_py "${Python_EXECUTABLE}")
  if(NOT _py)
    set(_py "${Python3_EXECUTABLE}")
  endif()
  if(NOT _py)
    find_program(_moelink_site_py NAMES python3 python)
    set(_py "${_moelink_site_py}")
  endif()
  set(${var} "" PARENT_SCOPE)
  if(NOT _py)
    return()
  endif()
  execute_process(
    COMMAND "${_py}" -c [=[
import os, site, sys, sysconfig
rel, marker = sys.argv[1], sys.argv[2]
dirs = []
try:
    dirs += site.getsitepackages()
except Exception:
    pass
try:
    dirs.append(site.getusersitepackages())
except Exception:
    pass
dirs += [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
for d in dirs:
    p = os.path.join(d or "", rel)
    if os.path.isfile(os.path.join(p, marker)):
        print(p)
        break
]=] "${rel}" "${marker}"
    OUTPUT_VARIABLE _found
    OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET)
  set(${var} "${_found}" PARENT_SCOPE)
  set(MOELINK_SITE_PYTHON "${_py}" PARENT_SCOPE)
endfunction()
