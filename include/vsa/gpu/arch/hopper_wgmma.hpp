// Hopper (sm_90a) backend of the matrix layer: the four warps of a block act as one warpgroup, and each
// product is one chain of wgmma.mma_async instructions that read their B operand straight from shared memory
// through a matrix descriptor, and A too where it is a shared tile (Q, K, V, dO); A comes from registers only
// where it is made fresh in each iteration (P, dS), and both are shared tiles in tn, whose A is read
// transposed (the linear-attention kernels' φᵀ·V). The mma.sync backend
// loads every B fragment into the registers of each of the four warps, so a 64 × 64 × D product moves the
// B tile through the register file four times; here the tensor cores read it once per warpgroup, and one
// instruction covers 64 rows.
//
// Nothing else changes for the algorithm. The accumulator of wgmma .m64nN gives warp w rows 16w .. 16w+15
// in exactly the lane layout of mma.sync m16n8 repeated over N/8 column blocks, and its A operand in
// registers has the m16n8k16 A layout per warp, so score and output tiles, row reductions, lane layouts and
// the register-resident P of warp_mma carry over unchanged; only nt and nn are replaced, and the band's rows
// of a loop-invariant operand stay in shared memory (rows_in_registers = false). Requirements: all
// four warps of the block call nt/nn together (they do: the kernels' loops are block-uniform), warp w holds
// band 16w (row0 = 16·warp), and shared tiles start on 1024-byte boundaries (aligned_smem).
//
// Shared tiles are in the 128-byte-swizzle layout of smem_tile (64-column panels of 128-byte rows):
//   K-major operand (S = A·Bᵀ, rows of A and B along the head dim): a k step of 16 columns starts 32 bytes
//     further into the panel; eight-row core-matrix groups are 1024 bytes apart (stride byte offset).
//   MN-major operand (O = P·B, B's rows along k): a k step of 16 rows starts 2048 bytes further; eight-row
//     groups along k are 1024 bytes apart (stride byte offset) and the 64-column panels along N are
//     one panel apart (leading byte offset).
// That arithmetic is in smem_layout.hpp (wgmma_layout), where tests/cpu/test_wgmma_layout.cpp runs it against
// a CPU model of how the instruction reads shared memory.
#pragma once

#include "nvidia_mma.hpp"
#include "smem_layout.hpp"

namespace vsa {
namespace gpu {

namespace wgmma {

// Shared-memory matrix descriptor of k step s of the tile at t (bit packing and strides: smem_layout.hpp). The
// step's offset is added to the descriptor of the tile's start, not to the address before packing it: the
// start field is the address / 16 (14 bits; shared memory ends below 2^18 bytes, so the sum cannot carry out of
// it), and s.offset is a constant once the k loop is unrolled, so every k step of a tile shares one packed
// descriptor plus an immediate. Packing each step's address anew cost ~30 instructions a wgmma (the
// shift, mask and or of each field, then the moves to uniform registers; bench/NOTES.md, v14).
__device__ __forceinline__ uint64_t descriptor(const uint16_t* t, wgmma_layout::operand_step s) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(t));
  return wgmma_layout::descriptor(a, s.lead_bytes, s.stride_bytes) + static_cast<uint64_t>((s.offset * 2) >> 4);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by asynchronous instructions: this keeps the compiler from moving reads or
// writes of them across the fence/wait that brackets those instructions.
template <int N> __device__ __forceinline__ void pin(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
// The first Count of them only: the accumulator of a product narrower than its tile (n16, n32 of a score tile).
template <int Count, int N> __device__ __forceinline__ void pin_first(float (&x)[N]) {
  static_assert(Count <= N, "a part of the array");
#pragma unroll
  for (int i = 0; i < Count; ++i) asm volatile("" : "+f"(x[i])::"memory");
}
// The same for an A operand in registers (K k steps of four 32-bit words a thread), which an issued group reads
// until the wait that completes it.
template <int K> __device__ __forceinline__ void pin(uint32_t (&x)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(x[k][r])::"memory");
}

#define VSA_WG_ACC8(d, i)                                                                                              \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),          \
      "+f"(d[i + 7])
#define VSA_WG_ACC32(d, i) VSA_WG_ACC8(d, i), VSA_WG_ACC8(d, i + 8), VSA_WG_ACC8(d, i + 16), VSA_WG_ACC8(d, i + 24)
#define VSA_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define VSA_WG_D32                                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "    \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define VSA_WG_D64                                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "    \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "     \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 × N over the warpgroup, N/2 floats a thread) += A · B for one k step of 16: A from registers (this
// warp's 16 rows), B from shared memory; TransB = 1 for an MN-major B; acc = 0 writes d = A · B instead,
// ignoring what d held. TAIL names the A registers, the B descriptor, the predicate and the immediates by
// operand number: they follow the N/2 accumulators.
#define VSA_WG_RS(N, TYPE, DLIST, PRED, TAIL, ...)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DLIST ", " TAIL ";\n}"              \
               : __VA_ARGS__                                                                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(TransB))
#define VSA_WG_RS8(TYPE)                                                                                               \
  VSA_WG_RS(8, TYPE, "{%0, %1, %2, %3}", "%9", "{%4, %5, %6, %7}, %8, p, 1, 1, %10", "+f"(d[0]), "+f"(d[1]),           \
            "+f"(d[2]), "+f"(d[3]))
#define VSA_WG_RS64(TYPE)                                                                                              \
  VSA_WG_RS(64, TYPE, VSA_WG_D32, "%37", "{%32, %33, %34, %35}, %36, p, 1, 1, %38", VSA_WG_ACC32(d, 0))
#define VSA_WG_RS128(TYPE)                                                                                             \
  VSA_WG_RS(128, TYPE, VSA_WG_D64, "%69", "{%64, %65, %66, %67}, %68, p, 1, 1, %70", VSA_WG_ACC32(d, 0),               \
            VSA_WG_ACC32(d, 32))

template <bool BF16, int N, int TransB>
__device__ __forceinline__ void mma_rs(float* d, const uint32_t (&a)[4], uint64_t b, int acc = 1) {
  static_assert(N == 8 || N == 64 || N == 128, "wgmma shapes used: n8 (row sums), n64, n128");
  if constexpr (N == 8 && BF16) {
    VSA_WG_RS8("bf16");
  } else if constexpr (N == 8) {
    VSA_WG_RS8("f16");
  } else if constexpr (N == 64 && BF16) {
    VSA_WG_RS64("bf16");
  } else if constexpr (N == 64) {
    VSA_WG_RS64("f16");
  } else if constexpr (BF16) {
    VSA_WG_RS128("bf16");
  } else {
    VSA_WG_RS128("f16");
  }
}

// d (64 × N) += A · B for one k step, both operands in shared memory; TransA / TransB = 1 for an MN-major
// operand (A read transposed: its tile's columns are the product's rows); acc = 0 writes d = A · B instead,
// ignoring what d held. Operand numbers as in VSA_WG_RS.
#define VSA_WG_SS(N, TYPE, DLIST, PRED, TAIL, ...)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " DLIST ", " TAIL ";\n}"              \
               : __VA_ARGS__                                                                                           \
               : "l"(a), "l"(b), "r"(acc), "n"(TransA), "n"(TransB))
#define VSA_WG_SS8(TYPE)                                                                                               \
  VSA_WG_SS(8, TYPE, "{%0, %1, %2, %3}", "%6", "%4, %5, p, 1, 1, %7, %8", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]),          \
            "+f"(d[3]))
#define VSA_WG_SS16(TYPE)                                                                                              \
  VSA_WG_SS(16, TYPE, "{%0, %1, %2, %3, %4, %5, %6, %7}", "%10", "%8, %9, p, 1, 1, %11, %12", VSA_WG_ACC8(d, 0))
#define VSA_WG_SS32(TYPE)                                                                                              \
  VSA_WG_SS(32, TYPE, VSA_WG_D16, "%18", "%16, %17, p, 1, 1, %19, %20", VSA_WG_ACC8(d, 0), VSA_WG_ACC8(d, 8))
#define VSA_WG_SS64(TYPE) VSA_WG_SS(64, TYPE, VSA_WG_D32, "%34", "%32, %33, p, 1, 1, %35, %36", VSA_WG_ACC32(d, 0))
#define VSA_WG_SS128(TYPE)                                                                                             \
  VSA_WG_SS(128, TYPE, VSA_WG_D64, "%66", "%64, %65, p, 1, 1, %67, %68", VSA_WG_ACC32(d, 0), VSA_WG_ACC32(d, 32))

template <bool BF16, int N, int TransA, int TransB>
__device__ __forceinline__ void mma_ss(float* d, uint64_t a, uint64_t b, int acc = 1) {
  static_assert(N == 8 || N == 16 || N == 32 || N == 64 || N == 128,
                "wgmma shapes used: n8 (sums against ones), n16 and n32 (key tiles with few valid rows), n64, n128");
  if constexpr (N == 8 && BF16) {
    VSA_WG_SS8("bf16");
  } else if constexpr (N == 8) {
    VSA_WG_SS8("f16");
  } else if constexpr (N == 16 && BF16) {
    VSA_WG_SS16("bf16");
  } else if constexpr (N == 16) {
    VSA_WG_SS16("f16");
  } else if constexpr (N == 32 && BF16) {
    VSA_WG_SS32("bf16");
  } else if constexpr (N == 32) {
    VSA_WG_SS32("f16");
  } else if constexpr (N == 64 && BF16) {
    VSA_WG_SS64("bf16");
  } else if constexpr (N == 64) {
    VSA_WG_SS64("f16");
  } else if constexpr (BF16) {
    VSA_WG_SS128("bf16");
  } else {
    VSA_WG_SS128("f16");
  }
}

#undef VSA_WG_SS128
#undef VSA_WG_SS64
#undef VSA_WG_SS32
#undef VSA_WG_SS16
#undef VSA_WG_SS8
#undef VSA_WG_SS
#undef VSA_WG_RS128
#undef VSA_WG_RS64
#undef VSA_WG_RS8
#undef VSA_WG_RS
#undef VSA_WG_D64
#undef VSA_WG_D32
#undef VSA_WG_D16
#undef VSA_WG_ACC32
#undef VSA_WG_ACC8

} // namespace wgmma

template <class E, int D> struct warpgroup_mma : warp_mma<E, D> {
  using base = warp_mma<E, D>;
  using typename base::out_tile;
  using typename base::row_frag;
  using typename base::score_frag;
  using typename base::score_tile;

  // Descriptor of k step ks of a K-major tile (16 head-dim columns of all 64 rows).
  __device__ __forceinline__ static uint64_t k_major(smem_tile<D> t, int ks) {
    return wgmma::descriptor(t.base, wgmma_layout::k_major(ks));
  }
  // Descriptor of k step kk of an MN-major tile (rows 16kk .. 16kk+15, all D columns).
  __device__ __forceinline__ static uint64_t mn_major(smem_tile<D> t, int kk) {
    return wgmma::descriptor(t.base, wgmma_layout::mn_major(kk));
  }

  // The matrix layer's algorithms take A from registers only for operands made fresh in each iteration (P, dS). A
  // loop-invariant A held in a row_frag across a loop of wgmma (Q in the forward, through nt) was observed to be
  // miscompiled by ptxas of CUDA 13.0: the registers were reused after the first product of an iteration (head dim
  // 64). Q is read through a descriptor instead, so it keeps a shared slot of its own, and the algorithm asks for
  // it. A band_frag passed to nt_async is pinned before each fence, which keeps its registers until the wait: the
  // Hopper dk/dv holds K or V so for its whole loop, its outputs bitwise those of the descriptor form on the H200
  // (bench/NOTES.md, v18).
  static constexpr bool rows_in_registers = false;

  // s += A · Bᵀ, A rows row0 .. row0+15 of a shared tile: the warpgroup reads all 64 rows of a at once,
  // which is warp w's band 16w. Only the first W rows of b (W = 16, 32 or 64) and so the first W columns of s
  // (its first W/2 elements: the accumulator of m64nW is that of m64n64 cut after W/8 column blocks).
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt(score_tile& s, smem_tile<D> a, int /*row0 = 16·warp*/, smem_tile<D> b) {
    wgmma::pin_first<W / 2>(s.x);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma::mma_ss<E::is_bf16, W, 0, 0>(s.x, k_major(a, ks), k_major(b, ks));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin_first<W / 2>(s.x);
  }
  // The first W/16 k steps of P rounded to E, as the A operand of a product over P's columns (the m16n8k16 A
  // layout per warp).
  template <int W> __device__ __forceinline__ static void pack_steps(uint32_t (&a)[W / 16][4], const score_tile& p) {
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[kk][r] = E::pack(p.x[nv_lanes::p_elem(kk, r, 0)], p.x[nv_lanes::p_elem(kk, r, 1)]);
  }
  // o += A · B over the first W/16 k steps, A already rounded to E (registers), B MN-major.
  template <int W, int K>
  __device__ __forceinline__ static void nn_steps(out_tile& o, const uint32_t (&a)[K][4], smem_tile<D> b) {
    wgmma::pin(o.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) wgmma::mma_rs<E::is_bf16, D, 1>(o.x, a[kk], mn_major(b, kk));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o.x);
  }
  // o += P · B, P the score tile rounded to E (A operand in registers, as with mma.sync), B MN-major; over the
  // first W columns of P and rows of b only.
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn(out_tile& o, const score_tile& p, smem_tile<D> b) {
    uint32_t a[W / 16][4];
    pack_steps<W>(a, p);
    nn_steps<W>(o, a, b);
  }
  // nn with P given as A fragments already rounded to E (the mma.sync backend's score_frag, whose pack_rows forms
  // dSᵀ in dk/dv for both its product and its store); here rather than the inherited mma.sync nn_frags, so that
  // the product stays on wgmma: dq's one product a pair from stored dS (attention_dq_stored.hpp), where a table takes
  // the stored dS on Hopper; Hopper's does not (tuning/hopper.hpp), and bench/NOTES.md v35 ran it.
  template <int W = tile_rows>
  __device__ __forceinline__ static void nn_frags(out_tile& o, const score_frag& a, smem_tile<D> b) {
    nn_steps<W>(o, a.x, b);
  }
  // Split forms of nt and nn for a loop that overlaps the products with its own softmax: each issues its chain
  // of wgmma as one group and returns at once. The caller waits with wait_groups<N> (every group but the N
  // issued last is complete) before it reads or writes the accumulator, or overwrites the registers of P, of a
  // group still in flight. nt_into writes s = A · Bᵀ (its first k step does not accumulate), so s needs no
  // zeros.
  using prob_frag = score_frag; // P rounded to E, as the A operand of nn (four k steps of 16 keys)
  __device__ __forceinline__ static void pack(prob_frag& a, const score_tile& p) { pack_steps<tile_rows>(a.x, p); }
  //
  // ptxas keeps wgmma groups in flight across other instructions only where nothing but wgmma defines a
  // register a wgmma of the group reads between the fence and the commit; otherwise it waits after each one
  // (and says so: C7513). The descriptors of a stage chosen at run time and P's registers are therefore made
  // before the fence: the empty volatile statements below keep their order with it.
  // nt_into<W> writes the first W columns only (as nt<W>); wait for it with wait_first<N, W>.
  template <int W = tile_rows>
  __device__ __forceinline__ static void nt_into(score_tile& s, smem_tile<D> a, smem_tile<D> b) {
    uint64_t da[D / 16], db[D / 16];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      da[ks] = k_major(a, ks);
      db[ks] = k_major(b, ks);
      asm volatile("" : "+l"(da[ks]), "+l"(db[ks]));
    }
    wgmma::pin_first<W / 2>(s.x);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma::mma_ss<E::is_bf16, W, 0, 0>(s.x, da[ks], db[ks], ks > 0 ? 1 : 0);
    wgmma::commit();
  }
  __device__ __forceinline__ static void nn_async(out_tile& o, prob_frag& a, smem_tile<D> b) {
    uint64_t db[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      db[kk] = mn_major(b, kk);
      asm volatile("" : "+l"(db[kk]));
    }
    pin(a);
    wgmma::pin(o.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_rs<E::is_bf16, D, 1>(o.x, a.x[kk], db[kk]);
    wgmma::commit();
  }
  template <int N, int S> __device__ __forceinline__ static void wait_groups(float (&acc)[S]) {
    wgmma::wait<N>();
    wgmma::pin(acc);
  }
  template <int N, int W> __device__ __forceinline__ static void wait_first(score_tile& s) {
    wgmma::wait<N>();
    wgmma::pin_first<W / 2>(s.x);
  }
  // After the wait that completes the group reading them: keeps P's registers from being reused before then.
  __device__ __forceinline__ static void pin(prob_frag& a) { wgmma::pin(a.x); }

  // Two independent products in one commit group with one wait (the matrix layer's nt_pair / nn_pair,
  // matrix.hpp): the tensor cores start the second chain while the first drains, where nt and nn each wait for
  // their own. nt_pair writes s1 = a1 · b1ᵀ and s2 = a2 · b2ᵀ (no zeros needed); nn_pair adds p1 · c1 to o1 and
  // p2 · c2 to o2, both P rounded to E before the fence. nt_pair<W> writes the first W columns only (as nt<W>).
  // Head dim 128 only: at D = 64 the order a pair needs in dq (both tiles waited for first) measured 3% slower
  // on the H200, and D = 64 keeps the order before pairs (bench/NOTES.md, v15).
  static constexpr bool one_group_pairs = D == 128;
  template <int W = tile_rows> __device__ __forceinline__ static void
  nt_pair(score_tile& s1, smem_tile<D> a1, smem_tile<D> b1, score_tile& s2, smem_tile<D> a2, smem_tile<D> b2) {
    wgmma::pin_first<W / 2>(s1.x);
    wgmma::pin_first<W / 2>(s2.x);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma::mma_ss<E::is_bf16, W, 0, 0>(s1.x, k_major(a1, ks), k_major(b1, ks), ks > 0 ? 1 : 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma::mma_ss<E::is_bf16, W, 0, 0>(s2.x, k_major(a2, ks), k_major(b2, ks), ks > 0 ? 1 : 0);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin_first<W / 2>(s1.x);
    wgmma::pin_first<W / 2>(s2.x);
  }
  __device__ __forceinline__ static void nn_pair(out_tile& o1, const score_tile& p1, smem_tile<D> c1, out_tile& o2,
                                                 const score_tile& p2, smem_tile<D> c2) {
    prob_frag a1;
    pack(a1, p1);
    nn_pair(o1, a1, c1, o2, p2, c2);
  }
  // The same with p1 given as A fragments already rounded to E (the matrix layer's nn_pair of a score_frag).
  __device__ __forceinline__ static void nn_pair(out_tile& o1, prob_frag a1, smem_tile<D> c1, out_tile& o2,
                                                 const score_tile& p2, smem_tile<D> c2) {
    prob_frag a2;
    pack(a2, p2);
    pin(a1);
    pin(a2);
    wgmma::pin(o1.x);
    wgmma::pin(o2.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_rs<E::is_bf16, D, 1>(o1.x, a1.x[kk], mn_major(c1, kk));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_rs<E::is_bf16, D, 1>(o2.x, a2.x[kk], mn_major(c2, kk));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o1.x);
    wgmma::pin(o2.x);
    pin(a1);
    pin(a2);
  }

  // A 16 × D band of this warp (D/64 score tiles, columns 64c … of tile c) rounded to E, as the A operand of
  // the D/16 k steps of a product over the head dim: the accumulator-to-A identity that keeps P in registers
  // (nn), applied to each score tile. For an operand that a warp needs only its own rows of (the linear key
  // gradient's v − m), this saves the pass through shared memory and the block barrier a descriptor read of
  // the whole tile would need.
  struct band_frag {
    uint32_t x[D / 16][4];
  };
  __device__ __forceinline__ static void pack(band_frag& a, const score_tile (&t)[D / 64]) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          a.x[4 * c + kk][r] = E::pack(t[c].x[nv_lanes::p_elem(kk, r, 0)], t[c].x[nv_lanes::p_elem(kk, r, 1)]);
  }
  __device__ __forceinline__ static void pin(band_frag& a) { wgmma::pin(a.x); }
  // s = A · Bᵀ, A the band in registers, B the 64 rows of tile b (K-major, as in nt): issued as one group and
  // returned at once (wait as for nt_into; the band's registers stay untouched until then). The first k step
  // does not accumulate, so s needs no zeros.
  __device__ __forceinline__ static void nt_async(score_tile& s, band_frag& a, smem_tile<D> b) {
    uint64_t db[D / 16];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      db[ks] = k_major(b, ks);
      asm volatile("" : "+l"(db[ks]));
    }
    pin(a);
    wgmma::pin(s.x);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma::mma_rs<E::is_bf16, 64, 0>(s.x, a.x[ks], db[ks], ks > 0 ? 1 : 0);
    wgmma::commit();
  }
  // o = Σ_c P_c · B_c over c < D/64 (a k axis of D): P_c as nn's A operand, B_c the 64-row tile that starts
  // c tiles after b (MN-major, as in nn). One chain of D/16 k steps issued as one group (wait as for nn_async);
  // the first does not accumulate, so o needs no zeros.
  __device__ __forceinline__ static void nn_stack_async(out_tile& o, prob_frag (&a)[D / 64], smem_tile<D> b) {
    uint64_t db[D / 16];
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        db[4 * c + kk] = mn_major(smem_tile<D>{b.base + c * tile_rows * D}, kk);
        asm volatile("" : "+l"(db[4 * c + kk]));
      }
#pragma unroll
    for (int c = 0; c < D / 64; ++c) pin(a[c]);
    wgmma::pin(o.x);
    wgmma::fence();
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma::mma_rs<E::is_bf16, D, 1>(o.x, a[c].x[kk], db[4 * c + kk], c + kk > 0 ? 1 : 0);
    wgmma::commit();
  }

  // o += Aᵀ · B over the 64 rows of two shared tiles (the k axis): A the 64 columns of panel `panel` of tile
  // a, read transposed through an MN-major descriptor, B all D columns of tile b (MN-major, as in nn). Warp w
  // gets rows 16w … 16w+15 of the product, i.e. columns 64·panel + 16w … of a. This is the φᵀ·V form of the
  // linear-attention kernels, whose transposed operand the mma.sync backend would gather element by element;
  // tnspA is allowed for 16-bit types, and both operands come from shared memory, so no A register stays
  // live across the chain (the hazard noted at rows_in_registers does not arise).
  __device__ __forceinline__ static void tn(out_tile& o, smem_tile<D> a, int panel, smem_tile<D> b) {
    wgmma::pin(o.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::mma_ss<E::is_bf16, D, 1, 1>(o.x, wgmma::descriptor(a.base, wgmma_layout::mn_major_panel(panel, kk)),
                                         mn_major(b, kk));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o.x);
  }
  // tn issued as one group that returns at once (wait as for nn_async), for a caller with other work on the
  // same tiles meanwhile; the descriptors are made before the fence (see nt_into).
  __device__ __forceinline__ static void tn_async(out_tile& o, smem_tile<D> a, int panel, smem_tile<D> b) {
    uint64_t da[4], db[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      da[kk] = wgmma::descriptor(a.base, wgmma_layout::mn_major_panel(panel, kk));
      db[kk] = mn_major(b, kk);
      asm volatile("" : "+l"(da[kk]), "+l"(db[kk]));
    }
    wgmma::pin(o.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_ss<E::is_bf16, D, 1, 1>(o.x, da[kk], db[kk]);
    wgmma::commit();
  }

  // A 64 × 8 accumulator (m64n8) of column sums: warp w holds rows 16w + lane/4 (x[0], x[1]) and
  // 16w + lane/4 + 8 (x[2], x[3]) at columns 2·(lane mod 4) and the next, the lane layout of out_tile's first
  // eight columns. Multiplied by a block of ones every column is the same sum.
  struct sum_tile {
    float x[4];
  };
  // Bytes of the block of ones that sums read as their B operand (K-major, 64 rows of k by 8 columns): one
  // 1024-byte swizzle atom, 1024-byte aligned. The four k steps start 32 bytes apart in it and each reads
  // 8 rows of 32 bytes, all inside the atom, so with every element 1 the swizzle does not matter.
  static constexpr int ones_bytes = 1024;

  // nn (o += P · B) and, in the same chain, l += P · ones: P's row sums from the matrix cores, of P exactly as
  // the product rounds it (the block of ones at `ones`, K-major as in tn_sums). Every column of l is the row's
  // sum: slot r at x[2r]. The forward's row sums then cost W/16 m64n8k16 a step instead of rounding P a second
  // time and adding it up in the softmax (about 1.5 instructions an element, bench/NOTES.md v13). Over the first
  // W keys only (a narrow step).
  static constexpr bool row_sums_by_product = true;
  template <int W = tile_rows> __device__ __forceinline__ static void
  nn_sums(out_tile& o, sum_tile& l, const score_tile& p, smem_tile<D> b, const uint16_t* ones) {
    uint32_t a[W / 16][4];
    pack_steps<W>(a, p);
    wgmma::pin(o.x);
    wgmma::pin(l.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk) wgmma::mma_rs<E::is_bf16, D, 1>(o.x, a[kk], mn_major(b, kk));
#pragma unroll
    for (int kk = 0; kk < W / 16; ++kk)
      wgmma::mma_rs<E::is_bf16, 8, 0>(l.x, a[kk], wgmma::descriptor(ones, wgmma_layout::k_major(kk)));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o.x);
    wgmma::pin(l.x);
  }

  // tn (o += aᵀ·b, A = panel `panel` of a read transposed) and, in the same chain of one commit group, the
  // sums over the 64 rows of that panel of a (sa) and of panel `panel` of b (sb): each is that panel read
  // transposed, times the 64 × 8 block of `ones` (ones_bytes of 16-bit ones). This is what the linear
  // state kernel needs per tile: KV, z = Σ φ(k) and Σ v, all three from the matrix cores, so that the
  // column sums cost the warps no loads and adds; the products see the same rounded operands as KV does.
  __device__ __forceinline__ static void tn_sums(out_tile& o, sum_tile& sa, sum_tile& sb, smem_tile<D> a, int panel,
                                                 smem_tile<D> b, const uint16_t* ones) {
    wgmma::pin(o.x);
    wgmma::pin(sa.x);
    wgmma::pin(sb.x);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::mma_ss<E::is_bf16, D, 1, 1>(o.x, wgmma::descriptor(a.base, wgmma_layout::mn_major_panel(panel, kk)),
                                         mn_major(b, kk));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::mma_ss<E::is_bf16, 8, 1, 0>(sa.x, wgmma::descriptor(a.base, wgmma_layout::mn_major_panel(panel, kk)),
                                         wgmma::descriptor(ones, wgmma_layout::k_major(kk)));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::mma_ss<E::is_bf16, 8, 1, 0>(sb.x, wgmma::descriptor(b.base, wgmma_layout::mn_major_panel(panel, kk)),
                                         wgmma::descriptor(ones, wgmma_layout::k_major(kk)));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(o.x);
    wgmma::pin(sa.x);
    wgmma::pin(sb.x);
  }
};

} // namespace gpu
} // namespace vsa
