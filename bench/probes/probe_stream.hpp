// The probes' K/V tile stream (kv_stream.cu, raster_boxes.cu): a block of Streams query tiles of one head, each walking
// its list of K entries out of N key tiles; a producer lane asks for every entry's K and then V tile, in turn for each
// stream, into that stream's ring of Tiles stages (a full and an empty barrier a stage); a consumer warp a stream waits
// for each tile and gives its stage back. No products: what the copy engine and the L2 deliver to that structure.
// load(tile, value (0: K, 1: V), key tile, head, barrier) asks for one tile as the probe's variant copies it.
#pragma once

#include <vsa/gpu/arch/matrix.hpp>

#include <cstdint>

namespace probe {

#if VSA_WGMMA // the copy engine's device side exists in sm_90a code only
template <int Streams, int Tiles, int D, int N, int K, class Load>
__device__ __forceinline__ void stream_block(const int32_t* lists, unsigned* sink, Load load) {
  namespace tma = vsa::gpu::tma;
  extern __shared__ uint4 raw[];
  uint16_t* sm = vsa::gpu::aligned_smem(raw);
  __shared__ __align__(8) uint64_t full[Streams][Tiles], empty[Streams][Tiles];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0)
    for (int c = 0; c < Streams; ++c)
      for (int t = 0; t < Tiles; ++t) tma::barrier_init(&full[c][t], 1), tma::barrier_init(&empty[c][t], 1);
  __syncthreads();
  const int h = blockIdx.y;
  if (warp == Streams) { // the producer: one lane feeds every stream in turn
    if (lane != 0) return;
    int stage[Streams] = {}, round[Streams] = {};
    for (int e = 0; e < 2 * K; ++e)
      for (int c = 0; c < Streams; ++c) {
        const int i = blockIdx.x * Streams + c;
        const int j = lists[(h * N + i) * K + e / 2];
        const int st = stage[c];
        tma::wait(&empty[c][st], (round[c] & 1) ^ 1u);
        load(vsa::gpu::smem_tile<D>{sm + (c * Tiles + st) * 64 * D}, e % 2, j, h, &full[c][st]);
        if (++stage[c] == Tiles) stage[c] = 0, ++round[c];
      }
    return;
  }
  const int c = warp;
  unsigned acc = 0;
  for (int e = 0, st = 0, round = 0; e < 2 * K; ++e) {
    tma::wait(&full[c][st], round & 1);
    acc += sm[(c * Tiles + st) * 64 * D + lane];
    __syncwarp();
    if (lane == 0) tma::arrive(&empty[c][st]);
    if (++st == Tiles) st = 0, ++round;
  }
  if (acc == 0xdeadbeef) sink[0] = acc;
}
#endif

} // namespace probe
