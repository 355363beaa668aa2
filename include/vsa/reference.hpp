// The CPU reference of the whole op: every stage as a plain host function with the same name and
// arguments as the GPU entry point (minus the stream), in namespace vsa::reference. It computes in
// double and is the ground truth the kernels are tested against.
#pragma once

#include "numeric.hpp"
#include "reference/block_means.hpp"
#include "reference/coarse_attention.hpp"
#include "reference/combine.hpp"
#include "reference/detail.hpp"
#include "reference/index.hpp"
#include "reference/joint.hpp"
#include "reference/layout.hpp"
#include "reference/linear_attention.hpp"
#include "reference/op.hpp"
#include "reference/select.hpp"
#include "reference/sparse_attention.hpp"
