// Probe (not part of the build): tiles copied by the copy engine straight from tensors in raster order, one tensor map
// a kind of tile (bench/NOTES.md, "Plan: inputs in raster order"), against tiles of the tiled tensor.
//
// A tile's valid tokens are, in raster order, the te × he × we sub-box at (4·tt, 4·th, 4·tw) of the grid, and the tiled
// layout puts them in the tile's first slots, row-major over that sub-box (geometry.hpp). A grid has at most eight
// kinds of tile (each extent 4 or the remainder), so eight 5-d maps whose boxes are (64 columns, we, he, te) land every
// tile's valid tokens in shared-memory rows 0 … valid − 1, swizzled as a whole tile's (the 128-byte swizzle is a
// function of the address). The batch folds into time ([B, S, H, D]: frames of every sample in one axis; a box never
// crosses a sample, its te being the remainder) or into the heads ([B, H, S, D]).
//
// 1. check: every tile of every head and sample of small grids with partial tiles on every axis, both layouts, head
//    dims 64 and 128, B = 2: the rows the copy lands equal the tiled tensor's (made on the host from the geometry),
//    bit for bit, and the copy announces exactly the bytes it writes (a wrong count hangs or fails the barrier).
// 2. stream: the forward's K/V stream on wan2.1-1.3b-480p's uniform lists (bench/probes/kv_stream.cu's block), the
//    tiles whole from the tiled tensors against the valid tokens from the raster ones (three map layouts), and two
//    controls: the tiled tensors through a 5-d box of the same rows (the box's shape alone), and the raster ones
//    through a 2-d box a (t, h) run of a tile (more, smaller copies). bench/NOTES.md v37 has the figures.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a --expt-relaxed-constexpr -I include -o raster_boxes bench/probes/raster_boxes.cu
//   ./raster_boxes
#include "vsa/vsa.hpp"

#include "probe_check.hpp"
#include "probe_inputs.hpp"
#include "probe_stream.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using vsa::grid3;
using vsa::tile_geometry;
using vsa::gpu::smem_tile;
using vsa::gpu::tma_map;

// The tensor in raster order: element strides, and which axis the batch folds into.
struct raster_tensor {
  const void* data;
  int64_t batch, heads, head_dim;
  int64_t batch_stride, token_stride, head_stride;
  bool heads_major; // [B, H, S, D]: the batch folds into the heads; else into time
  bool heads_outer; // [B, S, H, D] only: the head the map's outermost axis (D, W, H, B·T, heads), not its second
};

// Kind k of a grid: bit 2 a partial extent in t, bit 1 in h, bit 0 in w. Its extents.
__host__ __device__ inline grid3 kind_extent(const grid3& g, int k) {
  return {k & 4 ? g.t % 4 : 4, k & 2 ? g.h % 4 : 4, k & 1 ? g.w % 4 : 4};
}
__host__ __device__ inline int kind_of(const tile_geometry& geo, int64_t n) {
  const int64_t tw = n % geo.tiles.w, th = (n / geo.tiles.w) % geo.tiles.h, tt = n / (geo.tiles.w * geo.tiles.h);
  return (4 * tt + 4 > geo.grid.t ? 4 : 0) | (4 * th + 4 > geo.grid.h ? 2 : 0) | (4 * tw + 4 > geo.grid.w ? 1 : 0);
}

// The map of kind k's boxes; false where the kind does not occur or the strides do not fold.
bool encode_kind_map(tma_map& map, const raster_tensor& x, const grid3& g, int k) {
  const grid3 e = kind_extent(g, k);
  if (e.t == 0 || e.h == 0 || e.w == 0) return false;
  const auto encode = vsa::gpu::detail::tma_encoder();
  if (encode == nullptr) return false;
  const int64_t ts = x.token_stride * 2;
  cuuint64_t dims[5], strides[4];
  cuuint32_t box[5];
  if (x.heads_major) { // (D, W, H, T, B·heads)
    if (x.batch_stride != x.heads * x.head_stride) return false;
    const cuuint64_t d[5] = {cuuint64_t(x.head_dim), cuuint64_t(g.w), cuuint64_t(g.h), cuuint64_t(g.t),
                             cuuint64_t(x.batch * x.heads)};
    const cuuint64_t s[4] = {cuuint64_t(ts), cuuint64_t(g.w * ts), cuuint64_t(g.h * g.w * ts),
                             cuuint64_t(x.head_stride * 2)};
    const cuuint32_t b[5] = {64, cuuint32_t(e.w), cuuint32_t(e.h), cuuint32_t(e.t), 1};
    std::copy(d, d + 5, dims), std::copy(s, s + 4, strides), std::copy(b, b + 5, box);
  } else if (x.heads_outer) { // (D, W, H, B·T, heads)
    if (x.batch_stride != g.t * g.h * g.w * x.token_stride) return false;
    const cuuint64_t d[5] = {cuuint64_t(x.head_dim), cuuint64_t(g.w), cuuint64_t(g.h), cuuint64_t(x.batch * g.t),
                             cuuint64_t(x.heads)};
    const cuuint64_t s[4] = {cuuint64_t(ts), cuuint64_t(g.w * ts), cuuint64_t(g.h * g.w * ts),
                             cuuint64_t(x.head_stride * 2)};
    const cuuint32_t b[5] = {64, cuuint32_t(e.w), cuuint32_t(e.h), cuuint32_t(e.t), 1};
    std::copy(d, d + 5, dims), std::copy(s, s + 4, strides), std::copy(b, b + 5, box);
  } else { // (D, heads, W, H, B·T)
    if (x.batch_stride != g.t * g.h * g.w * x.token_stride) return false;
    const cuuint64_t d[5] = {cuuint64_t(x.head_dim), cuuint64_t(x.heads), cuuint64_t(g.w), cuuint64_t(g.h),
                             cuuint64_t(x.batch * g.t)};
    const cuuint64_t s[4] = {cuuint64_t(x.head_stride * 2), cuuint64_t(ts), cuuint64_t(g.w * ts),
                             cuuint64_t(g.h * g.w * ts)};
    const cuuint32_t b[5] = {64, 1, cuuint32_t(e.w), cuuint32_t(e.h), cuuint32_t(e.t)};
    std::copy(d, d + 5, dims), std::copy(s, s + 4, strides), std::copy(b, b + 5, box);
  }
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map.bytes), CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(x.data),
                dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

struct kind_maps {
  tma_map map[8];
};

// Controls for the stream's cost: the tiled tensor [1, N·64, H, D] through a 5-d box of the same 64 rows, (64 columns,
// 4, 4, 4 tokens, 1 head) over (D, 4, 4, N·64/16, heads) (map[0]); and the raster tensor [1, S, H, D] through 2-d
// boxes (64 columns, we tokens) over (D, S·H as tokens of one head…) one a (t, h) run of a tile (map[k], box we).
bool encode_tiled_as_5d(tma_map& map, const void* data, int64_t tokens, int64_t heads, int64_t d) {
  const auto encode = vsa::gpu::detail::tma_encoder();
  const int64_t ts = heads * d * 2;
  const cuuint64_t dims[5] = {cuuint64_t(d), 4, 4, cuuint64_t(tokens / 16), cuuint64_t(heads)};
  const cuuint64_t strides[4] = {cuuint64_t(ts), cuuint64_t(4 * ts), cuuint64_t(16 * ts), cuuint64_t(d * 2)};
  const cuuint32_t box[5] = {64, 4, 4, 4, 1}, unit[5] = {1, 1, 1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map.bytes), CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(data),
                dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
// The tiled tensor [1, N·64, H, D] with boxes of `rows` tokens (64 columns × rows × 1 × 1): a step's rows only.
bool encode_tiled_rows(tma_map& map, const void* data, int64_t tokens, int64_t heads, int64_t d, int rows) {
  const auto encode = vsa::gpu::detail::tma_encoder();
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(tokens), cuuint64_t(heads), 1};
  const cuuint64_t strides[3] = {cuuint64_t(heads * d * 2), cuuint64_t(d * 2), cuuint64_t(tokens * heads * d * 2)};
  const cuuint32_t box[4] = {64, cuuint32_t(rows), 1, 1}, unit[4] = {1, 1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map.bytes), CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(data),
                dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
bool encode_runs(tma_map& map, const void* data, int64_t tokens, int64_t heads, int64_t d, int run) {
  const auto encode = vsa::gpu::detail::tma_encoder();
  const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(tokens), cuuint64_t(heads)};
  const cuuint64_t strides[2] = {cuuint64_t(heads * d * 2), cuuint64_t(d * 2)};
  const cuuint32_t box[3] = {64, cuuint32_t(run), 1}, unit[3] = {1, 1, 1};
  return encode(reinterpret_cast<CUtensorMap*>(map.bytes), CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(data),
                dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#if VSA_WGMMA
__device__ __forceinline__ void load_box5(uint16_t* dst, const tma_map* map, uint64_t* bar, int c0, int c1, int c2,
                                          int c3, int c4) {
  namespace tma = vsa::gpu::tma;
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
               "%5, %6}], [%7];" ::"r"(tma::smem_address(dst)),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
               "r"(tma::smem_address(bar))
               : "memory");
}
// Thread 0: tile n's valid tokens of head h, sample b into t (D/64 panels), counted on bar (one arrival announcing
// their bytes).
// mode: 0 [B, S, H, D] with the head the map's second axis, 1 its outermost, 2 [B, H, S, D].
template <int D> __device__ __forceinline__ void load_raster_tile(smem_tile<D> t, const kind_maps& maps, uint64_t* bar,
                                                                  const tile_geometry& geo, int mode, int64_t heads,
                                                                  int64_t n, int64_t h, int64_t b) {
  namespace tma = vsa::gpu::tma;
  const int k = kind_of(geo, n);
  const int64_t tw = n % geo.tiles.w, th = (n / geo.tiles.w) % geo.tiles.h, tt = n / (geo.tiles.w * geo.tiles.h);
  tma::arrive_expect(bar, static_cast<uint32_t>(geo.valid(n) * D * 2));
  const tma_map* map = &maps.map[k];
#pragma unroll
  for (int c = 0; c < D / 64; ++c) {
    uint16_t* dst = t.base + c * vsa::gpu::smem_layout::panel;
    if (mode == 2)
      load_box5(dst, map, bar, 64 * c, int(4 * tw), int(4 * th), int(4 * tt), int(b * heads + h));
    else if (mode == 1)
      load_box5(dst, map, bar, 64 * c, int(4 * tw), int(4 * th), int(b * geo.grid.t + 4 * tt), int(h));
    else
      load_box5(dst, map, bar, 64 * c, int(h), int(4 * tw), int(4 * th), int(b * geo.grid.t + 4 * tt));
  }
}
#endif

#if VSA_WGMMA
__device__ __forceinline__ void load_box3(uint16_t* dst, const tma_map* map, uint64_t* bar, int c0, int c1, int c2) {
  namespace tma = vsa::gpu::tma;
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
               "[%5];" ::"r"(tma::smem_address(dst)),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(tma::smem_address(bar))
               : "memory");
}
// Mode 3: the tiled tile n as one 5-d box a panel (encode_tiled_as_5d). Mode 4: the raster tile n as a 2-d box a (t, h)
// run a panel (encode_runs; map k has runs of we tokens), each landing at its rows.
template <int D> __device__ __forceinline__ void load_control(smem_tile<D> t, const kind_maps& maps, uint64_t* bar,
                                                              const tile_geometry& geo, int mode, int64_t n,
                                                              int64_t h) {
  namespace tma = vsa::gpu::tma;
  if (mode == 5) { // map 0, 1, 2: boxes of 16, 32, 64 rows; the tile's step_rows(valid)
    const int rows = vsa::gpu::detail::step_rows(geo.valid(n));
    tma::arrive_expect(bar, static_cast<uint32_t>(rows * D * 2));
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
      tma::load_box(t.base + c * vsa::gpu::smem_layout::panel,
                    &maps.map[rows == 16   ? 0
                              : rows == 32 ? 1
                                           : 2],
                    bar, 64 * c, int(n * 64), int(h), 0);
    return;
  }
  if (mode == 3) {
    tma::arrive_expect(bar, 64 * D * 2);
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
      load_box5(t.base + c * vsa::gpu::smem_layout::panel, &maps.map[0], bar, 64 * c, 0, 0, int(n * 4), int(h));
    return;
  }
  const int k = kind_of(geo, n);
  const grid3 e = kind_extent(geo.grid, k);
  const int64_t tw = n % geo.tiles.w, th = (n / geo.tiles.w) % geo.tiles.h, tt = n / (geo.tiles.w * geo.tiles.h);
  tma::arrive_expect(bar, static_cast<uint32_t>(e.t * e.h * e.w * D * 2));
  for (int lt = 0; lt < e.t; ++lt)
    for (int lh = 0; lh < e.h; ++lh) {
      const int64_t token = ((4 * tt + lt) * geo.grid.h + 4 * th + lh) * geo.grid.w + 4 * tw;
      const int row = (lt * int(e.h) + lh) * int(e.w);
#pragma unroll
      for (int c = 0; c < D / 64; ++c)
        load_box3(t.base + c * vsa::gpu::smem_layout::panel + row * 64, &maps.map[k], bar, 64 * c, int(token), int(h));
    }
}
#endif

// 1. One block a (tile, head, sample): the tile's valid rows through its kind's box, written out at their tiled slots
// (rows past valid: zeros), for the host to compare with the tiled tensor.
template <int D> __global__ void check_kernel(const __grid_constant__ kind_maps maps, tile_geometry geo, int mode,
                                              int64_t heads, uint16_t* out) {
#if VSA_WGMMA
  namespace tma = vsa::gpu::tma;
  extern __shared__ uint4 raw[];
  const smem_tile<D> t{vsa::gpu::aligned_smem(raw)};
  __shared__ __align__(8) uint64_t bar;
  const int64_t n = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  tma::init_barriers(&bar, 1, true, threadIdx.x);
  if (threadIdx.x == 0) load_raster_tile<D>(t, maps, &bar, geo, mode, heads, n, h, b);
  tma::wait(&bar, 0u);
  const int valid = geo.valid(n);
  uint16_t* dst = out + ((b * heads + h) * geo.num_tiles() + n) * 64 * D; // [B, H, N·64, D]
  for (int x = threadIdx.x; x < 64 * (D / 8); x += blockDim.x) {
    const int r = x / (D / 8), c = x % (D / 8);
    const uint4 v = r < valid ? *reinterpret_cast<const uint4*>(t.chunk(r, c)) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(dst + r * D + c * 8) = v;
  }
#else
  (void)maps, (void)geo, (void)mode, (void)heads, (void)out;
#endif
}

template <int D> int check(grid3 g, int mode) {
  const bool heads_major = mode == 2;
  const tile_geometry geo(g);
  const int64_t B = 2, H = 3, S = geo.raster_tokens(), N = geo.num_tiles(), elems = B * H * S * D;
  std::vector<uint16_t> x(elems);
  std::mt19937 rng(11);
  for (auto& e : x) e = static_cast<uint16_t>(rng());
  raster_tensor rt{};
  rt.batch = B, rt.heads = H, rt.head_dim = D, rt.batch_stride = H * S * D;
  rt.token_stride = heads_major ? D : H * D, rt.head_stride = heads_major ? S * D : D;
  rt.heads_major = heads_major, rt.heads_outer = mode == 1;
  uint16_t *dx, *dout;
  CHECK(cudaMalloc(&dx, elems * 2));
  CHECK(cudaMalloc(&dout, B * H * N * 64 * D * 2));
  CHECK(cudaMemcpy(dx, x.data(), elems * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dout, 0xff, B * H * N * 64 * D * 2));
  rt.data = dx;
  kind_maps maps{};
  int kinds = 0;
  for (int k = 0; k < 8; ++k) kinds += encode_kind_map(maps.map[k], rt, g, k);
  const int smem = smem_tile<D>::bytes + 1024;
  CHECK(cudaFuncSetAttribute(check_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  check_kernel<D><<<dim3(unsigned(N), unsigned(H), unsigned(B)), 128, smem>>>(maps, geo, mode, H, dout);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(B * H * N * 64 * D);
  CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  int64_t bad = 0, rows = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int s = 0; s < 64; ++s) {
          const int64_t r = geo.raster_of_slot(n, s);
          rows += r >= 0;
          for (int64_t d = 0; d < D; ++d) {
            const uint16_t want = r < 0 ? 0 : x[b * rt.batch_stride + r * rt.token_stride + h * rt.head_stride + d];
            bad += out[((b * H + h) * N + n) * 64 * D + s * D + d] != want;
          }
        }
  std::printf("check grid %lldx%lldx%lld %s D=%d: %d kinds, %lld tiles x %lld heads x %lld samples, %lld valid rows: "
              "%lld elements differ\n",
              (long long)g.t, (long long)g.h, (long long)g.w,
              mode == 2   ? "[B,H,S,D]"
              : mode == 1 ? "[B,S,H,D] head outer"
                          : "[B,S,H,D]",
              D, kinds, (long long)N, (long long)H, (long long)B, (long long)rows, (long long)bad);
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dout));
  return bad == 0 ? 0 : 1;
}

// 2. The K/V stream of kv_stream.cu: two query tiles a block, a producer lane feeding both rings of four tiles, every
// list entry's K and V; Raster: through the kind maps from raster tensors (the valid tokens), else whole tiles.
constexpr int SN = 624, SH = 12, SD = 128, SK = 63, Streams = 2, Tiles = 4;
// Mode: −1 whole tiles from the tiled tensors, else load_raster_tile's (0-2) or load_control's (3, 4).
template <int Mode> __global__ void __launch_bounds__(32 * (Streams + 1), 1)
    stream_kernel(const __grid_constant__ tma_map kmap, const __grid_constant__ tma_map vmap,
                  const __grid_constant__ kind_maps kmaps, const __grid_constant__ kind_maps vmaps, tile_geometry geo,
                  const int32_t* lists, unsigned* sink) {
#if VSA_WGMMA
  probe::stream_block<Streams, Tiles, SD, SN, SK>(
      lists, sink, [&](smem_tile<SD> t, int value, int j, int h, uint64_t* bar) {
        if constexpr (Mode >= 3)
          load_control<SD>(t, value ? vmaps : kmaps, bar, geo, Mode, j, h);
        else if constexpr (Mode >= 0)
          load_raster_tile<SD>(t, value ? vmaps : kmaps, bar, geo, Mode, SH, j, h, 0);
        else
          vsa::gpu::tma::load_tile<SD>(t, value ? &vmap : &kmap, bar, j * 64, h, 0);
      });
#else
  (void)kmap, (void)vmap, (void)kmaps, (void)vmaps, (void)geo, (void)lists, (void)sink;
#endif
}

template <int Mode> int stream(const tma_map& km, const tma_map& vm, const kind_maps& kk, const kind_maps& vk,
                               const tile_geometry& geo, const int32_t* lists, unsigned* sink, double valid_share) {
  constexpr bool Raster = Mode >= 0 && Mode != 3; // moved: share of the whole tiles' bytes
  const auto kernel = stream_kernel<Mode>;
  const int smem = Streams * Tiles * 64 * SD * 2 + 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const double t = probe::median_ms(
      [&] { kernel<<<dim3(SN / Streams, SH), 32 * (Streams + 1), smem>>>(km, vm, kk, vk, geo, lists, sink); });
  CHECK(cudaGetLastError());
  const double whole = double(SN) * SH * SK * 2 * 64 * SD * 2;
  const double moved = Raster ? whole * valid_share : whole;
  std::printf("stream %s: %.3f ms (median of 20), %.2f GB moved, %.2f TB/s; %.2f TB/s of whole tiles' worth\n",
              Mode == 5   ? "tiled, a box of the step's rows  "
              : Mode == 4 ? "raster [B,S,H,D], a 2-d box a run"
              : Mode == 3 ? "tiled, as a 5-d box (64,4,4,4,1)"
              : Mode == 2 ? "raster [B,H,S,D], kind maps      "
              : Mode == 1 ? "raster [B,S,H,D], head outermost"
              : Mode == 0 ? "raster [B,S,H,D], head second   "
                          : "tiled, whole tiles              ",
              t, moved / 1e9, moved / t / 1e9, whole / t / 1e9);
  return 0;
}

int main() {
  int rc = 0;
  for (int mode : {0, 1, 2}) {
    rc |= check<128>({7, 6, 5}, mode); // every kind: t 4 + 3, h 4 + 2, w 4 + 1
    rc |= check<64>({7, 6, 5}, mode);
    rc |= check<128>({21, 30, 52}, mode); // wan2.1's grid: 4 kinds
    rc |= check<64>({9, 4, 10}, mode);
  }

  // The stream on wan2.1-1.3b-480p.
  const tile_geometry geo(grid3{21, 30, 52});
  const int64_t S = geo.raster_tokens(), tiled = SN * 64, raster_elems = S * SH * SD, tiled_elems = tiled * SH * SD;
  uint16_t *k, *v, *kr, *vr;
  CHECK(cudaMalloc(&k, tiled_elems * 2));
  CHECK(cudaMalloc(&v, tiled_elems * 2));
  CHECK(cudaMalloc(&kr, raster_elems * 2));
  CHECK(cudaMalloc(&vr, raster_elems * 2));
  CHECK(cudaMemset(k, 0x3c, tiled_elems * 2));
  CHECK(cudaMemset(v, 0x3c, tiled_elems * 2));
  CHECK(cudaMemset(kr, 0x3c, raster_elems * 2));
  CHECK(cudaMemset(vr, 0x3c, raster_elems * 2));
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  std::vector<int32_t> host(size_t(SH) * SN * SK);
  std::mt19937 rng(7);
  std::vector<int32_t> all(SN);
  for (int i = 0; i < SN; ++i) all[i] = i;
  int64_t valid_sum = 0, step_sum = 0;
  for (size_t row = 0; row < size_t(SH) * SN; ++row) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + SK, host.begin() + row * SK);
    for (int e = 0; e < SK; ++e)
      valid_sum += geo.valid(all[e]), step_sum += vsa::gpu::detail::step_rows(geo.valid(all[e]));
  }
  const double valid_share = double(valid_sum) / (double(SH) * SN * SK * 64);
  const double step_share = double(step_sum) / (double(SH) * SN * SK * 64);
  int32_t* lists;
  CHECK(cudaMalloc(&lists, host.size() * 4));
  CHECK(cudaMemcpy(lists, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  tma_map km, vm;
  if (!vsa::gpu::encode_tile_map(km, k, 1, tiled, SH, SD, tiled_elems, SH * SD, SD) ||
      !vsa::gpu::encode_tile_map(vm, v, 1, tiled, SH, SD, tiled_elems, SH * SD, SD)) {
    std::printf("tiled maps did not encode\n");
    return 1;
  }
  // The raster maps of each mode: [B, S, H, D] (token stride H·D) with the head second or outermost, [B, H, S, D].
  kind_maps kk[3] = {}, vk[3] = {};
  for (int mode = 0; mode < 3; ++mode) {
    const bool hm = mode == 2;
    const raster_tensor krt{kr, 1, SH, SD, raster_elems, hm ? SD : SH * SD, hm ? S * SD : SD, hm, mode == 1};
    raster_tensor vrt = krt;
    vrt.data = vr;
    for (int kind = 0; kind < 8; ++kind)
      encode_kind_map(kk[mode].map[kind], krt, geo.grid, kind),
          encode_kind_map(vk[mode].map[kind], vrt, geo.grid, kind);
  }
  kind_maps k5{}, v5{}, kr2{}, vr2{};
  encode_tiled_as_5d(k5.map[0], k, tiled, SH, SD), encode_tiled_as_5d(v5.map[0], v, tiled, SH, SD);
  for (int kind = 0; kind < 8; ++kind) {
    const int run = int(kind_extent(geo.grid, kind).w);
    if (run > 0) encode_runs(kr2.map[kind], kr, S, SH, SD, run), encode_runs(vr2.map[kind], vr, S, SH, SD, run);
  }
  kind_maps ks{}, vs{};
  for (int m = 0; m < 3; ++m)
    encode_tiled_rows(ks.map[m], k, tiled, SH, SD, 16 << m), encode_tiled_rows(vs.map[m], v, tiled, SH, SD, 16 << m);
  std::printf("wan2.1 uniform lists: %.3f of the tiles' slots are valid tokens, %.3f in the steps' rows\n", valid_share,
              step_share);
  for (int round = 0; round < 2; ++round) {
    rc |= stream<-1>(km, vm, kk[0], vk[0], geo, lists, sink, valid_share);
    rc |= stream<0>(km, vm, kk[0], vk[0], geo, lists, sink, valid_share);
    rc |= stream<1>(km, vm, kk[1], vk[1], geo, lists, sink, valid_share);
    rc |= stream<2>(km, vm, kk[2], vk[2], geo, lists, sink, valid_share);
    rc |= stream<3>(km, vm, k5, v5, geo, lists, sink, valid_share);
    rc |= stream<4>(km, vm, kr2, vr2, geo, lists, sink, valid_share);
    rc |= stream<5>(km, vm, ks, vs, geo, lists, sink, step_share);
  }
  return rc;
}
