// The probes' one error rule: a failed runtime call prints what failed and makes the calling function return 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CHECK(x)                                                                                                       \
  do {                                                                                                                 \
    const cudaError_t e = (x);                                                                                         \
    if (e != cudaSuccess) {                                                                                            \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e));                                                              \
      return 1;                                                                                                        \
    }                                                                                                                  \
  } while (0)
