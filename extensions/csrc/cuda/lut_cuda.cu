// CUDA kernels for approx::lut_linear and approx::lut_conv2d (arithmetic: see ../ops.cpp).
//
// Both ops are one implicit GEMM: a row is one output pixel of one group (linear: one row of a),
// a tap k is one of the K codes that row reads. Conv rows gather their codes straight from the
// input through a per-tap table {offset, dy, dx}; padding taps read code 0, which then goes
// through the LUT like any other code. No im2col buffer exists.
//
// Per call, a small "prep" kernel writes the effective product table E[a][w + 128] (weight sign
// folded in for unsigned multipliers) in int32 and int16, and one flag per prep block saying
// whether every product fits int16. The main kernels read the flags on the device and take the
// int16 or the int32 path, so no call waits for the host.
//
// Algorithms (algo=):
//   direct         E in shared memory (int16, 128 KiB; int32 tables are read through L1/L2),
//                  one lookup per MAC. No per-weight table: small batches and training.
//   expanded_smem  weight-expanded table T[g][k][a][n] = E[a][w[g*N+n][k]] streamed through
//                  shared memory in chunks of taps (cp.async, double-buffered); one 16-byte load
//                  gives 8 channels (int16) for one code. For N <= 16 per group.
//   expanded_l2    the same table read straight from L2/L1 (any N; wide fully-connected layers,
//                  where a tap's slice of T is too large to stage).
//   expanded       expanded_smem when it applies, else expanded_l2.
//   auto           a timed trial of the candidates on the first call of each shape, cached.
//
// int16 tables are summed two channels per 32-bit word: the low channel is stored with its sign
// bit flipped (offset binary), so for words x_k = hi_k * 2^16 + (lo_k + 2^15):
//   sum(hi) = sum(x_k >> 16)   and   sum(lo) = sum(x_k) - 2^16 * sum(hi) - 2^15 * K  (mod 2^32)
// which is exact int32 arithmetic with two adds per word.
#include <ATen/ATen.h>
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers, which some CUDA
// installs (the toolkit-only ones CI builds with) do not ship. Same current-stream function.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <type_traits>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int kThreads = 256;
constexpr int kPrepBlocks = 8;   // each handles 32 LUT rows and writes one fit flag
constexpr int kKAlign = 8;       // taps of T padded to a multiple of this (every KC divides it)
constexpr int kMaxNGB = 32;      // 8-channel groups per block at most (grid.z covers the rest)
constexpr int64_t kTableBudget = 1ll << 30;  // bytes of T (int32 layout) beyond which expanded is off

// Division by a launch constant as a multiply-high and shift (n < 2^31): 64-bit and plain 32-bit
// divisions per row were a sizeable share of conv1's instructions.
struct FastDiv {
  unsigned d, mul, shift;
};

FastDiv make_fastdiv(unsigned d) {
  unsigned s = 0;
  while ((1ull << s) < d) ++s;
  const unsigned long long m = ((1ull << 32) * ((1ull << s) - d)) / d + 1;
  return FastDiv{d, static_cast<unsigned>(m), s};
}

__device__ __forceinline__ unsigned fdiv(unsigned n, const FastDiv& f) {
  return (__umulhi(n, f.mul) + n) >> f.shift;
}

struct Params {
  const uint8_t* a;
  const int8_t* w;
  int32_t* out;
  const int32_t* E32;  // [256][256] effective products: row = LUT row of the code, col = w + 128
  const int16_t* E16;
  const int* flags;    // kPrepBlocks words, 1 where that block's products all fit int16
  const int4* kinfo;   // conv: per tap {input offset, dy, dx, valid}; Kpad entries
  const void* T;       // expanded table [G][Kpad][256][NG * 8]
  long long M;         // rows per group
  long long HoWo;
  int K, N, G, NG, NGB, Kpad, Ntot;
  unsigned xmask;      // code ^ xmask = LUT row (0x80 for int8 codes)
  int conv, vec;
  int stage;           // 0: codes from global per chunk; 1: conv images staged in shared memory;
                       // 2: linear rows [Mb][Kpad] staged in shared memory
  int stage_bytes;     // shared memory reserved for the staged codes (multiple of 16)
  int C, H, W, Cg, Wo, sh, sw, ph, pw;
  FastDiv fHoWo, fWo;
};

// Image and pixel of row m0 + lr, from the tile's first image b0 and offset r0 = m0 - b0 * HoWo.
struct TilePos {
  long long b0;
  unsigned r0;
};
__device__ __forceinline__ TilePos tile_pos(const Params& p, long long m0) {
  const long long b0 = p.conv ? m0 / p.HoWo : 0;
  return TilePos{b0, static_cast<unsigned>(m0 - b0 * p.HoWo)};
}
__device__ __forceinline__ void row_pos(const Params& p, TilePos tp, int lr, long long& b,
                                        unsigned& pix) {
  const unsigned r = tp.r0 + lr, q = fdiv(r, p.fHoWo);
  b = tp.b0 + q;
  pix = r - q * static_cast<unsigned>(p.HoWo);
}

__device__ __forceinline__ bool read_fits16(const int* flags) {
  int f = 1;
#pragma unroll
  for (int i = 0; i < kPrepBlocks; ++i) f &= flags[i];
  return f != 0;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ------------------------------------------------------------------------------------------------
// Prep: effective products, int16 fit flags, conv tap table.
__global__ void __launch_bounds__(kThreads) prep_kernel(const int32_t* __restrict__ lut, int uns,
                                                        int32_t* __restrict__ E32,
                                                        int16_t* __restrict__ E16, int* flags,
                                                        int4* __restrict__ kinfo, int nk, int K,
                                                        int kh, int kw, int dh, int dw, int H,
                                                        int W) {
  __shared__ int32_t rows[32 * 256];
  const int r0 = blockIdx.x * 32;
  const int4* src = reinterpret_cast<const int4*>(lut + r0 * 256);
#pragma unroll
  for (int i = 0; i < 32 * 256 / 4 / kThreads; ++i)
    reinterpret_cast<int4*>(rows)[threadIdx.x + i * kThreads] = src[threadIdx.x + i * kThreads];
  __syncthreads();
  int ok = 1;
  for (int e = threadIdx.x; e < 32 * 256; e += kThreads) {
    const int r = e >> 8, wi = e & 255, wv = wi - 128;
    uint32_t v;
    if (!uns) v = static_cast<uint32_t>(rows[e]);
    else if (wv > 0) v = static_cast<uint32_t>(rows[r * 256 + wv]);
    else if (wv < 0) v = 0u - static_cast<uint32_t>(rows[r * 256 - wv]);  // magnitude, then sign
    else v = 0u;  // sign(0) = 0: w = 0 contributes 0 (the contract in ops.cpp / runner/ops.py)
    const int sv = static_cast<int>(v);
    E32[r0 * 256 + e] = sv;
    E16[r0 * 256 + e] = static_cast<int16_t>(sv);
    ok &= (sv >= -32768 && sv <= 32767);
  }
  ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) flags[blockIdx.x] = ok;
  if (kinfo) {
    const int taps = kh * kw;
    for (int k = blockIdx.x * kThreads + threadIdx.x; k < nk; k += kPrepBlocks * kThreads) {
      int4 ki = make_int4(0, 0, 0, 0);
      if (k < K) {
        const int c = k / taps, r = k - c * taps, i = r / kw, j = r - i * kw;
        ki.y = i * dh;
        ki.z = j * dw;
        ki.x = c * H * W + ki.y * W + ki.z;
        ki.w = 1;
      }
      kinfo[k] = ki;
    }
  }
}

// Expanded table, in the format the fit flags choose. One thread per pair of channels.
// 32-bit indices: the table budget keeps pairs far below 2^31 (64-bit divisions made this
// kernel a tenth of the five LeNet layers' time).
__global__ void build_table_kernel(Params p, int pairs) {
  const bool f16 = read_fits16(p.flags);
  const int pr = p.NG * 4;  // channel pairs per (k, a)
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < pairs; q += gridDim.x * blockDim.x) {
    const int ka = q / pr, jp = q - ka * pr;
    const int a = ka & 255, gk = ka >> 8;
    const int g = gk / p.Kpad, k = gk - g * p.Kpad;
    const int n0 = jp * 2;
    uint32_t v[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int n = n0 + t;
      v[t] = 0;
      if (k < p.K && n < p.N)
        v[t] = static_cast<uint32_t>(
            __ldg(p.E32 + a * 256 + (int)p.w[((long long)g * p.N + n) * p.K + k] + 128));
    }
    if (f16) {
      reinterpret_cast<uint32_t*>(const_cast<void*>(p.T))[q] =
          ((v[0] & 0xFFFFu) ^ 0x8000u) | (v[1] << 16);
    } else {
      reinterpret_cast<uint2*>(const_cast<void*>(p.T))[q] = make_uint2(v[0], v[1]);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Shared pieces of the main kernels.

// Per-row gather info for conv tiles: base offset of (image, group, top-left tap), and the
// top-left input coordinate (rows past M get a coordinate that fails every bounds check).
struct RowInfo {
  long long* base;
  int* iyx;  // top-left input row (low 16 bits) and column (high 16 bits), signed
};
constexpr int kRowInfoBytes = 12;

__device__ __forceinline__ void fill_rowinfo(const Params& p, int grp, long long m0, int Mb,
                                             RowInfo ri) {
  const TilePos tp = tile_pos(p, m0);
  const long long b0 = tp.b0;
  const long long hw = (long long)p.H * p.W;
  for (int lr = threadIdx.x; lr < Mb; lr += blockDim.x) {
    const long long m = m0 + lr;
    if (m < p.M) {
      long long b;
      unsigned upix;
      row_pos(p, tp, lr, b, upix);
      const int pix = static_cast<int>(upix);
      const int oy = static_cast<int>(fdiv(upix, p.fWo)), ox = pix - oy * p.Wo;
      const int iy0 = oy * p.sh - p.ph, ix0 = ox * p.sw - p.pw;
      // staged: offset into this block's copy of its images' group channels
      ri.base[lr] = (p.stage == 1 ? (b - b0) * p.Cg * hw : (b * p.C + (long long)grp * p.Cg) * hw) +
                    (long long)iy0 * p.W + ix0;
      ri.iyx[lr] = static_cast<int>((static_cast<unsigned>(iy0) & 0xFFFFu) |
                                    (static_cast<unsigned>(ix0) << 16));
    } else {
      ri.base[lr] = 0;
      ri.iyx[lr] = 0x8000;  // row -32768: below the image for every tap
    }
  }
}

template <int KC>
__device__ __forceinline__ void store_word(uint8_t* p, uint64_t v) {
  if constexpr (KC == 8) *reinterpret_cast<uint2*>(p) = make_uint2((uint32_t)v, (uint32_t)(v >> 32));
  else if constexpr (KC == 4) *reinterpret_cast<uint32_t*>(p) = (uint32_t)v;
  else *reinterpret_cast<uint16_t*>(p) = (uint16_t)v;
}
template <int KC>
__device__ __forceinline__ uint64_t load_word(const uint8_t* p) {
  if constexpr (KC == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return (uint64_t)v.x | ((uint64_t)v.y << 32);
  } else if constexpr (KC == 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    return *reinterpret_cast<const uint16_t*>(p);
  }
}

// Copies the block's codes into shared memory once (stage 1: the images its rows read, for the
// group's channels; stage 2: its rows of a, as LUT rows, padded to Kpad), so that the per-chunk
// gathers do not wait on global memory.
__device__ __forceinline__ void stage_codes(const Params& p, int grp, long long m0, int Mb,
                                            uint8_t* st) {
  if (p.stage == 1) {
    const long long hw = (long long)p.H * p.W, cghw = p.Cg * hw;
    const long long b0 = m0 / p.HoWo;
    const long long b1 = (min(m0 + Mb, p.M) - 1) / p.HoWo;
    const long long src0 = (b0 * p.C + (long long)grp * p.Cg) * hw, img = (long long)p.C * hw;
    const uint8_t* a = p.a;
    if ((cghw & 3) == 0 && (img & 3) == 0 && ((reinterpret_cast<uintptr_t>(a) & 3) == 0)) {
      const int wpi = static_cast<int>(cghw >> 2);
      const int total = static_cast<int>((b1 - b0 + 1) * wpi);
#pragma unroll 4
      for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int j = e / wpi, t = e - j * wpi;
        reinterpret_cast<uint32_t*>(st)[e] =
            __ldg(reinterpret_cast<const uint32_t*>(a + src0 + j * img) + t);
      }
    } else {
      const int bpi = static_cast<int>(cghw);
      const int total = static_cast<int>((b1 - b0 + 1) * bpi);
#pragma unroll 4
      for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int j = e / bpi, t = e - j * bpi;
        st[e] = __ldg(a + src0 + j * img + t);
      }
    }
  } else if (p.stage == 2) {
    const uint32_t xm = 0x01010101u * p.xmask;
    const int wpr = p.Kpad >> 2;  // 4-code words per row
    const int total = Mb * wpr;
#pragma unroll 4
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
      const int lr = e / wpr, j = e - lr * wpr, k = j * 4;
      const long long m = m0 + lr;
      uint32_t word = 0;
      if (m < p.M) {
        const uint8_t* src = p.a + m * p.K + k;
        if (p.vec) {
          if (k < p.K) word = __ldg(reinterpret_cast<const uint32_t*>(src));
        } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            if (k + kk < p.K) word |= (uint32_t)__ldg(src + kk) << (8 * kk);
        }
      }
      reinterpret_cast<uint32_t*>(st)[e] = word ^ xm;
    }
  }
}

// Codes of taps [k0, k0 + KC) for the Mb rows of the tile, as LUT rows, into act[Mb][KC].
template <int KC>
__device__ __forceinline__ void gather_tile(const Params& p, int grp, long long m0, int Mb, int k0,
                                            uint8_t* act, RowInfo ri, const uint8_t* st,
                                            int astride = KC) {
  const uint64_t xm = 0x0101010101010101ull * p.xmask;
  const unsigned sbase = static_cast<unsigned>(__cvta_generic_to_shared(st));
  int4 kin[KC];
  if (p.conv) {
#pragma unroll
    for (int kk = 0; kk < KC; ++kk) kin[kk] = __ldg(p.kinfo + k0 + kk);
  }
  for (int lr = threadIdx.x; lr < Mb; lr += blockDim.x) {
    uint64_t word = 0;
    if (p.conv) {
      const long long base = ri.base[lr];
      const int iyx = ri.iyx[lr];
      const int iy0 = static_cast<int>(static_cast<short>(iyx & 0xFFFF)), ix0 = iyx >> 16;
#pragma unroll
      for (int kk = 0; kk < KC; ++kk) {
        const int4 ki = kin[kk];
        const int iy = iy0 + ki.y, ix = ix0 + ki.z;
        uint32_t v = 0;
        if (ki.w && (unsigned)iy < (unsigned)p.H && (unsigned)ix < (unsigned)p.W) {
          if (p.stage == 1) {
            const unsigned addr = sbase + static_cast<unsigned>(static_cast<int>(base) + ki.x);
            asm("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
          } else {
            v = __ldg(p.a + base + ki.x);
          }
        }
        word |= (uint64_t)v << (8 * kk);
      }
    } else {
      const long long m = m0 + lr;
      if (m < p.M) {
        const uint8_t* src = p.a + m * p.K + k0;
        if (p.vec && k0 + KC <= p.K) {
          word = load_word<KC>(src);
        } else {
#pragma unroll
          for (int kk = 0; kk < KC; ++kk)
            if (k0 + kk < p.K) word |= (uint64_t)__ldg(src + kk) << (8 * kk);
        }
      }
    }
    store_word<KC>(act + lr * astride, word ^ xm);
  }
}

// Writes the 8 channels of one row.
__device__ __forceinline__ void store_row(const Params& p, int grp, long long m, int nbase,
                                          const uint32_t (&v)[8], TilePos tp, int lr) {
  long long obase, ostr;
  if (p.conv) {
    long long b;
    unsigned pix;
    row_pos(p, tp, lr, b, pix);
    obase = (b * p.Ntot + (long long)grp * p.N) * p.HoWo + pix;
    ostr = p.HoWo;
  } else {
    obase = m * p.Ntot;
    ostr = 1;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (nbase + j < p.N) p.out[obase + (nbase + j) * ostr] = static_cast<int32_t>(v[j]);
}

// ------------------------------------------------------------------------------------------------
// Expanded: thread (rs, ng) sums R rows (rs + rowsets * i) x 8 channels (group ng of the block).
template <typename TT, int KC, int NGT, int R, bool SMEM>
__device__ __forceinline__ void expanded_body(const Params& p, uint8_t* smem) {
  const int NGB = NGT ? NGT : p.NGB;
  const int rowsets = kThreads / NGB;
  const int Mb = rowsets * R;
  const int tid = threadIdx.x, grp = blockIdx.y;
  const int ngz = blockIdx.z * NGB;
  const long long m0 = (long long)blockIdx.x * Mb;
  const int ng = tid % NGB, rs = tid / NGB;
  constexpr int VPR = sizeof(TT) == 2 ? 1 : 2;  // int4 per 8 channels
  const int rowq = p.NG * VPR;                     // int4 per T row (all channels)
  const long long chunk_q = (long long)KC * 256 * rowq;
  const int4* Tg = static_cast<const int4*>(p.T) + (long long)grp * p.Kpad * 256 * rowq;

  // Shared memory: [T buffers (SMEM)][staged codes][act Mb*KC][row info (conv)]
  uint8_t* sp = smem;
  int4* tb0 = reinterpret_cast<int4*>(sp);
  int4* tb1 = tb0 + (SMEM ? chunk_q : 0);
  sp += SMEM ? 2 * chunk_q * 16 : 0;
  uint8_t* st = sp;
  sp += p.stage_bytes;
  uint8_t* act = sp;
  sp += ((Mb * KC + 15) / 16) * 16;
  RowInfo ri{reinterpret_cast<long long*>(sp), reinterpret_cast<int*>(sp + Mb * 8)};
  if (p.conv) fill_rowinfo(p, grp, m0, Mb, ri);
  stage_codes(p, grp, m0, Mb, st);
  // codes of row lr, chunk c: act + lr * KC (gathered per chunk) or st + lr * Kpad + c * KC
  const int cstride = p.stage == 2 ? p.Kpad : KC;

  auto copy_chunk = [&](int c, int4* dst) {
    const int4* src = Tg + c * chunk_q;
    for (int q = tid; q < chunk_q; q += kThreads) cp_async16(dst + q, src + q);
    cp_async_commit();
  };

  uint32_t acc[R][8];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0;

  const int nchunks = p.Kpad / KC;
  if (SMEM) copy_chunk(0, tb0);
  __syncthreads();  // row info
  for (int c = 0; c < nchunks; ++c) {
    if (p.stage != 2) gather_tile<KC>(p, grp, m0, Mb, c * KC, act, ri, st);
    if (SMEM) {
      if (c + 1 < nchunks) {
        copy_chunk(c + 1, (c & 1) ? tb0 : tb1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    }
    // Also where nothing is shared per chunk (staged rows, T from L2): warps that stay in step
    // share each tap's slice of T in L1 (measured: fc1 0.16 ms with, 0.26 ms without).
    __syncthreads();
    if (rs < rowsets) {
      const int4* tq = SMEM ? ((c & 1) ? tb1 : tb0) : Tg + c * chunk_q;
      tq += (ngz + ng) * VPR;
      const uint8_t* cbase = p.stage == 2 ? st + c * KC : act;
      // Padded taps hold zeros: the last chunk skips their loads; full chunks run unguarded so
      // that all their loads can be in flight together.
      const bool full = (c + 1) * KC <= p.K;
      const int kmax = min(KC, p.K - c * KC);
      auto chunk = [&](auto full_tag) {
        constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const uint64_t codes = load_word<KC>(cbase + (rs + rowsets * i) * cstride);
#pragma unroll
          for (int kk = 0; kk < KC; ++kk) {
            if (!kFull && kk >= kmax) break;
            const int idx = static_cast<int>((codes >> (8 * kk)) & 255);
            const int4* e = tq + (kk * 256 + idx) * rowq;
            if constexpr (sizeof(TT) == 2) {
              const int4 v = SMEM ? *e : __ldg(e);
              acc[i][0] += (uint32_t)v.x; acc[i][1] += (uint32_t)(v.x >> 16);
              acc[i][2] += (uint32_t)v.y; acc[i][3] += (uint32_t)(v.y >> 16);
              acc[i][4] += (uint32_t)v.z; acc[i][5] += (uint32_t)(v.z >> 16);
              acc[i][6] += (uint32_t)v.w; acc[i][7] += (uint32_t)(v.w >> 16);
            } else {
              const int4 v0 = SMEM ? e[0] : __ldg(e);
              const int4 v1 = SMEM ? e[1] : __ldg(e + 1);
              acc[i][0] += (uint32_t)v0.x; acc[i][1] += (uint32_t)v0.y;
              acc[i][2] += (uint32_t)v0.z; acc[i][3] += (uint32_t)v0.w;
              acc[i][4] += (uint32_t)v1.x; acc[i][5] += (uint32_t)v1.y;
              acc[i][6] += (uint32_t)v1.z; acc[i][7] += (uint32_t)v1.w;
            }
          }
        }
      };
      if (full) chunk(std::true_type{});
      else chunk(std::false_type{});
    }
    __syncthreads();
  }
  if (rs >= rowsets) return;
  const TilePos tp = tile_pos(p, m0);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const long long m = m0 + rs + rowsets * i;
    if (m >= p.M) continue;
    uint32_t v[8];
    if constexpr (sizeof(TT) == 2) {
      const uint32_t bias = 32768u * (uint32_t)p.K;  // one offset low half per tap summed
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t h = acc[i][2 * j + 1];
        v[2 * j] = acc[i][2 * j] - (h << 16) - bias;
        v[2 * j + 1] = h;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = acc[i][j];
    }
    store_row(p, grp, m, (ngz + ng) * 8, v, tp, rs + rowsets * i);
  }
}

template <int KC16, int KC32, int NGT, int R, bool SMEM>
__global__ void __launch_bounds__(kThreads, 2) expanded_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (read_fits16(p.flags))
    expanded_body<int16_t, KC16, NGT, R, SMEM>(p, smem);
  else
    expanded_body<int32_t, KC32, NGT, R, SMEM>(p, smem);
}

// ------------------------------------------------------------------------------------------------
// Expanded, table resident: for 8-channel layers (N <= 8 per group) whose int16 table fits in
// shared memory whole (conv1: 25 taps x 4 KiB). A persistent grid loads T once per block, then
// walks row tiles: gather every tap of 2,048 rows, one barrier, sum, one barrier. An int32 table
// is read from L2 in the same loop.
constexpr int kResThreads = 512;
constexpr int kResR = 4;
constexpr int kResMb = kResThreads * kResR;

template <typename TT>
__device__ __forceinline__ void resident_body(const Params& p, uint8_t* smem) {
  constexpr bool TSM = sizeof(TT) == 2;
  constexpr int VPR = TSM ? 1 : 2;
  constexpr int R = kResR, Mb = kResMb;
  const int tid = threadIdx.x, grp = blockIdx.y;
  const int astride = p.Kpad + 8;  // 8 spare bytes spread the rows' 8-byte loads over the banks
  const int4* Tg = static_cast<const int4*>(p.T) + (long long)grp * p.Kpad * 256 * VPR;
  // Shared memory: [T (int16): K x 256 rows of 16 bytes][staged codes][act Mb x astride][row info]
  uint8_t* sp = smem;
  int4* Ts = reinterpret_cast<int4*>(sp);
  sp += TSM ? (size_t)p.K * 256 * 16 : 0;
  uint8_t* st = sp;
  sp += p.stage_bytes;
  uint8_t* act = sp;
  sp += ((Mb * astride + 15) / 16) * 16;
  RowInfo ri{reinterpret_cast<long long*>(sp), reinterpret_cast<int*>(sp + Mb * 8)};
  if (TSM) {
    for (int q = tid; q < p.K * 256; q += kResThreads) cp_async16(Ts + q, Tg + q);
    cp_async_commit();
  }
  const int4* Tb = TSM ? Ts : Tg;
  const long long ntiles = (p.M + Mb - 1) / Mb;
  const int nchunks = p.Kpad / 8;
  for (long long tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const long long m0 = tile * Mb;
    if (p.conv) fill_rowinfo(p, grp, m0, Mb, ri);
    stage_codes(p, grp, m0, Mb, st);
    __syncthreads();
    if (p.stage != 2)
      for (int c = 0; c < nchunks; ++c) gather_tile<8>(p, grp, m0, Mb, c * 8, act + c * 8, ri, st, astride);
    if (TSM) cp_async_wait<0>();
    __syncthreads();
    const uint8_t* cb = p.stage == 2 ? st : act;
    const int cs = p.stage == 2 ? p.Kpad : astride;
    uint32_t acc[R][8];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0;
    for (int c = 0; c < nchunks; ++c) {
      const int kmax = min(8, p.K - c * 8);
      const int4* tq = Tb + c * 8 * 256 * VPR;
      auto chunk = [&](auto full_tag) {
        constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const uint64_t codes = load_word<8>(cb + (tid + kResThreads * i) * cs + c * 8);
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            if (!kFull && kk >= kmax) break;
            const int idx = static_cast<int>((codes >> (8 * kk)) & 255);
            const int4* e = tq + (kk * 256 + idx) * VPR;
            if constexpr (TSM) {
              const int4 v = *e;
              acc[i][0] += (uint32_t)v.x; acc[i][1] += (uint32_t)(v.x >> 16);
              acc[i][2] += (uint32_t)v.y; acc[i][3] += (uint32_t)(v.y >> 16);
              acc[i][4] += (uint32_t)v.z; acc[i][5] += (uint32_t)(v.z >> 16);
              acc[i][6] += (uint32_t)v.w; acc[i][7] += (uint32_t)(v.w >> 16);
            } else {
              const int4 v0 = __ldg(e), v1 = __ldg(e + 1);
              acc[i][0] += (uint32_t)v0.x; acc[i][1] += (uint32_t)v0.y;
              acc[i][2] += (uint32_t)v0.z; acc[i][3] += (uint32_t)v0.w;
              acc[i][4] += (uint32_t)v1.x; acc[i][5] += (uint32_t)v1.y;
              acc[i][6] += (uint32_t)v1.z; acc[i][7] += (uint32_t)v1.w;
            }
          }
        }
      };
      if (kmax == 8) chunk(std::true_type{});
      else chunk(std::false_type{});
    }
    const TilePos tp = tile_pos(p, m0);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const long long m = m0 + tid + kResThreads * i;
      if (m >= p.M) continue;
      uint32_t v[8];
      if constexpr (TSM) {
        const uint32_t bias = 32768u * (uint32_t)p.K;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t h = acc[i][2 * j + 1];
          v[2 * j] = acc[i][2 * j] - (h << 16) - bias;
          v[2 * j + 1] = h;
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = acc[i][j];
      }
      store_row(p, grp, m, 0, v, tp, tid + kResThreads * i);
    }
    __syncthreads();  // the next tile rewrites row info, staged codes and act
  }
  if (TSM) cp_async_wait<0>();  // blocks without a tile
}

__global__ void __launch_bounds__(kResThreads, 1) resident_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (read_fits16(p.flags))
    resident_body<int16_t>(p, smem);
  else
    resident_body<int32_t>(p, smem);
}

// ------------------------------------------------------------------------------------------------
// Direct: thread (rs, ng) sums R rows x 8 channels, one E lookup per MAC.
constexpr int kDirectR = 4;
constexpr int kDirectKC = 8;
constexpr int kEStride = 258;  // int16 entries per row of the shared-memory E

template <bool E16S>
__device__ __forceinline__ void direct_body(const Params& p, uint8_t* smem) {
  constexpr int R = kDirectR, KC = kDirectKC;
  const int NGB = p.NGB;
  const int rowsets = kThreads / NGB;
  const int Mb = rowsets * R;
  const int tid = threadIdx.x, grp = blockIdx.y;
  const int ngz = blockIdx.z * NGB;
  const long long m0 = (long long)blockIdx.x * Mb;
  const int ng = tid % NGB, rs = tid / NGB;

  // Shared memory: [E16, rows padded to 258 entries][staged codes][act Mb*KC]
  //                [weights KC x NGB*8][row info (conv)]
  // The padding puts row a's column c in bank (a + c/2) % 32: a warp's rows differ, its column
  // is often the same, and an unpadded 512-byte row would send all 32 lookups to one bank.
  uint8_t* sp = smem;
  int16_t* Es = reinterpret_cast<int16_t*>(sp);
  sp += kEStride * 256 * 2;
  uint8_t* st = sp;
  sp += p.stage_bytes;
  uint8_t* act = sp;
  sp += ((Mb * KC + 15) / 16) * 16;
  uint8_t* wt = sp;
  sp += ((KC * NGB * 8 + 15) / 16) * 16;
  RowInfo ri{reinterpret_cast<long long*>(sp), reinterpret_cast<int*>(sp + Mb * 8)};
  if (E16S) {
    const int4* src = reinterpret_cast<const int4*>(p.E16);
    uint32_t* dst = reinterpret_cast<uint32_t*>(Es);
#pragma unroll 8
    for (int q = tid; q < 256 * 256 * 2 / 16; q += kThreads) {
      const int4 v = __ldg(src + q);
      const int row = q >> 5, w0 = (q & 31) * 4 + row * (kEStride / 2);
      dst[w0] = v.x; dst[w0 + 1] = v.y; dst[w0 + 2] = v.z; dst[w0 + 3] = v.w;
    }
  }
  if (p.conv) fill_rowinfo(p, grp, m0, Mb, ri);
  stage_codes(p, grp, m0, Mb, st);
  const int cstride = p.stage == 2 ? p.Kpad : KC;

  uint32_t acc[R][8];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0;

  __syncthreads();  // row info
  const int nb = NGB * 8;
  for (int k0 = 0; k0 < p.K; k0 += KC) {
    if (p.stage != 2) gather_tile<KC>(p, grp, m0, Mb, k0, act, ri, st);
    for (int e = tid; e < KC * nb; e += kThreads) {
      const int kk = e / nb, n = ngz * 8 + (e - kk * nb), k = k0 + kk;
      int v = 128;
      if (k < p.K && n < p.N) v = (int)p.w[((long long)grp * p.N + n) * p.K + k] + 128;
      wt[e] = static_cast<uint8_t>(v);
    }
    __syncthreads();
    if (rs < rowsets) {
      const uint8_t* cbase = p.stage == 2 ? st + k0 : act;
      uint64_t codes[R];
#pragma unroll
      for (int i = 0; i < R; ++i) codes[i] = load_word<KC>(cbase + (rs + rowsets * i) * cstride);
      const int kmax = min(KC, p.K - k0);
#pragma unroll
      for (int kk = 0; kk < KC; ++kk) {
        if (kk < kmax) {
          const uint2 wv = *reinterpret_cast<const uint2*>(wt + kk * nb + ng * 8);
          const uint64_t w8 = (uint64_t)wv.x | ((uint64_t)wv.y << 32);
#pragma unroll
          for (int i = 0; i < R; ++i) {
            const int row = static_cast<int>((codes[i] >> (8 * kk)) & 255) * (E16S ? kEStride : 256);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const int col = static_cast<int>((w8 >> (8 * j)) & 255);
              if (E16S) acc[i][j] += (uint32_t)(int32_t)Es[row + col];
              else acc[i][j] += (uint32_t)__ldg(p.E32 + row + col);
            }
          }
        }
      }
    }
    __syncthreads();
  }
  if (rs >= rowsets) return;
  const TilePos tp = tile_pos(p, m0);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const long long m = m0 + rs + rowsets * i;
    if (m < p.M) store_row(p, grp, m, (ngz + ng) * 8, acc[i], tp, rs + rowsets * i);
  }
}

__global__ void __launch_bounds__(kThreads) direct_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (read_fits16(p.flags))
    direct_body<true>(p, smem);
  else
    direct_body<false>(p, smem);
}

// ------------------------------------------------------------------------------------------------
// Host side.

// Error messages are built from strings only: streaming integers (sizes, counts) into TORCH_CHECK
// from this nvcc-compiled file crashed the process on the GPU machine (torch 2.11, nvcc 13.0).
std::string I(int64_t v) { return std::to_string(v); }
std::string D(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
const char* T(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

enum class Algo { Auto, Direct, Expanded, ExpandedSmem, ExpandedL2, ExpandedResident };
constexpr const char* kAlgoNames =
    "auto, direct, expanded, expanded_smem, expanded_l2, expanded_resident";

Algo parse_algo(c10::string_view s, const char* op) {
  if (s == "auto") return Algo::Auto;
  if (s == "direct") return Algo::Direct;
  if (s == "expanded") return Algo::Expanded;
  if (s == "expanded_smem") return Algo::ExpandedSmem;
  if (s == "expanded_l2") return Algo::ExpandedL2;
  if (s == "expanded_resident") return Algo::ExpandedResident;
  TORCH_CHECK(false, op, ": unknown algo '", std::string(s.data(), s.size()), "'; valid: ",
              kAlgoNames);
}

void check_common(const char* op, const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut) {
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte, op,
              ": activation codes `a` must be int8 (signed multiplier) or uint8 (unsigned "
              "multiplier), got ", T(a));
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": weight codes `w` must be int8, got ",
              T(w));
  TORCH_CHECK(lut.scalar_type() == at::kInt && lut.dim() == 2 && lut.size(0) == 256 &&
                  lut.size(1) == 256,
              op, ": `lut` must be an int32 tensor of shape [256, 256], got ", T(lut),
              " ", D(lut.sizes()));
  TORCH_CHECK(a.is_contiguous(), op, ": `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(w.is_contiguous(), op, ": `w` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(lut.is_contiguous(), op, ": `lut` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == w.device() && a.device() == lut.device(), op,
              ": a, w and lut must be on the same device, got ", a.device().str(), ", ",
              w.device().str(), ", ", lut.device().str());
  TORCH_CHECK(a.is_cuda(), op, ": the CUDA kernel got tensors on ", a.device().str());
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Workspace {
  at::Tensor buf;
  Params p;
  int64_t t_bytes = 0;  // bytes of T in the int32 layout (allocated size)
};

constexpr int64_t kOffE32 = 256;
constexpr int64_t kOffE16 = kOffE32 + 256 * 256 * 4;
constexpr int64_t kOffKinfo = kOffE16 + 256 * 256 * 2;

struct ConvGeo {
  int kh = 1, kw = 1, dh = 1, dw = 1;
};

// Allocates the per-call workspace and runs the prep kernel. `p` holds the geometry already.
void prepare(Workspace& ws, const at::Tensor& lut, const ConvGeo& cg, bool need_table,
             cudaStream_t stream) {
  Params& p = ws.p;
  const int64_t nk = p.conv ? p.Kpad : 0;
  const int64_t off_t = round_up(kOffKinfo + nk * 16, 256);
  ws.t_bytes = need_table ? (int64_t)p.G * p.Kpad * 256 * p.NG * 8 * 4 : 0;
  ws.buf = at::empty({off_t + ws.t_bytes}, lut.options().dtype(at::kByte));
  uint8_t* base = ws.buf.data_ptr<uint8_t>();
  p.flags = reinterpret_cast<int*>(base);
  p.E32 = reinterpret_cast<int32_t*>(base + kOffE32);
  p.E16 = reinterpret_cast<int16_t*>(base + kOffE16);
  p.kinfo = nk ? reinterpret_cast<int4*>(base + kOffKinfo) : nullptr;
  p.T = need_table ? base + off_t : nullptr;
  prep_kernel<<<kPrepBlocks, kThreads, 0, stream>>>(
      lut.data_ptr<int32_t>(), p.xmask == 0, const_cast<int32_t*>(p.E32),
      const_cast<int16_t*>(p.E16), const_cast<int*>(p.flags), const_cast<int4*>(p.kinfo),
      static_cast<int>(nk), p.K, cg.kh, cg.kw, cg.dh, cg.dw, p.H, p.W);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Kern>
void set_smem(Kern k, size_t bytes) {
  // Once per (device, kernel) and size is enough: the attribute belongs to the function in the
  // current device's context (a process that moves to another GPU must set it again, or the
  // launch fails with "invalid argument"), and a larger size wins.
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> done;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  size_t& cur = done[{dev, reinterpret_cast<const void*>(k)}];
  if (bytes > cur) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
    cur = bytes;
  }
}

int max_smem_optin() {
  int dev = 0, v = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return v;
}

int sm_count() {
  int dev = 0, v = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
  return v;
}

int64_t rowinfo_bytes(const Params& p, int Mb) { return p.conv ? (int64_t)Mb * kRowInfoBytes : 0; }

// Stages the block's codes in shared memory when they fit `budget` bytes (see stage_codes).
void choose_stage(Params& p, int Mb, int64_t budget) {
  int64_t bytes = 0;
  if (p.conv) {
    const int64_t imgs = (Mb - 1) / p.HoWo + 2;  // most images Mb consecutive rows can touch
    bytes = imgs * p.Cg * (int64_t)p.H * p.W;
    p.stage = 1;
  } else {
    bytes = (int64_t)Mb * p.Kpad;
    p.stage = 2;
  }
  if (bytes > budget) {
    p.stage = 0;
    bytes = 0;
  }
  p.stage_bytes = static_cast<int>(round_up(bytes, 16));
}

dim3 grid_for(const Params& p, int Mb) {
  const int64_t bx = (p.M + Mb - 1) / Mb;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  return dim3(static_cast<unsigned>(bx), p.G, (p.NG + p.NGB - 1) / p.NGB);
}

void launch_direct(Params p, cudaStream_t stream) {
  p.NGB = std::min(p.NG, kMaxNGB);
  const int Mb = (kThreads / p.NGB) * kDirectR;
  choose_stage(p, Mb, 48 << 10);
  const size_t smem = kEStride * 256 * 2 + p.stage_bytes + round_up((int64_t)Mb * kDirectKC, 16) +
                      round_up((int64_t)kDirectKC * p.NGB * 8, 16) + rowinfo_bytes(p, Mb);
  TORCH_CHECK((int)smem <= max_smem_optin(), "approx direct kernel: needs ", I(smem),
              " bytes of shared memory, the device allows ", I(max_smem_optin()));
  set_smem(direct_kernel, smem);
  direct_kernel<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_build(const Params& p, cudaStream_t stream) {
  const long long pairs = (long long)p.G * p.Kpad * 256 * p.NG * 4;
  TORCH_CHECK(pairs < (1ll << 31), "approx expanded table too large");
  const int blocks = static_cast<int>(std::min<long long>((pairs + 255) / 256, 16LL * sm_count()));
  build_table_kernel<<<blocks, 256, 0, stream>>>(p, static_cast<int>(pairs));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool smem_applies(const Params& p) { return p.NG <= 2; }

// Shared memory of the resident kernel without staged codes; 0 when it cannot run this shape.
int64_t resident_base_smem(const Params& p) {
  if (p.NG != 1) return 0;
  const int64_t bytes = (int64_t)p.K * 256 * 16 + round_up((int64_t)kResMb * (p.Kpad + 8), 16) +
                        rowinfo_bytes(p, kResMb);
  return bytes <= max_smem_optin() ? bytes : 0;
}
bool resident_applies(const Params& p) { return resident_base_smem(p) > 0; }

void launch_exp_resident(Params p, cudaStream_t stream) {
  const int64_t base = resident_base_smem(p);
  choose_stage(p, kResMb, max_smem_optin() - base);
  const size_t smem = base + p.stage_bytes;
  set_smem(resident_kernel, smem);
  const int64_t ntiles = (p.M + kResMb - 1) / kResMb;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(ntiles, sm_count())), p.G, 1);
  resident_kernel<<<grid, kResThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KC16, int KC32, int NGT, int R>
void launch_exp_smem_t(Params p, cudaStream_t stream) {
  p.NGB = NGT;
  const int Mb = (kThreads / NGT) * R;
  const int64_t chunk16 = (int64_t)KC16 * 256 * NGT * 16, chunk32 = (int64_t)KC32 * 256 * NGT * 32;
  choose_stage(p, Mb, 32 << 10);
  const size_t smem = 2 * std::max(chunk16, chunk32) + p.stage_bytes +
                      round_up((int64_t)Mb * std::max(KC16, KC32), 16) + rowinfo_bytes(p, Mb);
  auto kern = expanded_kernel<KC16, KC32, NGT, R, true>;
  set_smem(kern, smem);
  kern<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_exp_smem(const Params& p, cudaStream_t stream) {
  // Chunks of 32 KiB: 8 taps of 16-byte (int16, 8-channel) rows, fewer for wider rows.
  if (p.NG == 1) launch_exp_smem_t<8, 4, 1, 8>(p, stream);
  else launch_exp_smem_t<4, 2, 2, 8>(p, stream);
}

template <int R>
void launch_exp_l2_t(Params p, cudaStream_t stream) {
  p.NGB = std::min(p.NG, kMaxNGB);
  const int Mb = (kThreads / p.NGB) * R;
  choose_stage(p, Mb, 64 << 10);
  const size_t smem = round_up((int64_t)Mb * 8, 16) + p.stage_bytes + rowinfo_bytes(p, Mb);
  auto kern = expanded_kernel<8, 8, 0, R, false>;
  set_smem(kern, smem);
  kern<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_exp_l2(const Params& p, cudaStream_t stream) {
  const int ngb = std::min(p.NG, kMaxNGB);
  auto blocks = [&](int r) {
    const int64_t mb = (int64_t)(kThreads / ngb) * r;
    return (p.M + mb - 1) / mb * p.G * ((p.NG + ngb - 1) / ngb);
  };
  // Fewer rows per thread when more would leave SMs idle.
  const int64_t want = 2 * sm_count();
  if (blocks(4) >= want) launch_exp_l2_t<4>(p, stream);
  else if (blocks(2) >= want) launch_exp_l2_t<2>(p, stream);
  else launch_exp_l2_t<1>(p, stream);
}

// Runs one concrete algorithm (prep included).
void run_algo(Algo algo, Params p, const at::Tensor& lut, const ConvGeo& cg, cudaStream_t stream) {
  Workspace ws;
  ws.p = p;
  const bool table = algo != Algo::Direct;
  prepare(ws, lut, cg, table, stream);
  if (algo == Algo::Direct) {
    launch_direct(ws.p, stream);
    return;
  }
  launch_build(ws.p, stream);
  if (algo == Algo::ExpandedResident) launch_exp_resident(ws.p, stream);
  else if (algo == Algo::ExpandedSmem) launch_exp_smem(ws.p, stream);
  else launch_exp_l2(ws.p, stream);
}

int64_t table_bytes(const Params& p) { return (int64_t)p.G * p.Kpad * 256 * p.NG * 8 * 4; }

// Resolves "expanded" and rejects variants that cannot run this shape.
Algo concrete(Algo algo, const Params& p, const char* op) {
  if (algo == Algo::Expanded)
    algo = resident_applies(p) ? Algo::ExpandedResident
                               : smem_applies(p) ? Algo::ExpandedSmem : Algo::ExpandedL2;
  if (algo == Algo::ExpandedResident)
    TORCH_CHECK(resident_applies(p), op, ": algo 'expanded_resident' needs at most 8 output "
                "channels per group and a table that fits shared memory; use 'expanded' or 'auto'");
  if (algo == Algo::ExpandedSmem)
    TORCH_CHECK(smem_applies(p), op, ": algo 'expanded_smem' needs at most 16 output channels per "
                "group (got ", I(p.N), "); use 'expanded_l2' or 'auto'");
  if (algo != Algo::Direct)
    TORCH_CHECK(table_bytes(p) <= kTableBudget, op, ": the expanded table would take ",
                I(table_bytes(p) >> 20), " MiB (budget ", I(kTableBudget >> 20),
                " MiB); use algo='direct'");
  return algo;
}

using ShapeKey = std::array<long long, 16>;

ShapeKey shape_key(const char* op, const Params& p, const at::Tensor& a) {
  return ShapeKey{op[4] == 'c', (long long)a.device().index(), (long long)p.xmask, p.M, p.K, p.N,
                  p.G, p.C, p.H, p.W, p.Wo, p.HoWo, p.sh, p.sw, p.ph, p.pw};
}

std::mutex g_auto_mu;
std::map<ShapeKey, Algo> g_auto_cache;

void run(Algo algo, Params p, const at::Tensor& a, const at::Tensor& lut, const ConvGeo& cg,
         const char* op) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (algo != Algo::Auto) {
    run_algo(concrete(algo, p, op), p, lut, cg, stream);
    return;
  }
  std::vector<Algo> cands{Algo::Direct};
  if (table_bytes(p) <= kTableBudget) {
    if (resident_applies(p)) cands.push_back(Algo::ExpandedResident);
    if (smem_applies(p)) cands.push_back(Algo::ExpandedSmem);
    cands.push_back(Algo::ExpandedL2);
  }
  const ShapeKey key = shape_key(op, p, a);
  {
    std::lock_guard<std::mutex> lock(g_auto_mu);
    auto it = g_auto_cache.find(key);
    if (it != g_auto_cache.end()) {
      run_algo(it->second, p, lut, cg, stream);
      return;
    }
  }
  if (cands.size() == 1 || c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    // No timing inside a graph capture: the table pays off once rows outnumber codes by far.
    const Algo h = (cands.size() > 1 && p.M >= 4096) ? cands[1] : Algo::Direct;
    run_algo(h, p, lut, cg, stream);
    return;
  }
  // Timed trial: each candidate once to warm up (and to write the output), then the best of
  // kTrialRuns timed runs (host clock around a synchronised run: launch costs count too, as they
  // do for the caller). One timed run was noisy enough to pick a variant ~2-10 % slower.
  constexpr int kTrialRuns = 3;
  Algo best = cands[0];
  double best_s = 1e30;
  for (Algo c : cands) {
    run_algo(c, p, lut, cg, stream);
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int r = 0; r < kTrialRuns; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      run_algo(c, p, lut, cg, stream);
      C10_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (dt < best_s) {
        best_s = dt;
        best = c;
      }
    }
  }
  std::lock_guard<std::mutex> lock(g_auto_mu);
  g_auto_cache[key] = best;
}

Params base_params(const at::Tensor& a, const at::Tensor& w, at::Tensor& out) {
  Params p{};
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.w = w.data_ptr<int8_t>();
  p.out = out.data_ptr<int32_t>();
  p.xmask = a.scalar_type() == at::kChar ? 0x80u : 0u;
  return p;
}

at::Tensor lut_linear_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                           c10::string_view algo_name) {
  check_common("lut_linear", a, w, lut);
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2, "lut_linear: expected a [M, K] and w [N, K], got a ",
              D(a.sizes()), ", w ", D(w.sizes()));
  TORCH_CHECK(a.size(1) == w.size(1), "lut_linear: a has K=", I(a.size(1)),
              " columns but w has K=", I(w.size(1)));
  const Algo algo = parse_algo(algo_name, "lut_linear");
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK(K < (1ll << 30) && N < (1ll << 30), "lut_linear: K and N must be below 2^30");
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kInt));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  Params p = base_params(a, w, out);
  p.M = M;
  p.HoWo = 1;
  p.K = static_cast<int>(K);
  p.N = p.Ntot = static_cast<int>(N);
  p.G = 1;
  p.NG = static_cast<int>((N + 7) / 8);
  p.Kpad = static_cast<int>(round_up(K, kKAlign));
  p.conv = 0;
  p.vec = (K % 8 == 0) && (reinterpret_cast<uintptr_t>(p.a) % 8 == 0);
  run(algo, p, a, lut, ConvGeo{}, "lut_linear");
  return out;
}

std::pair<int64_t, int64_t> pair_arg(c10::IntArrayRef v, const char* name) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, "lut_conv2d: ", name,
              " must have 1 or 2 values, got ", D(v));
  return {v[0], v[v.size() - 1]};
}

at::Tensor lut_conv2d_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                           c10::IntArrayRef stride, c10::IntArrayRef padding,
                           c10::IntArrayRef dilation, int64_t groups, c10::string_view algo_name) {
  check_common("lut_conv2d", a, w, lut);
  TORCH_CHECK(a.dim() == 4 && w.dim() == 4,
              "lut_conv2d: expected a [B, C, H, W] and w [N, C/groups, kh, kw], got a ",
              D(a.sizes()), ", w ", D(w.sizes()));
  const auto [sh, sw] = pair_arg(stride, "stride");
  const auto [ph, pw] = pair_arg(padding, "padding");
  const auto [dh, dw] = pair_arg(dilation, "dilation");
  TORCH_CHECK(sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && ph >= 0 && pw >= 0,
              "lut_conv2d: need stride >= 1, dilation >= 1, padding >= 0, got stride ", D(stride),
              ", padding ", D(padding), ", dilation ", D(dilation));
  const int64_t B = a.size(0), C = a.size(1), H = a.size(2), W = a.size(3);
  const int64_t N = w.size(0), kh = w.size(2), kw = w.size(3);
  TORCH_CHECK(groups >= 1 && C % groups == 0 && N % groups == 0, "lut_conv2d: groups=", I(groups),
              " must divide input channels (", I(C), ") and output channels (", I(N), ")");
  TORCH_CHECK(w.size(1) * groups == C, "lut_conv2d: w expects ", I(w.size(1) * groups),
              " input channels (", I(w.size(1)), " per group x ", I(groups), " groups), a has ",
              I(C));
  const int64_t Ho = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  const int64_t Wo = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  TORCH_CHECK(Ho >= 1 && Wo >= 1, "lut_conv2d: output would be empty (", I(Ho), "x", I(Wo),
              ") for input ", D(a.sizes().slice(2)), ", kernel ", D(w.sizes().slice(2)));
  const int64_t Cg = C / groups, K = Cg * kh * kw;
  TORCH_CHECK(Cg * H * W < (1ll << 31) && K < (1ll << 30) && H + ph < (1 << 15) &&
                  W + pw < (1 << 15) && Ho * sh < (1 << 15) && Wo * sw < (1 << 15) &&
                  dh * (kh - 1) < (1 << 15) && dw * (kw - 1) < (1 << 15),
              "lut_conv2d: input too large for the CUDA kernel (one group's image must stay "
              "below 2^31 codes, its height, width, padding and dilated kernel below 32768)");
  TORCH_CHECK(groups <= 65535, "lut_conv2d: at most 65535 groups on CUDA, got ", I(groups));
  const c10::cuda::CUDAGuard guard(a.device());
  const Algo algo = parse_algo(algo_name, "lut_conv2d");
  at::Tensor out = at::empty({B, N, Ho, Wo}, a.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  if (K == 0) return out.zero_();
  Params p = base_params(a, w, out);
  p.M = B * Ho * Wo;
  p.HoWo = Ho * Wo;
  p.K = static_cast<int>(K);
  p.G = static_cast<int>(groups);
  p.N = static_cast<int>(N / groups);
  p.Ntot = static_cast<int>(N);
  p.NG = (p.N + 7) / 8;
  p.Kpad = static_cast<int>(round_up(K, kKAlign));
  p.conv = 1;
  p.vec = 0;
  p.C = static_cast<int>(C);
  p.H = static_cast<int>(H);
  p.W = static_cast<int>(W);
  p.Cg = static_cast<int>(Cg);
  p.Wo = static_cast<int>(Wo);
  p.sh = static_cast<int>(sh);
  p.sw = static_cast<int>(sw);
  p.ph = static_cast<int>(ph);
  p.pw = static_cast<int>(pw);
  p.fHoWo = make_fastdiv(static_cast<unsigned>(Ho * Wo));
  p.fWo = make_fastdiv(static_cast<unsigned>(Wo));
  ConvGeo cg;
  cg.kh = static_cast<int>(kh);
  cg.kw = static_cast<int>(kw);
  cg.dh = static_cast<int>(dh);
  cg.dw = static_cast<int>(dw);
  run(algo, p, a, lut, cg, "lut_conv2d");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CUDA, m) {
  m.impl("lut_linear", &lut_linear_cuda);
  m.impl("lut_conv2d", &lut_conv2d_cuda);
}
