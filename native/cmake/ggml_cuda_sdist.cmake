# ggml with its CUDA backend, built from the libggml-python source distribution of the version
# in the build environment (the pinned build requirement), for `pip install .
# -Ccmake.define.OTT_CUDA=ON` when no ggml_DIR names a CUDA-enabled ggml. The libraries are
# installed beside libott (ott_gguf/_native, run path $ORIGIN); the libggml-python wheel's
# CPU-only ggml is then not loaded by the package.
#
#   OTT_GGML_SDIST   a libggml_python-<version>.tar.gz already downloaded (default: fetched
#                    with `python -m pip download --no-deps --no-binary :all:` from pip's
#                    configured index, as bench/build_cuda.sh does; without build isolation,
#                    so that reading its metadata takes the build environment's
#                    scikit-build-core and setuptools-scm instead of building CMake)
# A version whose sha256 is listed below is checked against it.
# Sets GGML_LIB_DIR to "$ORIGIN" and defines ggml::ggml, ggml::ggml-base, ggml::ggml-cpu and
# ggml::ggml-cuda.

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "ott: OTT_CUDA=ON but no CUDA compiler (nvcc) was found")
endif()

# cuBLAS from the CUDA toolkit, else from the nvidia-cublas wheel in the Python environment
find_package(CUDAToolkit REQUIRED)
if(NOT TARGET CUDA::cublas)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c [=[
import glob, importlib, os
for name in ("nvidia.cu13", "nvidia.cublas"):  # the CUDA 13 and CUDA 12 wheels' layouts
    try:
        path = list(importlib.import_module(name).__path__)[0]
    except ImportError:
        continue
    if glob.glob(os.path.join(path, "lib", "libcublas.so*")):
        print(path)
        break
]=]
    OUTPUT_VARIABLE _cublas OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc ERROR_QUIET)
  file(GLOB _cublas_lib "${_cublas}/lib/libcublas.so*")
  file(GLOB _cublasLt_lib "${_cublas}/lib/libcublasLt.so*")
  if(NOT _rc EQUAL 0 OR NOT _cublas_lib OR NOT _cublasLt_lib)
    message(FATAL_ERROR "ott: OTT_CUDA=ON needs cuBLAS: the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} has "
                        "none and no nvidia-cublas wheel is installed (pip install nvidia-cublas)")
  endif()
  list(GET _cublas_lib 0 _cublas_lib)
  list(GET _cublasLt_lib 0 _cublasLt_lib)
  foreach(_lib cublasLt cublas)
    add_library(CUDA::${_lib} SHARED IMPORTED)
    set_target_properties(CUDA::${_lib} PROPERTIES IMPORTED_LOCATION "${_${_lib}_lib}"
                          INTERFACE_INCLUDE_DIRECTORIES "${_cublas}/include" INTERFACE_LINK_LIBRARIES CUDA::cudart)
  endforeach()
  set_property(TARGET CUDA::cublas APPEND PROPERTY INTERFACE_LINK_LIBRARIES CUDA::cublasLt)
  message(STATUS "ott: cuBLAS from the nvidia-cublas wheel (${_cublas})")
endif()

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import importlib.metadata as m; print(m.version('libggml-python'))"
  OUTPUT_VARIABLE _ggml_version OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "ott: OTT_CUDA=ON builds ggml from the libggml-python source distribution of the "
                      "installed version, but libggml-python is not installed in ${Python_EXECUTABLE}")
endif()

set(OTT_GGML_SDIST "" CACHE FILEPATH "libggml_python-<version>.tar.gz to build ggml's CUDA backend from")
set(_sdist "${OTT_GGML_SDIST}")
if(NOT _sdist)
  set(_dl "${CMAKE_BINARY_DIR}/ggml-sdist")
  set(_sdist "${_dl}/libggml_python-${_ggml_version}.tar.gz")
  if(NOT EXISTS "${_sdist}")
    message(STATUS "ott: fetching the libggml-python ${_ggml_version} source distribution")
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m pip download --no-deps --no-binary :all: --no-build-isolation
              --disable-pip-version-check -q
              "libggml-python==${_ggml_version}" -d "${_dl}"
      RESULT_VARIABLE _rc ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0 OR NOT EXISTS "${_sdist}")
      message(FATAL_ERROR "ott: cannot fetch libggml-python==${_ggml_version} (sdist) with pip: ${_err}"
                          "give a downloaded one with -Ccmake.define.OTT_GGML_SDIST=PATH")
    endif()
  endif()
endif()

set(_known_sha256_0.20.2.post1 e47ff53506342959ffb3ce15380b82828fea10ec5f208f9ef6915895f1a7a176)
if(DEFINED _known_sha256_${_ggml_version})
  file(SHA256 "${_sdist}" _sha)
  if(NOT _sha STREQUAL _known_sha256_${_ggml_version})
    message(FATAL_ERROR "ott: ${_sdist} has sha256 ${_sha}, expected ${_known_sha256_${_ggml_version}}")
  endif()
endif()

set(_src "${CMAKE_BINARY_DIR}/ggml-src")
if(NOT EXISTS "${_src}/ggml/CMakeLists.txt")
  file(ARCHIVE_EXTRACT INPUT "${_sdist}" DESTINATION "${_src}.tmp")
  file(GLOB _top LIST_DIRECTORIES true "${_src}.tmp/*")
  file(RENAME "${_top}" "${_src}")
  file(REMOVE_RECURSE "${_src}.tmp")
endif()

# as bench/build_cuda.sh and the wheel: portable CPU kernels (AVX2/FMA/F16C), no OpenMP; CUDA
# graphs on (off by default outside llama.cpp): ggml-cuda replays each of the executor's graph
# segments (cuda/executor.h) once its nodes repeat from one step to the next
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 86 89 90)
endif()
set(BUILD_SHARED_LIBS ON)
set(GGML_CUDA ON CACHE BOOL "" FORCE)
set(GGML_NATIVE OFF CACHE BOOL "" FORCE)
set(GGML_OPENMP OFF CACHE BOOL "" FORCE)
set(GGML_CUDA_GRAPHS ON CACHE BOOL "" FORCE)
set(GGML_CCACHE OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_TESTS OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_EXAMPLES OFF CACHE BOOL "" FORCE)
add_subdirectory("${_src}/ggml" "${CMAKE_BINARY_DIR}/ggml-build" EXCLUDE_FROM_ALL)
unset(BUILD_SHARED_LIBS)

foreach(_t ggml ggml-base ggml-cpu ggml-cuda)
  if(NOT TARGET ${_t})
    message(FATAL_ERROR "ott: the libggml-python ${_ggml_version} sources define no target ${_t}")
  endif()
  if(NOT TARGET ggml::${_t})
    add_library(ggml::${_t} ALIAS ${_t})
  endif()
  set_target_properties(${_t} PROPERTIES INSTALL_RPATH "$ORIGIN" INSTALL_RPATH_USE_LINK_PATH ON)
  # one file per library in the wheel (a wheel stores a versioned name's symlinks as copies)
  set_property(TARGET ${_t} PROPERTY VERSION)
  set_property(TARGET ${_t} PROPERTY SOVERSION)
  install(TARGETS ${_t} LIBRARY DESTINATION ott_gguf/_native COMPONENT ott)
endforeach()
set(GGML_LIB_DIR "$ORIGIN")
message(STATUS "ott: ggml ${_ggml_version} with CUDA from ${_sdist} (architectures ${CMAKE_CUDA_ARCHITECTURES})")
