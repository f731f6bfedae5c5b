// Device pieces the gathering kernels share: where a row's codes are (conv row info, staging),
// gathering a tile's codes, loading a row's codes, summing table rows, storing outputs.
//
// int16 tables are summed two channels per 32-bit word: the low channel is stored with its sign
// bit flipped (offset binary), so for words x_k = hi_k * 2^16 + (lo_k + 2^15):
//   sum(hi) = sum(x_k >> 16)   and   sum(lo) = sum(x_k) - 2^16 * sum(hi) - 2^15 * K  (mod 2^32)
// which is exact int32 arithmetic with two adds per word.
#pragma once
#include "common.cuh"

namespace approx_cuda {

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
        if (p.vec4) {
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

// Adds one table row (8 channels) to a row's accumulators: int16 rows as four offset-binary
// words (s: whole words, h: sign-extended high halves; see the top of this file), int32 rows
// as two int4. LDG: the row is in global memory (read through the read-only path).
template <typename TT, bool LDG = false>
__device__ __forceinline__ void add_row(const int4* e, uint32_t (&s)[4], uint32_t (&h)[4]) {
  if constexpr (sizeof(TT) == 2) {
    const int4 v = LDG ? __ldg(e) : *e;
    s[0] += (uint32_t)v.x; h[0] += (uint32_t)(v.x >> 16);
    s[1] += (uint32_t)v.y; h[1] += (uint32_t)(v.y >> 16);
    s[2] += (uint32_t)v.z; h[2] += (uint32_t)(v.z >> 16);
    s[3] += (uint32_t)v.w; h[3] += (uint32_t)(v.w >> 16);
  } else {
    const int4 v0 = LDG ? __ldg(e) : e[0], v1 = LDG ? __ldg(e + 1) : e[1];
    s[0] += (uint32_t)v0.x; s[1] += (uint32_t)v0.y; s[2] += (uint32_t)v0.z; s[3] += (uint32_t)v0.w;
    h[0] += (uint32_t)v1.x; h[1] += (uint32_t)v1.y; h[2] += (uint32_t)v1.z; h[3] += (uint32_t)v1.w;
  }
}

// The 2 W channel sums of one row (W words of s and h, 8 channels by default); `taps` = number of
// table rows summed (the int16 offsets).
template <typename TT, int W = 4>
__device__ __forceinline__ void finish_row(const uint32_t (&s)[W], const uint32_t (&h)[W],
                                           uint32_t taps, uint32_t (&v)[2 * W]) {
  if constexpr (sizeof(TT) == 2) {
    const uint32_t bias = 32768u * taps;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      v[2 * j] = s[j] - (h[j] << 16) - bias;
      v[2 * j + 1] = h[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) {
      v[j] = s[j];
      v[W + j] = h[j];
    }
  }
}

// Stores channels n0..n0+7 (those below nlim) of one output row; as two 16-byte stores when
// aligned (whole 32-byte sectors).
__device__ __forceinline__ void store8(int32_t* o, int n0, int nlim, bool vec,
                                       const uint32_t (&v)[8]) {
  if (vec && n0 + 8 <= nlim) {
    reinterpret_cast<int4*>(o)[0] = make_int4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<int4*>(o)[1] = make_int4(v[4], v[5], v[6], v[7]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (n0 + j < nlim) o[j] = static_cast<int32_t>(v[j]);
}

// Thread layout of the direct and expanded kernels: kThreads = rowsets x NGB threads; thread
// (rs, ng) sums R rows (rs + rowsets * i) of the block's Mb-row tile x the 8 channels of group
// ngz + ng (grid.z covers the 8-channel groups), of conv group grp = blockIdx.y.
struct RowSets {
  int NGB, rowsets, Mb, grp, ngz, ng, rs;
  long long m0;
  __device__ __forceinline__ RowSets(int ngb, int R)
      : NGB(ngb), rowsets(kThreads / ngb), Mb(rowsets * R), grp(blockIdx.y),
        ngz(blockIdx.z * ngb), ng(threadIdx.x % ngb), rs(threadIdx.x / ngb),
        m0((long long)blockIdx.x * Mb) {}
  __device__ __forceinline__ int local(int i) const { return rs + rowsets * i; }
};

// Stores a RowSets thread's R rows; values(i, v) gives row i's 8 channel sums.
template <int R, typename Values>
__device__ __forceinline__ void store_rows(const Params& p, const RowSets& b, Values&& values) {
  const TilePos tp = tile_pos(p, b.m0);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const long long m = b.m0 + b.local(i);
    if (m >= p.M) continue;
    uint32_t v[8];
    values(i, v);
    store_row(p, b.grp, m, (b.ngz + b.ng) * 8, v, tp, b.local(i));
  }
}

// Codes of taps [k0, k0 + KC) of one linear row (KC = 4 or 8), as LUT rows, one per byte: whole
// aligned words where the row allows, else 4-byte words (K % 4 == 0; each inside K or past it),
// else bytes; taps past K read 0.
template <int KC>
__device__ __forceinline__ uint64_t load_codes(const Params& p, const uint8_t* row, int k0) {
  uint64_t w = 0;
  if (p.vec) {  // K % 8 == 0, a 8-byte aligned: whole chunks, aligned
    w = load_word<KC>(row + k0);
  } else if (p.vec4) {
#pragma unroll
    for (int j = 0; j < KC / 4; ++j)
      if (k0 + 4 * j < p.K) w |= (uint64_t)load_word<4>(row + k0 + 4 * j) << (32 * j);
  } else {
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
      if (k0 + kk < p.K) w |= (uint64_t)__ldg(row + k0 + kk) << (8 * kk);
  }
  return w ^ (0x0101010101010101ull * p.xmask);
}

}  // namespace approx_cuda
