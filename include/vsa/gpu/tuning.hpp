// The tuning tables, one per architecture family (tuning/: hopper.hpp, nvidia_mma.hpp, cdna.hpp; their shape in
// tuning/table.hpp), and the one place that picks among them. A kernel and its host code read their stage counts,
// launch bounds and loop variants from the table of the code the kernel runs as, through the plans that size
// shared memory (smem_plan, the linear kernels' *_shape structs), never from numbers of their own.
#pragma once

#include "platform.hpp"
#include "tuning/cdna.hpp"
#include "tuning/hopper.hpp"
#include "tuning/nvidia_mma.hpp"

namespace vsa {
namespace gpu {
namespace tuning {

// The table of the code a kernel runs as. `hopper`: Hopper code, as the device pass knows it (hopper_code for the
// attention kernels, layer_tn for the linear ones) and the host learns it of a kernel (runs_as_hopper). AMD has
// one table.
constexpr table of([[maybe_unused]] bool hopper) {
#if VSA_PLATFORM_AMD
  return cdna_table();
#else
  return hopper ? hopper_table() : nvidia_mma_table();
#endif
}

// What host and device must agree on whatever the code runs as is the platform's, the same in both NVIDIA tables.
static_assert(of(true).copy_stages == of(false).copy_stages && of(true).min_blocks_bound == of(false).min_blocks_bound,
              "a platform's tables differ in its platform-wide entries");

} // namespace tuning
} // namespace gpu
} // namespace vsa
