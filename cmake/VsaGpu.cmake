# GPU build helpers of vsa, shared by the library's own build and by projects that use the installed package.
#
#   vsa_enable_gpu(<none|AMD|NVIDIA> [AMD_TARGETS <gfx...>] [NVIDIA_ARCHS <arch...>])
#       Macro; call it once, from the top-level CMakeLists.txt (enable_language must run at directory scope).
#       NVIDIA: enables the CUDA language and finds the CUDA toolkit (CUB comes with it).
#       AMD: expects CMAKE_CXX_COMPILER to be hipcc (or ROCm's clang++) and finds the hip and rocprim packages.
#       Sets VSA_GPU_PLATFORM (none, AMD or NVIDIA) in the caller's scope.
#   vsa_gpu_sources(<target> <file...>)
#       Adds files that include vsa/gpu/ headers to a target and compiles them for the enabled GPU platform.
#   vsa_host_sources(<target> <file...>)
#       Adds plain C++ files; under hipcc they are kept out of the GPU compilation (hipcc treats .cpp as HIP).
#   vsa_gpu_aggregate(<name>)
#       Adds a target <name> that builds every target given GPU sources so far, and writes one line per target to
#       <build dir>/<name>.txt (<name>-<config>.txt for multi-config generators): the path of its binary and of
#       its object files, tab-separated.
#   vsa_target_warnings(<target>)
#       -Wall -Wextra for every language of the target; -Werror too when VSA_WARNINGS_AS_ERRORS is ON.
include_guard(GLOBAL)

# Maps the accepted spellings (any case; OFF or empty for none) onto none, AMD or NVIDIA.
function(vsa_normalize_gpu_platform out value)
  string(TOUPPER "${value}" upper)
  if(upper STREQUAL ""
     OR upper STREQUAL "NONE"
     OR upper STREQUAL "OFF")
    set(${out}
        none
        PARENT_SCOPE)
  elseif(upper STREQUAL "AMD" OR upper STREQUAL "NVIDIA")
    set(${out}
        ${upper}
        PARENT_SCOPE)
  else()
    message(FATAL_ERROR "vsa: GPU platform '${value}' is not one of none, AMD, NVIDIA")
  endif()
endfunction()

macro(vsa_enable_gpu _vsa_platform)
  cmake_parse_arguments(_vsa_gpu "" "" "AMD_TARGETS;NVIDIA_ARCHS" ${ARGN})
  vsa_normalize_gpu_platform(VSA_GPU_PLATFORM "${_vsa_platform}")
  set_property(GLOBAL PROPERTY VSA_GPU_PLATFORM ${VSA_GPU_PLATFORM})

  if(VSA_GPU_PLATFORM STREQUAL "NVIDIA")
    if(NOT _vsa_gpu_NVIDIA_ARCHS)
      set(_vsa_gpu_NVIDIA_ARCHS 80 90a)
    endif()
    set_property(GLOBAL PROPERTY VSA_GPU_NVIDIA_ARCHS "${_vsa_gpu_NVIDIA_ARCHS}")
    # Set before enable_language, so that CMake's compiler check already proves nvcc knows these architectures.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES ${_vsa_gpu_NVIDIA_ARCHS})
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    message(STATUS "vsa: NVIDIA build with nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${_vsa_gpu_NVIDIA_ARCHS}")
  elseif(VSA_GPU_PLATFORM STREQUAL "AMD")
    if(NOT _vsa_gpu_AMD_TARGETS)
      set(_vsa_gpu_AMD_TARGETS gfx90a gfx940)
    endif()
    set_property(GLOBAL PROPERTY VSA_GPU_AMD_TARGETS "${_vsa_gpu_AMD_TARGETS}")
    # CMake's HIP language does not find distribution layouts such as Debian's, so HIP sources are compiled as
    # C++ by hipcc with -xhip (see vsa_gpu_sources).
    if(NOT CMAKE_CXX_COMPILER MATCHES "hipcc|clang")
      message(FATAL_ERROR "vsa: an AMD build compiles with hipcc; configure with -DCMAKE_CXX_COMPILER=hipcc "
                          "(CMAKE_CXX_COMPILER is ${CMAKE_CXX_COMPILER})")
    endif()
    # hipcc asks the machine's GPUs for a target whenever it is given none (CMake's own checks, plain C++ files),
    # which fails noisily on machines without one; this names a target for the checks run while configuring.
    if(NOT DEFINED ENV{HCC_AMDGPU_TARGET})
      list(GET _vsa_gpu_AMD_TARGETS 0 _vsa_gpu_first)
      set(ENV{HCC_AMDGPU_TARGET} ${_vsa_gpu_first})
    endif()
    find_package(hip REQUIRED CONFIG)
    find_package(rocprim REQUIRED CONFIG)
    message(STATUS "vsa: AMD build with ${CMAKE_CXX_COMPILER} (HIP ${hip_VERSION}, rocPRIM ${rocprim_VERSION}), "
                   "targets ${_vsa_gpu_AMD_TARGETS}")
  endif()
endmacro()

# hipcc asks the machine's GPUs for a target whenever it is given none, a noisy failure on build machines without
# one, so every hipcc command line of an AMD build names the targets: hipcc consumes --offload-arch itself and uses
# it only for HIP sources (ROCm's clang++ would warn about it on plain C++ files, so it only gets it for HIP ones).
function(_vsa_amd_arch_options out)
  get_property(targets GLOBAL PROPERTY VSA_GPU_AMD_TARGETS)
  set(options)
  foreach(t IN LISTS targets)
    list(APPEND options --offload-arch=${t})
  endforeach()
  set(${out}
      ${options}
      PARENT_SCOPE)
endfunction()

function(_vsa_amd_target_setup target)
  get_target_property(done ${target} VSA_AMD_SETUP_DONE)
  if(done)
    return()
  endif()
  set_property(TARGET ${target} PROPERTY VSA_AMD_SETUP_DONE ON)
  if(CMAKE_CXX_COMPILER MATCHES "hipcc")
    _vsa_amd_arch_options(options)
    target_link_options(${target} PRIVATE ${options})
  endif()
endfunction()

function(vsa_gpu_sources target)
  get_property(platform GLOBAL PROPERTY VSA_GPU_PLATFORM)
  set(files ${ARGN})
  target_sources(${target} PRIVATE ${files})
  set_property(GLOBAL APPEND PROPERTY VSA_GPU_TARGETS ${target})
  if(platform STREQUAL "NVIDIA")
    get_property(archs GLOBAL PROPERTY VSA_GPU_NVIDIA_ARCHS)
    set_source_files_properties(${files} TARGET_DIRECTORY ${target} PROPERTIES LANGUAGE CUDA)
    set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${archs}")
    target_compile_features(${target} PRIVATE cuda_std_17)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
    target_link_libraries(${target} PRIVATE CUDA::toolkit)
  elseif(platform STREQUAL "AMD")
    _vsa_amd_arch_options(options)
    set_property(
      SOURCE ${files}
      TARGET_DIRECTORY ${target}
      APPEND
      PROPERTY COMPILE_OPTIONS -xhip ${options})
    target_link_libraries(${target} PRIVATE hip::host roc::rocprim)
    _vsa_amd_target_setup(${target})
  else()
    message(FATAL_ERROR "vsa_gpu_sources(${target}): no GPU platform enabled (call vsa_enable_gpu with AMD or NVIDIA)")
  endif()
endfunction()

function(vsa_host_sources target)
  get_property(platform GLOBAL PROPERTY VSA_GPU_PLATFORM)
  set(files ${ARGN})
  target_sources(${target} PRIVATE ${files})
  if(platform STREQUAL "AMD")
    set(options)
    if(CMAKE_CXX_COMPILER MATCHES "hipcc")
      _vsa_amd_arch_options(options)
    endif()
    set_property(
      SOURCE ${files}
      TARGET_DIRECTORY ${target}
      APPEND
      PROPERTY COMPILE_OPTIONS -xc++ ${options})
    _vsa_amd_target_setup(${target})
  endif()
endfunction()

function(vsa_target_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
                                           $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(VSA_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>
                                             $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
  endif()
endfunction()

function(vsa_gpu_aggregate name)
  get_property(targets GLOBAL PROPERTY VSA_GPU_TARGETS)
  add_custom_target(${name})
  set(paths "")
  foreach(t IN LISTS targets)
    add_dependencies(${name} ${t})
    # The binary, then its object files, tab-separated.
    string(APPEND paths "$<TARGET_FILE:${t}>\t$<JOIN:$<TARGET_OBJECTS:${t}>,\t>\n")
  endforeach()
  set(output ${CMAKE_CURRENT_BINARY_DIR}/${name}.txt)
  if(CMAKE_CONFIGURATION_TYPES)
    set(output ${CMAKE_CURRENT_BINARY_DIR}/${name}-$<CONFIG>.txt)
  endif()
  file(GENERATE OUTPUT ${output} CONTENT "${paths}")
endfunction()
