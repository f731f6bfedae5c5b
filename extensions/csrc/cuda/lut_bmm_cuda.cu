// CUDA kernel of approx::lut_bmm (arithmetic: ../ops.cpp): out[i] = lut_linear(a[i], b[i]) per batch, both
// operands dynamic (attention's Q.K^T and P.V). Design (../README.md has the longer story):
//
// No operand is constant, so lut_linear's weight-expanded tables do not apply (a table per batch would take
// more writes than the batch has MACs); this is the direct lookup, one table read per MAC, from shared memory:
//   * a prep kernel writes the effective table E32[row(a)][b + 128] (b's sign folded in for unsigned
//     multipliers) and two flags: every E32 entry fits int16; (uint8 a) every lut[a][m], m <= 128, fits
//     uint16. The main kernel reads the flags on the device (no host wait) and takes one of three modes:
//       S16  E as int16 in shared memory, rows padded to 258 entries (row r's column c in bank
//            (r + c / 2) % 32, so the rows of a warp spread over the banks) -- signed tables;
//       U16  unsigned tables whose products exceed int16 (mul8u: up to 65025): the magnitude table
//            lut[a][0..128] as uint16 (66 KiB), the sign of b applied with one multiply-add per MAC;
//       G32  anything else (tables with products beyond 16 bits): E32 read through L1/L2 (__ldg).
//   * persistent blocks (one per SM: the int16 table is 129 KiB) of G groups of 256 threads: the block loads the
//     table once, then each group loops over its own tiles (batch, row block, column block) with its own staging
//     buffers and named barrier, so one group's staging of codes from global memory overlaps the others'
//     lookups. Per tile and chunk of KC taps a group stages its codes transposed in shared memory ([KC][rows],
//     [KC][cols]); a thread issues 4-8 global loads before it stores any (32-bit words where K % 4 == 0 and the
//     pointers are aligned);
//   * thread (tm, tn) of a TM x TN grid (TM * TN <= 256) sums R rows x C columns in int32 registers (wrapping
//     like lut_linear's int32 accumulators): per tap one R-byte and one C-byte code load, turned into byte
//     offsets once, then R x C table reads and adds. TM x TN is chosen on the host per shape so the tiles cover M
//     and N with the least padding, up to a quarter of the group idle where that pads less.
//
// What lut_bmm runs: on a shape's first call it times the first four variants and keeps the fastest (pick(),
// below); no layout wins every shape. On ViT-B/16 it picks g2_r8c4_k64_pad for Q.K^T (197 x 197, K = 64: tiles of
// 200 x 40, 25 x 10 threads of 8 x 4 outputs) and g2_r4c8_k64_pad for P.V (197 x 64, K = 197: tiles of 200 x 32,
// 50 x 4 threads of 4 x 8), both G = 2 (512 threads an SM), 64 taps a staged chunk; 193 KiB of shared memory a
// block; ptxas (nvcc 13.0, sm_90): 128 registers a thread, at most 8 bytes spilled. Inside a CUDA graph capture
// (nothing can be timed) variant 0 runs.
//
// The bound (S16, the common mode). Each MAC is one shared-memory read of the int16 effective table
// (256 rows x 258 entries, 129 KiB, one copy per SM) at a data-dependent address. Shared memory serves a
// warp's read in as many passes as its most-loaded bank (32 banks of 4 bytes) has distinct words; for 32
// uniformly random addresses the expected worst bank load is ~3.5 (32 balls in 32 bins), so an SM completes
// about 32 / 3.5 ~ 9 table reads a clock: on 132 SMs x 1.98 GHz (H100 SXM, H200) ~2.37 T reads/s for uniformly
// random codes. A kernel near it must be purely lookup bound: few instructions per MAC (sm_90: one IMAD for
// the address, row code * 516 + column offset; one LDS.S16; half an IADD3, two taps' products added at once;
// code unpacking amortised over the R x C outputs), enough warps resident to hide the conflicts' latency, and
// staging of codes that overlaps the lookups. Concentrated codes (real activations, P's probabilities) do
// better than the bound: lanes reading the same 4-byte word are served in one pass.
//
// Measured (NVIDIA H100 80GB HBM3, 132 SMs at 1980 MHz; `python3 benchmarks/cuda_attention.py`, 2026-11-28, one
// device call; median of 10 CUDA-event timings after 2 warm-ups; every variant bit-exact against the reference and
// the cpp kernel, and 0 errors under compute-sanitizer memcheck (benchmarks/cuda_memcheck.py --bmm-only)),
// T MAC/s on ViT-B/16 at 64 images (768 matrices of 197 x 197 x 64), exact tables; codes uniform ("unif"),
// attention-like ("attn": Q, K, V normal of std 32 codes, P a softmax) and narrow (std 8):
//                          qk s8 unif/attn/narrow  av s8 unif/attn/narrow  av u8 unif/attn/narrow
//   g2_r4c8_k64_pad        1.868  1.957  2.233     1.899  2.765  2.406     1.868  2.711  2.268
//   g3_k64_pad             1.845  1.920  2.174     1.711  2.263  2.107     1.684  2.253  2.011
//   g2_r8c4_k64_pad        2.016  2.157  2.550     1.888  2.624  2.333     1.873  2.519  2.242
//   g2_r4c8_k64_rowlanes   1.578  1.691  2.322     1.817  2.495  2.466     1.707  2.486  2.446
//   g2_r4c8_pad            1.821  1.907  2.151     1.889  2.669  2.361     1.855  2.615  2.236
//   g3_pad                 1.870  1.943  2.187     1.693  2.231  2.078     1.666  2.223  1.979
//   torch.bmm (cuBLAS) on the same shapes, T FLOP-pairs/s: fp32 qk 9.63, av 13.48; bf16 qk 14.04, av 20.94.
// So lut_bmm's picks run Q.K^T at 2.02 (uniform) / 2.16 (attention-like) and P.V at 1.90 / 2.77; one attention
// layer's two products (equal MACs) together at 1.96 / 2.42 T MAC/s. Uniform Q.K^T is 85 % of the ~2.37 T reads/s
// bound. Why 8 x 4 beats 4 x 8 on Q.K^T only is measured, not derived: both load 12 code bytes per 32 products.
//
// History. The first kernel (`base`) ran one block of 256 threads an SM with 4 x 4 outputs a thread, staged codes
// byte by byte with one global load in flight a thread and counted every idle thread in its tile grid (P.V's 197
// rows in tiles of 256): 1.27-1.41 T MAC/s on Q.K^T, 0.95-1.11 on P.V (H200). Retired with it: g1 and the
// 1024-thread layouts g4, g4_pad, g4_r2c8_pad, g4_pad_rowlanes (0.81-1.23 on the H200); then, on the H100 in the
// call before the table above (previous build), g1_pad (qk 1.69-1.94, av 1.37-1.74), g2_pad (1.81-2.12,
// 1.63-2.25), g2_k64_pad (1.85-2.18, 1.66-2.35), g2_pad_rowlanes (1.52-2.11, 1.56-2.08) and two "_async" layouts
// that copied the next chunk's codes ahead with cp.async and transposed them shared-to-shared: Q.K^T slower
// (g2_r4c8_async 1.75 / 1.82 / 2.05 against g2_r4c8_pad's 1.80 / 1.89 / 2.13): the staging stall they hide is
// smaller than the copies and the spills (336 bytes) they cost. lut_bmm ran g2_r4c8_pad until 2026-11-28.
//
// Variants (approx::lut_bmm_variant, by index; checks.h kBmmVariants names them; lut_bmm picks among 0-3):
// each is lut_bmm_groups_kernel with
//   gG           G groups of 256 threads (G = 2 or 3: 512 or 768 threads an SM) sharing the table;
//   _pad         the tile grid may leave up to a quarter of a group's threads idle where that pads less
//                (P.V, 197 x 64: tiles of 200 rows instead of 256, 1.5 % padding instead of 30 %);
//   _rRcC        R x C outputs a thread (4 x 4 otherwise); _k64: 64 taps a staged chunk instead of 32;
//   _rowlanes    a warp's lanes along rows (they share b's codes: concentrated a codes broadcast).
// Every variant computes the same int32 sums (the same products, int32 adds wrap alike in any order).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "../checks.h"
#include "kernels.h"

namespace {

constexpr int kGroupThreads = 256;  // threads of a group (G groups a block)
constexpr int kMaxTile = 256;       // rows or columns of a tile at most
constexpr int kS16Stride = 258;     // int16 entries per shared row in S16 mode
constexpr int kU16Stride = 130;     // uint16 entries per shared row in U16 mode (129 used)
constexpr int kTableBytes = 256 * kS16Stride * 2;

enum Mode { S16 = 0, U16 = 1, G32 = 2 };

// E32 and the flags: flags[0] = 1 while every E32 entry fits int16, flags[1] = 1 while every lut[r][m],
// m <= 128, fits uint16 (meaningful for uint8 a only). One thread per entry; flags start at 1.
__global__ void prep_kernel(const int32_t* __restrict lut, int32_t* __restrict E, int* flags, bool is_unsigned) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= 65536) return;
  const int r = e >> 8, c = e & 255, v = c - 128;
  int32_t val;
  if (is_unsigned) {
    const uint32_t mag = (uint32_t)__ldg(lut + r * 256 + (v < 0 ? -v : v));
    val = v > 0 ? (int32_t)mag : v < 0 ? (int32_t)(0u - mag) : 0;
    if (c <= 128) {
      const int32_t l = __ldg(lut + e);
      if (l < 0 || l > 65535) atomicAnd(flags + 1, 0);
    }
  } else {
    val = __ldg(lut + e);
  }
  E[e] = val;
  if (val < -32768 || val > 32767) atomicAnd(flags, 0);
}

struct Args {
  const uint8_t* a;
  const int8_t* b;
  const int32_t* lut;  // raw table (U16 mode)
  const int32_t* E;    // effective table
  const int* flags;
  int32_t* out;
  long long B, M, N;
  int K, TM, TN;
  long long mtiles, ntiles, tiles;
  unsigned xmask;  // code ^ xmask = row of E (0x80 for int8 a)
  bool is_unsigned;
  bool words;  // K % 4 == 0 and a, b 4-byte aligned: codes staged as 32-bit words
};

// ---- lut_bmm_groups_kernel: thread groups sharing one table ------------------------------------------------
// A block of G groups of 256 threads (G = 1..3: 256..768 threads an SM); the block loads the table once, each
// group then loops over its own tiles with its own staging buffers and a named barrier (bar.sync 1 + g, 256
// threads), so while one group stages codes from global memory the others look up. Per thread R x C outputs;
// per tap the R row codes and C column codes are one 32/64-bit load each, turned into byte offsets once
// (row(a) * row stride + table base, column * entry size), so each MAC is one IADD (address), one LDS.U16/S16
// (or LDG through L1 in G32) and one IADD / IMAD (accumulate). b's codes are staged as column indices (b + 128)
// in S16 / G32, raw in U16; codes are read as 32-bit words from global memory where K and the pointers allow
// (K % 4 == 0).

template <int N>
struct Codes {  // N (4 or 8) consecutive staged bytes, one load
  uint32_t w[(N + 3) / 4];
  __device__ __forceinline__ void load(const uint8_t* p) {
    if constexpr (N == 8) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x, w[1] = v.y;
    } else {
      static_assert(N == 4, "R and C are 4 or 8");
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
  }
  __device__ __forceinline__ uint32_t operator[](int j) const { return (w[j >> 2] >> (8 * (j & 3))) & 255u; }
};

__device__ __forceinline__ void group_sync(int g, int G) {
  if (G == 1)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "r"(kGroupThreads) : "memory");
}

// Stage taps [k0, k0 + KC) of `rows` rows starting at row0 of src ([*, K] bytes, `total` rows) transposed into
// dst[kk][r], each byte ^ x; rows past `total` and taps past kn are 0 ^ x (a valid table index, never stored).
// A thread issues NB global loads before it stores any (their latencies overlap; one at a time, as the retired base
// kernel did, a chunk's staging took ~20 serial round trips to L2 a thread).
template <int KC>
__device__ __forceinline__ void stage(uint8_t* __restrict dst, const uint8_t* __restrict src, long long row0,
                                      int rows, long long total, int K, int k0, int kn, uint32_t x, bool words,
                                      int lt) {
  if (words) {  // K % 4 == 0 and src 4-byte aligned: a word = 4 taps of one row; kn % 4 == 0 (kn = min(KC, K - k0))
    constexpr int QW = KC / 4, NB = 4;
    const uint32_t x4 = x * 0x01010101u;
    const int n = rows * QW;
    for (int e0 = lt; e0 < n; e0 += NB * kGroupThreads) {
      uint32_t v[NB];
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int e = e0 + j * kGroupThreads, r = e / QW, q = e - r * QW;
        const long long m = row0 + r;
        v[j] = 0;
        if (e < n && m < total && 4 * q < kn) v[j] = __ldg(reinterpret_cast<const uint32_t*>(src + m * K + k0 + 4 * q));
      }
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int e = e0 + j * kGroupThreads, r = e / QW, q = e - r * QW;
        if (e >= n) break;
        const uint32_t w = v[j] ^ x4;
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[(4 * q + i) * rows + r] = (uint8_t)(w >> (8 * i));
      }
    }
  } else {
    constexpr int NB = 8;
    const int n = rows * KC;
    for (int e0 = lt; e0 < n; e0 += NB * kGroupThreads) {
      uint32_t v[NB];
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int e = e0 + j * kGroupThreads, r = e / KC, kk = e - r * KC;
        const long long m = row0 + r;
        v[j] = 0;
        if (e < n && m < total && kk < kn) v[j] = __ldg(src + m * K + k0 + kk);
      }
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int e = e0 + j * kGroupThreads, r = e / KC, kk = e - r * KC;
        if (e >= n) break;
        dst[kk * rows + r] = (uint8_t)(v[j] ^ x);
      }
    }
  }
}

template <int MODE, int G, int R, int C, int KC, bool COLS>
__device__ __forceinline__ void run_groups(const Args& p, uint8_t* smem) {
  const int tid = threadIdx.x, g = tid / kGroupThreads, lt = tid - g * kGroupThreads;
  const int TM = p.TM, TN = p.TN, Mt = TM * R, Nt = TN * C;
  // lanes along columns (COLS: consecutive threads take consecutive tn) or along rows
  // (consecutive tm: a warp's lanes share b's codes and differ in a's, so concentrated a codes -- P's -- give
  // identical addresses, which broadcast)
  const int tm = COLS ? lt / TN : lt % TM, tn = COLS ? lt % TN : lt / TM;
  const bool active = lt < TM * TN;
  int16_t* S = reinterpret_cast<int16_t*>(smem);
  uint16_t* U = reinterpret_cast<uint16_t*>(smem);
  uint8_t* as = smem + kTableBytes + g * (2 * KC * kMaxTile);  // this group's [KC][Mt] row codes, row(a) form
  uint8_t* bs = as + KC * kMaxTile;                            // [KC][Nt] b codes (column index or raw)
  const long long per_batch = p.mtiles * p.ntiles, tstride = (long long)gridDim.x * G;
  // tile t's batch and first row and column
  auto coords = [&](long long t, long long& i, long long& m0, long long& n0) {
    i = t / per_batch;
    const long long rem = t - i * per_batch, mt = rem / p.ntiles;
    m0 = mt * Mt, n0 = (rem - mt * p.ntiles) * Nt;
  };
  const long long first = (long long)blockIdx.x * G + g;
  if (MODE == S16) {
    // 16-byte loads, 8 in flight a thread before any store: one serial L2 round trip per entry group of the
    // table would keep the block from its first lookup for tens of microseconds
    constexpr int kQuads = 65536 / 4, kBatch = 8;
    const int4* E4 = reinterpret_cast<const int4*>(p.E);
    for (int q0 = tid; q0 < kQuads; q0 += kBatch * G * kGroupThreads) {
      int4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int q = q0 + j * G * kGroupThreads;
        if (q < kQuads) v[j] = __ldg(E4 + q);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int q = q0 + j * G * kGroupThreads;
        if (q >= kQuads) break;
        // row q / 64, entries 4 (q % 64) .. + 3: a 4-byte aligned pair of words (rows are 516 bytes)
        uint32_t* d = reinterpret_cast<uint32_t*>(S + (q >> 6) * kS16Stride + 4 * (q & 63));
        d[0] = (uint32_t)(uint16_t)v[j].x | (uint32_t)(uint16_t)v[j].y << 16;
        d[1] = (uint32_t)(uint16_t)v[j].z | (uint32_t)(uint16_t)v[j].w << 16;
      }
    }
  } else if (MODE == U16) {
    for (int e = tid; e < 256 * 129; e += G * kGroupThreads) {
      const int r = e / 129, m = e - r * 129;
      U[r * kU16Stride + m] = (uint16_t)__ldg(p.lut + r * 256 + m);
    }
  }
  __syncthreads();  // the table is stored (every group reads all of it)
  const uint32_t bx = MODE == U16 ? 0u : 0x80u;
  // byte offsets: row stride and entry size of the table in use
  constexpr uint32_t kRowBytes = MODE == S16 ? kS16Stride * 2 : MODE == U16 ? kU16Stride * 2 : 256 * 4;
  constexpr uint32_t kEntry = MODE == G32 ? 4 : 2;
  const char* tbase = MODE == G32 ? reinterpret_cast<const char*>(p.E) : reinterpret_cast<const char*>(smem);
  for (long long t = first; t < p.tiles; t += tstride) {
    long long i, m0, n0;
    coords(t, i, m0, n0);
    const uint8_t* ai = p.a + (i * p.M) * p.K;
    const uint8_t* bi = reinterpret_cast<const uint8_t*>(p.b) + (i * p.N) * p.K;
    uint32_t acc[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] = 0;
    for (int k0 = 0; k0 < p.K; k0 += KC) {
      const int kn = min(KC, p.K - k0);
      group_sync(g, G);  // the group's reads of the previous chunk (or tile) are done
      stage<KC>(as, ai, m0, Mt, p.M, p.K, k0, kn, p.xmask, p.words, lt);
      stage<KC>(bs, bi, n0, Nt, p.N, p.K, k0, kn, bx, p.words, lt);
      group_sync(g, G);
      if (active) {
        const uint8_t* ap = as + tm * R;
        const uint8_t* bp = bs + tn * C;
#pragma unroll(G <= 2 ? 2 : 1)  // two taps: their products summed by one IADD3; 768 threads leave <= 80 registers
        for (int kk = 0; kk < kn; ++kk) {
          Codes<R> ac;
          Codes<C> bc;
          ac.load(ap + kk * Mt);
          bc.load(bp + kk * Nt);
          uint32_t col[C];
          int sgn[C];
#pragma unroll
          for (int c = 0; c < C; ++c) {
            if (MODE == U16) {
              const int bv = (int)(int8_t)(uint8_t)bc[c];
              col[c] = (uint32_t)(bv < 0 ? -bv : bv) * kEntry;
              sgn[c] = (bv > 0) - (bv < 0);
            } else {
              col[c] = bc[c] * kEntry;
              sgn[c] = 1;
            }
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const char* row = tbase + ac[r] * kRowBytes;
#pragma unroll
            for (int c = 0; c < C; ++c) {
              if (MODE == S16) {
                acc[r][c] += (uint32_t)(int32_t)*reinterpret_cast<const int16_t*>(row + col[c]);
              } else if (MODE == U16) {
                acc[r][c] += (uint32_t)*reinterpret_cast<const uint16_t*>(row + col[c]) * (uint32_t)sgn[c];
              } else {
                acc[r][c] += (uint32_t)__ldg(reinterpret_cast<const int32_t*>(row + col[c]));
              }
            }
          }
        }
      }
    }
    if (active) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const long long m = m0 + tm * R + r;
        if (m >= p.M) break;
        int32_t* o = p.out + (i * p.M + m) * p.N;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const long long n = n0 + tn * C + c;
          if (n < p.N) o[n] = (int32_t)acc[r][c];
        }
      }
    }
  }
}

template <int G, int R, int C, int KC, bool COLS>
__global__ void __launch_bounds__(G* kGroupThreads, 1) lut_bmm_groups_kernel(Args p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const bool fits16 = p.flags[0] != 0, fitsu16 = p.is_unsigned && p.flags[1] != 0;
  if (fitsu16 && !fits16)
    run_groups<U16, G, R, C, KC, COLS>(p, smem);
  else if (fits16)
    run_groups<S16, G, R, C, KC, COLS>(p, smem);
  else
    run_groups<G32, G, R, C, KC, COLS>(p, smem);
}

// The thread grid (TM rows x TN columns of threads, TM * TN <= 256) whose tiles pad M and N least: the work
// computed (padded rows x padded columns) over the useful work, times floor / (TM * TN) where fewer than
// `floor` threads work (floor 256 would count every idle thread; the "_pad" variants, all of them now, let up
// to a quarter idle: floor 192, so 197 x 64 gets tiles of 200 rows instead of 256). Ties go to the larger grid
// (fewer code loads per MAC).
void choose_grid(int64_t M, int64_t N, int Rr, int Cc, int floor, int& TM, int& TN) {
  double best = 1e300;
  TM = TN = 0;
  for (int tn = 1; tn <= kMaxTile / Cc; ++tn)
    for (int tm = std::min(kGroupThreads / tn, kMaxTile / Rr); tm >= 1; --tm) {
      const int64_t mt = (int64_t)tm * Rr, nt = (int64_t)tn * Cc;
      const double rows = (double)((M + mt - 1) / mt * mt), cols = (double)((N + nt - 1) / nt * nt);
      const double cost = rows * cols * std::max(1.0, (double)floor / ((double)tm * tn));
      if (cost < best * (1 - 1e-9) || (cost <= best * (1 + 1e-9) && tm * tn > TM * TN)) {
        best = cost, TM = tm, TN = tn;
      }
    }
}

// The variants by index (checks.h kBmmVariants names them in this order). Shared memory: the int16 table and
// per group two staging buffers of KC x 256 bytes.
struct Variant {
  void (*kernel)(Args);
  int G, R, C, KC, floor;
};

template <int G, int R, int C, int KC, bool COLS = true>
constexpr Variant make_variant(int floor) {
  return {lut_bmm_groups_kernel<G, R, C, KC, COLS>, G, R, C, KC, floor};
}

const Variant kVariants[] = {
    make_variant<2, 4, 8, 64>(192),         // g2_r4c8_k64_pad: 512 threads, 4 x 8 outputs a thread, 64 taps a chunk
    make_variant<3, 4, 4, 64>(192),         // g3_k64_pad: 768 threads, 4 x 4 outputs a thread
    make_variant<2, 8, 4, 64>(192),         // g2_r8c4_k64_pad: 8 x 4 outputs a thread
    make_variant<2, 4, 8, 64, false>(192),  // g2_r4c8_k64_rowlanes: a warp's lanes along rows
    make_variant<2, 4, 8, 32>(192),         // g2_r4c8_pad: 32 taps a chunk
    make_variant<3, 4, 4, 32>(192),         // g3_pad
};
static_assert(sizeof(kVariants) / sizeof(kVariants[0]) == approx_checks::kBmmVariantCount,
              "kVariants and checks.h kBmmVariants list the same variants");
// lut_bmm's candidates: the first kAutoCandidates variants, timed on the first call of each shape (below)
constexpr int kAutoCandidates = 4;

constexpr int smem_bytes(int G, int KCc) { return kTableBytes + G * 2 * KCc * kMaxTile; }

// One call's operands, effective table and flags, prepared once whichever variants then run on them.
struct Call {
  at::Tensor out, E, flags;
  Args p;
  int sms = 0, optin = 0;
  cudaStream_t stream;
};

Call prepare_call(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut, const approx_checks::BmmShape& s) {
  Call c;
  c.stream = c10::cuda::getCurrentCUDAStream();
  c.out = at::empty({s.B, s.M, s.N}, a.options().dtype(at::kInt));
  if (c.out.numel() == 0 || s.K == 0) return c;
  const bool is_unsigned = a.scalar_type() == at::kByte;
  c.E = at::empty({256, 256}, lut.options());
  c.flags = at::ones({2}, lut.options());
  prep_kernel<<<256, 256, 0, c.stream>>>(lut.data_ptr<int32_t>(), c.E.data_ptr<int32_t>(), c.flags.data_ptr<int>(),
                                         is_unsigned);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Args& p = c.p;
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.b = b.data_ptr<int8_t>();
  p.lut = lut.data_ptr<int32_t>();
  p.E = c.E.data_ptr<int32_t>();
  p.flags = c.flags.data_ptr<int>();
  p.out = c.out.data_ptr<int32_t>();
  p.B = s.B, p.M = s.M, p.N = s.N, p.K = (int)s.K;
  p.xmask = is_unsigned ? 0u : 0x80u;
  p.is_unsigned = is_unsigned;
  p.words = s.K % 4 == 0 && reinterpret_cast<uintptr_t>(p.a) % 4 == 0 && reinterpret_cast<uintptr_t>(p.b) % 4 == 0;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&c.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return c;
}

void launch(const Call& c, int64_t variant) {
  const Variant& v = kVariants[variant];
  Args p = c.p;
  choose_grid(p.M, p.N, v.R, v.C, v.floor, p.TM, p.TN);
  p.mtiles = (p.M + p.TM * v.R - 1) / (p.TM * v.R);
  p.ntiles = (p.N + p.TN * v.C - 1) / (p.TN * v.C);
  p.tiles = p.B * p.mtiles * p.ntiles;
  const int smem = smem_bytes(v.G, v.KC);
  TORCH_CHECK(smem <= c.optin, "lut_bmm: the CUDA kernel (variant " +
                                   std::string(approx_checks::kBmmVariants[variant]) + ") needs " +
                                   std::to_string(smem) + " bytes of shared memory per block, the device allows " +
                                   std::to_string(c.optin));
  // per call: cheap next to a launch, and right when the process moves to another device
  C10_CUDA_CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t grid = std::min<int64_t>((p.tiles + v.G - 1) / v.G, c.sms);
  v.kernel<<<(unsigned)grid, v.G * kGroupThreads, smem, c.stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool empty_call(const Call& c, const approx_checks::BmmShape& s) {
  if (c.out.numel() == 0) return true;
  if (s.K == 0) c.out.zero_();
  return s.K == 0;
}

at::Tensor lut_bmm_variant_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut, int64_t variant) {
  const auto s = approx_checks::check_bmm(a, b, lut, c10::DeviceType::CUDA);
  approx_checks::check_bmm_variant(variant);
  TORCH_CHECK(s.K < (1ll << 30), "lut_bmm: K must be below 2^30 on CUDA");
  const c10::cuda::CUDAGuard guard(a.device());
  const Call c = prepare_call(a, b, lut, s);
  if (!empty_call(c, s)) launch(c, variant);
  return c.out;
}

// lut_bmm's pick per (device, B, M, N, K, code type, word staging): no one layout wins every shape (ViT-B/16 on
// an H100: g2_r4c8_k64_pad leads on P.V, g3_k64_pad may on Q.K^T; lut_bmm_cuda.cu's table), and every variant
// sums the same int32s, so the pick changes the time only. The first call of a key times the candidates as
// autotune.cpp does for the convolutions: each once to warm up, then the best of 3 CUDA-event timings of two
// back-to-back runs. Inside a CUDA graph capture nothing can be timed: variant 0 runs.
using BmmKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, bool, bool>;
std::mutex g_pick_mu;
std::map<BmmKey, int64_t> g_picks;

int64_t pick(const Call& c) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const Args& p = c.p;
  const BmmKey key{dev, p.B, p.M, p.N, p.K, p.is_unsigned, p.words};
  {
    std::lock_guard<std::mutex> lock(g_pick_mu);
    const auto it = g_picks.find(key);
    if (it != g_picks.end()) return it->second;
  }
  if (approx_cuda::capturing()) return 0;
  cudaEvent_t e0, e1;
  C10_CUDA_CHECK(cudaEventCreate(&e0));
  C10_CUDA_CHECK(cudaEventCreate(&e1));
  int64_t best = 0;
  float best_ms = 1e30f;
  for (int64_t v = 0; v < kAutoCandidates; ++v) {
    if (smem_bytes(kVariants[v].G, kVariants[v].KC) > c.optin) continue;
    launch(c, v);
    for (int r = 0; r < 3; ++r) {
      C10_CUDA_CHECK(cudaEventRecord(e0, c.stream));
      launch(c, v);
      launch(c, v);
      C10_CUDA_CHECK(cudaEventRecord(e1, c.stream));
      C10_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (ms < best_ms) best_ms = ms, best = v;
    }
  }
  C10_CUDA_CHECK(cudaEventDestroy(e0));
  C10_CUDA_CHECK(cudaEventDestroy(e1));
  std::lock_guard<std::mutex> lock(g_pick_mu);
  g_picks.emplace(key, best);
  return best;
}

at::Tensor lut_bmm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut) {
  const auto s = approx_checks::check_bmm(a, b, lut, c10::DeviceType::CUDA);
  TORCH_CHECK(s.K < (1ll << 30), "lut_bmm: K must be below 2^30 on CUDA");
  const c10::cuda::CUDAGuard guard(a.device());
  const Call c = prepare_call(a, b, lut, s);
  if (!empty_call(c, s)) launch(c, pick(c));
  return c.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CUDA, m) {
  m.impl("lut_bmm", &lut_bmm_cuda);
  m.impl("lut_bmm_variant", &lut_bmm_variant_cuda);
}
