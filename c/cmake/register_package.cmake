# Run by `cmake --install`: record the installed package in the user package registry
# (~/.cmake/packages/cupy_ipcpool_c/), so that find_package(cupy_ipcpool_c) finds it
# under a prefix CMake does not search by itself ($HOME/.local, /opt/...).  Skipped
# for staged installs (DESTDIR) and for /usr and /usr/local, which CMake searches.
# CIP_CMAKE_DIR (the package's directory under the prefix) is set before this runs.
set(_cip_dir "${CMAKE_INSTALL_PREFIX}/${CIP_CMAKE_DIR}")
if("$ENV{DESTDIR}" STREQUAL "" AND DEFINED ENV{HOME}
   AND NOT CMAKE_INSTALL_PREFIX MATCHES "^/usr(/local)?/?$")
    string(MD5 _cip_key "${_cip_dir}")
    set(_cip_entry "$ENV{HOME}/.cmake/packages/cupy_ipcpool_c/${_cip_key}")
    message(STATUS "Registering: ${_cip_entry} -> ${_cip_dir}")
    file(WRITE "${_cip_entry}" "${_cip_dir}\n")
endif()
