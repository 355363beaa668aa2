// The lane arithmetic of the kernels' shuffle reductions that are not tied to a matrix layout, as plain
// constexpr functions of the lane count: NVIDIA warps have 32 lanes and AMD wavefronts 64, so the number
// of butterfly steps, the xor masks and the number of per-warp partials all depend on the platform.
// Like lane_layout.hpp, this header includes no GPU header, so tests/cpu/test_wave_reduce.cpp replays the
// pattern for both lane counts on the host and the AMD-only cases (a butterfly step over xor 32, a block of
// a single wavefront) are exercised without an AMD machine. The device code supplies the operation (fmaxf,
// a softmax merge) and the shuffle; only which lane exchanges with which, and in what order, is decided here.
#pragma once

#include "../../types.hpp"

namespace vsa {
namespace gpu {
namespace wave_reduce {

// log2 of a power of two.
VSA_HOST_DEVICE constexpr int log2_exact(int n) { return n > 1 ? 1 + log2_exact(n / 2) : 0; }
VSA_HOST_DEVICE constexpr bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// ---- whole warp -------------------------------------------------------------------------------------------
// A butterfly over all `lanes` lanes: step s exchanges with lane ^ warp_mask(lanes, s), halving the distance
// from lanes / 2 down to 1. After warp_steps(lanes) steps every lane holds the reduction of the whole warp,
// so no broadcast follows.
VSA_HOST_DEVICE constexpr int warp_steps(int lanes) { return log2_exact(lanes); }
VSA_HOST_DEVICE constexpr int warp_mask(int lanes, int step) { return (lanes >> 1) >> step; }

// ---- whole block (every warp full) -----------------------------------------------------------------------
// After the warp butterfly, one lane per warp (lane 0) stores the warp's result in slot block_slot of a
// shared array of block_warps floats; after a barrier every thread folds the slots in slot order (slot 0
// first), so every thread computes the same value. A block of a single warp skips the shared array: the
// butterfly already gave every lane the result. The thread index is threadIdx.x as the runtime gives it,
// unsigned: signed arithmetic would make the compiler handle negative indices that never occur.
VSA_HOST_DEVICE constexpr int block_warps(int threads, int lanes) { return threads / lanes; }
VSA_HOST_DEVICE constexpr bool block_whole_warps(int threads, int lanes) {
  return threads >= lanes && threads % lanes == 0;
}
VSA_HOST_DEVICE constexpr unsigned block_slot(unsigned thread, int lanes) { return thread / unsigned(lanes); }
VSA_HOST_DEVICE constexpr bool block_slot_writer(unsigned thread, int lanes) { return thread % unsigned(lanes) == 0; }

// ---- groups of consecutive threads -----------------------------------------------------------------------
// `width` consecutive threads share one item (a row): thread t works on item group_item(t, width) as part
// group_part(t, width). Their partials are combined by a butterfly over xor group_mask(s),
// s < group_steps(width), which stays inside the group and the warp when width is a power of two no larger
// than the warp; every thread of the group then holds the combined value.
VSA_HOST_DEVICE constexpr bool group_fits(int width, int lanes) { return power_of_two(width) && width <= lanes; }
VSA_HOST_DEVICE constexpr int group_item(int thread, int width) { return thread / width; }
VSA_HOST_DEVICE constexpr int group_part(int thread, int width) { return thread % width; }
VSA_HOST_DEVICE constexpr int group_steps(int width) { return log2_exact(width); }
VSA_HOST_DEVICE constexpr int group_mask(int step) { return 1 << step; }

} // namespace wave_reduce
} // namespace gpu
} // namespace vsa
