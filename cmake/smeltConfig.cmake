# CMake package for smelt (Apache-2.0; see LICENSE), installed by
# `cmake --install`. find_package(smelt) gives two targets:
#   smelt::smelt         the shared library (libsmelt.so.0)
#   smelt::smelt_static  the static library, which brings -lm -ldl and threads
include(CMakeFindDependencyMacro)
find_dependency(Threads)
include("${CMAKE_CURRENT_LIST_DIR}/smeltTargets.cmake")
