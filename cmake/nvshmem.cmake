# NVSHMEM for Backend::kNVSHMEM (src/nvshmem).
#
# Looked up, in order, in NVSHMEM_HOME (CMake variable or environment), in the
# nvidia-nvshmem-cu13 Python wheel (site-packages/nvidia/nvshmem of the Python
# that CMake finds: Python_EXECUTABLE, else python3 on PATH), then in the
# default system locations. Needs CUDA: a CPU-only build never looks.
#
# Sets MOELINK_NVSHMEM_FOUND and, when found, the imported targets
#   moelink::nvshmem_host    libnvshmem_host.so(.3): host API, bootstrap, transports
#   moelink::nvshmem_device  libnvshmem_device.a: device API, linked with -rdc
# and MOELINK_NVSHMEM_LIB_DIR (the host library's directory, for RPATHs and
# LD_LIBRARY_PATH).
option(MOELINK_WITH_NVSHMEM "Build the NVSHMEM backend where NVSHMEM is found" ON)
set(NVSHMEM_HOME "" CACHE PATH "NVSHMEM installation (include/, lib/); else $ENV{NVSHMEM_HOME} or the Python wheel")
set(MOELINK_NVSHMEM_FOUND OFF)

if(NOT MOELINK_WITH_NVSHMEM)
  message(STATUS "moelink: NVSHMEM backend off (MOELINK_WITH_NVSHMEM=OFF); backend \"nvshmem\" is a stand-in")
  return()
endif()
if(NOT MOELINK_WITH_CUDA)
  message(STATUS "moelink: NVSHMEM backend needs CUDA; backend \"nvshmem\" is a stand-in")
  return()
endif()

set(_moelink_nvshmem_hints)
if(NVSHMEM_HOME)
  list(APPEND _moelink_nvshmem_hints "${NVSHMEM_HOME}")
elseif(DEFINED ENV{NVSHMEM_HOME} AND NOT "$ENV{NVSHMEM_HOME}" STREQUAL "")
  list(APPEND _moelink_nvshmem_hints "$ENV{NVSHMEM_HOME}")
endif()

# The wheel, in the site-packages of the Python CMake knows.
include(${CMAKE_CURRENT_LIST_DIR}/site_packages.cmake)
moelink_find_in_site_packages(_moelink_nvshmem_wheel nvidia/nvshmem include/nvshmem.h)
if(_moelink_nvshmem_wheel)
  list(APPEND _moelink_nvshmem_hints "${_moelink_nvshmem_wheel}")
endif()
set(_moelink_nvshmem_py "${MOELINK_SITE_PYTHON}")

find_path(MOELINK_NVSHMEM_INCLUDE_DIR nvshmem.h
  HINTS ${_moelink_nvshmem_hints}
  PATH_SUFFIXES include include/nvshmem_13 include/nvshmem)
# The wheel ships only the versioned name (libnvshmem_host.so.3).
find_library(MOELINK_NVSHMEM_HOST_LIBRARY
  NAMES nvshmem_host libnvshmem_host.so.3
  HINTS ${_moelink_nvshmem_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu/nvshmem/13)
find_library(MOELINK_NVSHMEM_DEVICE_LIBRARY
  NAMES libnvshmem_device.a nvshmem_device
  HINTS ${_moelink_nvshmem_hints}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu/nvshmem/13)

if(NOT MOELINK_NVSHMEM_INCLUDE_DIR OR NOT MOELINK_NVSHMEM_HOST_LIBRARY
   OR NOT MOELINK_NVSHMEM_DEVICE_LIBRARY)
  message(STATUS "moelink: NVSHMEM not found (set NVSHMEM_HOME, or pip install nvidia-nvshmem-cu13 "
                 "for ${_moelink_nvshmem_py}); backend \"nvshmem\" is a stand-in. Looked in: "
                 "${_moelink_nvshmem_hints}")
  return()
endif()

set(_moelink_nvshmem_version "?")
if(EXISTS "${MOELINK_NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h")
  file(STRINGS "${MOELINK_NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h" _moelink_nvshmem_v
       REGEX "define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
  string(REGEX REPLACE ".*MAJOR_VERSION ([0-9]+).*MINOR_VERSION ([0-9]+).*PATCH_VERSION ([0-9]+).*"
         "\\1.\\2.\\3" _moelink_nvshmem_version "${_moelink_nvshmem_v}")
endif()

get_filename_component(MOELINK_NVSHMEM_LIB_DIR "${MOELINK_NVSHMEM_HOST_LIBRARY}" DIRECTORY)
add_library(moelink::nvshmem_host SHARED IMPORTED)
set_target_properties(moelink::nvshmem_host PROPERTIES
  IMPORTED_LOCATION "${MOELINK_NVSHMEM_HOST_LIBRARY}"
  IMPORTED_NO_SONAME OFF
  INTERFACE_INCLUDE_DIRECTORIES "${MOELINK_NVSHMEM_INCLUDE_DIR}")
add_library(moelink::nvshmem_device STATIC IMPORTED)
set_target_properties(moelink::nvshmem_device PROPERTIES
  IMPORTED_LOCATION "${MOELINK_NVSHMEM_DEVICE_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${MOELINK_NVSHMEM_INCLUDE_DIR}")
# Installed binaries (the Python module) keep the path to the host library:
# the wheel's lib/ is not on the loader's default path.
set(CMAKE_INSTALL_RPATH_USE_LINK_PATH ON)
set(MOELINK_NVSHMEM_FOUND ON)
message(STATUS "moelink: NVSHMEM ${_moelink_nvshmem_version} from ${MOELINK_NVSHMEM_LIB_DIR}: "
               "backend \"nvshmem\" built")
