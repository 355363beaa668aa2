// vsa: Video Sparse Attention. Include this one header.
//
// Host code always gets the vocabulary (types, geometry, validation) and the CPU reference of every stage
// and of the whole op. Code compiled by a GPU compiler (hipcc for AMD, nvcc for NVIDIA) also gets the
// GPU entry points, which take the same arguments plus a stream.
#pragma once

#include "geometry.hpp"
#include "numeric.hpp"
#include "reference.hpp"
#include "types.hpp"
#include "validate.hpp"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VSA_HAS_GPU 1
#include "gpu/block_means.hpp"
// The sparse stage before the coarse pass, as in op.hpp (the order in which their kernels are emitted).
#include "gpu/sparse_attention.hpp"
#include "gpu/joint_attention.hpp"
#include "gpu/coarse_attention.hpp"
#include "gpu/combine.hpp"
#include "gpu/index.hpp"
#include "gpu/layout.hpp"
#if __has_include("gpu/linear_attention.hpp")
#include "gpu/linear_attention.hpp"
#endif
#include "gpu/op.hpp"
#include "gpu/packed_attention.hpp"
#include "gpu/packed_op.hpp"
#include "gpu/select.hpp"
#endif
