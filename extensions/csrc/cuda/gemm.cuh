// Device code both expanded_gemm tile families share (gemm.cu: 128 R rows x 32 channels;
// gemm_tall.cu: 2048 rows x 16 channels): where a row's codes are, the stores, a conv's end in place
// of them (gemm.cu's tile and the int32 path), a K split's stages, the int32 path; and the tall tile's launcher.
#pragma once
#include "launch.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"

namespace approx_cuda {

constexpr int kGemmThreads = 512;  // both tiles' builds assume 16 warps
constexpr int kGemmRawRow = 512 + 16;  // CO staging: an Et16 row and one bank group

// A conv whose kernel is larger than 1x1 (one group: K = C * kh * kw is C only at 1x1).
inline bool gemm_kx(const Params& p) { return p.conv && p.K != p.C; }

// Where a row's codes are. linear: base = m * K. 1x1 conv: base = the input pixel of image b
// (channel 0), or -1 in the padding (every tap reads code 0). KxK conv: base = where tap (0, 0, 0)
// would be, iyx its input pixel (row: low 16 bits, column: high 16, signed; one register for
// R = 8's budget); both may lie in the padding, tested per tap.
struct GemmRow {
  long long base;
  int iyx;
};

template <bool KX>
__device__ __forceinline__ GemmRow gemm_row(const Params& p, long long m) {
  if (!p.conv) return GemmRow{m * p.K, 0};
  const long long b = m / p.HoWo;
  const int pix = static_cast<int>(m - b * p.HoWo);
  const int oy = pix / p.Wo, ox = pix - oy * p.Wo;
  const int iy = oy * p.sh - p.ph, ix = ox * p.sw - p.pw;
  const long long base = b * p.C * (long long)p.H * p.W + (long long)iy * p.W + ix;
  // conv_params keeps iy and ix inside (-2^15, 2^15)
  if (KX) return GemmRow{base, static_cast<int>((static_cast<unsigned>(iy) & 0xFFFFu) |
                                                (static_cast<unsigned>(ix) << 16))};
  const bool pad = iy < 0 || iy >= p.H || ix < 0 || ix >= p.W;
  return GemmRow{pad ? -1 : base, 0};
}

// Codes of taps k0..k0+3 of a row, as LUT rows (one per byte); conv taps in the padding read
// code 0, which goes through the LUT (the xmask) like any other code, as in every other kernel.
// KX: tap k's {input offset, dy, dx, valid} comes from the tap table (tables.cu: Kpad >= k0 + 4
// entries), the same address for every thread (one broadcast load), loaded where it is used:
// holding the 4 taps' entries at once, or loading them tap-major for a thread's 2 rows, spilled
// R = 8 at 128 registers. Taps past K read code 0, except KX, where their entries {0, 0, 0, 0}
// read tap (0, 0, 0)'s code where that lies inside the image: any code serves, their table
// slices being all zero, and one test fewer a tap is one register fewer.
template <bool KX>
__device__ __forceinline__ uint32_t gemm_codes(const Params& p, const GemmRow& r, int k0) {
  const uint32_t xm = 0x01010101u * p.xmask;
  if (!p.conv) return static_cast<uint32_t>(load_codes<4>(p, p.a + r.base, k0));
  uint32_t w = 0;
  if constexpr (KX) {
    const int iy0 = static_cast<int>(static_cast<short>(r.iyx & 0xFFFF)), ix0 = r.iyx >> 16;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int4 kc = __ldg(p.kinfo + k0 + c);
      const int iy = iy0 + kc.y, ix = ix0 + kc.z;
      if ((unsigned)iy < (unsigned)p.H && (unsigned)ix < (unsigned)p.W)
        w |= (uint32_t)__ldg(p.a + r.base + kc.x) << (8 * c);
    }
  } else if (r.base >= 0) {
    const long long hw = (long long)p.H * p.W;
    const uint8_t* src = p.a + r.base + k0 * hw;
#pragma unroll
    for (int c = 0; c < 4; ++c, src += hw)
      if (k0 + c < p.K) w |= (uint32_t)__ldg(src) << (8 * c);
  }
  return w ^ xm;
}

// Writes channels nb..nb+NC-1 (< N) of row m; add: atomically into the zeroed output (a K split's share).
template <int NC>
__device__ __forceinline__ void gemm_store(const Params& p, long long m, int nb, const uint32_t (&v)[NC],
                                           bool add) {
  if (nb >= p.N) return;
  if constexpr (NC == 8) {
    if (!p.conv && !add) {
      store8(p.out + m * p.N + nb, nb, p.N, (p.N & 3) == 0, v);
      return;
    }
  } else if constexpr (NC == 4) {
    if (!p.conv && !add && (p.N & 3) == 0 && nb + 4 <= p.N) {  // nb % 4 == 0: 16-byte aligned
      *reinterpret_cast<int4*>(p.out + m * p.N + nb) = make_int4(v[0], v[1], v[2], v[3]);
      return;
    }
  }
  int32_t* o;
  long long step = 1;
  if (p.conv) {
    const long long b = m / p.HoWo, pix = m - b * p.HoWo;
    o = p.out + (b * p.Ntot + nb) * p.HoWo + pix;
    step = p.HoWo;
  } else {
    o = p.out + m * p.N + nb;
  }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    if (nb + c >= p.N) continue;
    if (add) atomicAdd(o + c * step, static_cast<int32_t>(v[c]));
    else o[c * step] = static_cast<int32_t>(v[c]);
  }
}

// The int32 path's end: channels nb..nb+NC-1 (< N) of row m, one value a store.
template <int NC>
__device__ __forceinline__ void gemm_end(const Params& p, long long m, int nb, const uint32_t (&v)[NC]) {
  const Epi& e = p.epi;
  const long long b = m / p.HoWo, at0 = (b * p.Ntot + nb) * p.HoWo + (m - b * p.HoWo);
  const CodesOut co{e.codes_scale, e.cqmin, e.cqmax};
  const float a = e.kind == 1 ? *e.act_scale : 0.f, inv = e.kind == 1 ? co.inv() : 0.f;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = nb + c;
    if (n >= p.N) break;
    if (e.kind == 1) end_one<1>(e, at0 + c * p.HoWo, v[c], __fmul_rn(a, e.wscale[n]), e.bias[n], co, inv, 0, 0, 0);
    else end_one<2>(e, at0 + c * p.HoWo, v[c], 0.f, 0.f, co, inv, e.qbias[n], e.mult[n], e.shift[n]);
  }
}

// The int16 tile's end (gemm.cu) goes through shared memory, free after its stage loop's last barrier, so that its
// stores run along output pixels as the quant kernels' do, and the sums' registers are free before it runs (inline
// in the row stores, R = 8 tiles spilled in their stage loops). end_put: a thread's NC channels c0.. of tile row r
// into [channels][BM + 8 / NC] int32, channel-major, the pad putting a warp's 8 quads x 4 lanes on 32 banks.
template <int BM, int NC>
constexpr int end_stride() { return BM + 8 / NC; }

template <int BM, int NC>
__device__ __forceinline__ void end_put(uint8_t* smem, int r, int c0, const uint32_t (&v)[NC]) {
  int32_t* tile = reinterpret_cast<int32_t*>(smem);
#pragma unroll
  for (int c = 0; c < NC; ++c) tile[(c0 + c) * end_stride<BM, NC>() + r] = static_cast<int32_t>(v[c]);
}

// Dequantize's end of a tile column (channel n, its sums col[0..rows)), a warp's lanes along the rows: Q rows a
// lane (4: a plane's rows come in aligned fours, 16-byte residual loads and output stores), U slots of them a batch.
// A batch's residual loads are issued before its stores: the compiler cannot know that the output and the residual
// do not alias, so with one load a row each would wait out the memory's latency in turn (measured: the end several
// times slower than the separate pass it replaces).
template <int Q, int U, class AtOf>
__device__ __forceinline__ void end_column(const Epi& e, const int32_t* col, int rows, int lane, float scale,
                                           float bias, const CodesOut& co, float inv, AtOf at_of) {
  const bool add = e.residual != nullptr;
  for (int r0 = Q * lane; r0 < rows; r0 += U * 32 * Q) {
    long long at[U];
    float rv[U][Q];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = r0 + 32 * Q * u;
      at[u] = at_of(r);
#pragma unroll
      for (int x = 0; x < Q; ++x) rv[u][x] = 0.f;
      if (add && r < rows) {
        if constexpr (Q == 4) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(e.residual + at[u]));
          rv[u][0] = v.x, rv[u][1] = v.y, rv[u][2] = v.z, rv[u][3] = v.w;
        } else {
          rv[u][0] = __ldg(e.residual + at[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = r0 + 32 * Q * u;
      if (r >= rows) break;
      float f[Q];
#pragma unroll
      for (int x = 0; x < Q; ++x) f[x] = dequant_one(col[r + x], scale, bias, add, rv[u][x], e.relu);
      if constexpr (Q == 4) {
        *reinterpret_cast<float4*>(e.outf + at[u]) = make_float4(f[0], f[1], f[2], f[3]);
        if (e.codes)
          *reinterpret_cast<uint32_t*>(e.codes + at[u]) =
              co.byte(f[0], inv) | co.byte(f[1], inv) << 8 | co.byte(f[2], inv) << 16 | co.byte(f[3], inv) << 24;
      } else {
        e.outf[at[u]] = f[0];
        if (e.codes) e.codes[at[u]] = static_cast<uint8_t>(co.byte(f[0], inv));
      }
    }
  }
}

// After every thread's end_put: warp w takes channels w, w + 16, ... of the tile (BN of them from n0), its lanes
// along the rows (consecutive pixels of a channel's plane: coalesced), the channel's constants loaded once. rows:
// the tile's rows from m0 (<= BM; the tall tile's tiles are of equal size, not BM).
template <int BM, int BN, int NC>
__device__ __forceinline__ void end_tile(const Params& p, const uint8_t* smem, long long m0, int n0, int rows) {
  __syncthreads();
  const int32_t* tile = reinterpret_cast<const int32_t*>(smem);
  const Epi& e = p.epi;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long b0 = m0 / p.HoWo;
  const unsigned pix0 = static_cast<unsigned>(m0 - b0 * p.HoWo);  // + a tile row: < 2^31 (conv_params' bounds)
  const CodesOut co{e.codes_scale, e.cqmin, e.cqmax};
  const float a = e.kind == 1 ? *e.act_scale : 0.f, inv = e.kind == 1 ? co.inv() : 0.f;
  // m0, HoWo % 4 == 0: rows 4i..4i+3 lie in one plane, their index a multiple of 4
  const bool four = e.vec && (p.HoWo & 3) == 0;
  for (int ch = warp; ch < BN && n0 + ch < p.N; ch += kGemmThreads / 32) {
    const int n = n0 + ch;
    const int32_t* col = tile + ch * end_stride<BM, NC>();
    auto at_of = [&](int r) {
      const unsigned off = pix0 + r, db = fdiv(off, p.fHoWo);
      return ((b0 + db) * p.Ntot + n) * p.HoWo + (off - db * static_cast<unsigned>(p.HoWo));
    };
    if (e.kind == 2) {
      const int32_t qb = e.qbias[n], mult = e.mult[n], shift = e.shift[n];
      for (int r = lane; r < rows; r += 32)
        e.codes[at_of(r)] = static_cast<uint8_t>(requant_code(col[r], qb, mult, shift, e.qmin, e.qmax));
    } else if (four) {
      end_column<4, 4>(e, col, rows, lane, __fmul_rn(a, e.wscale[n]), e.bias[n], co, inv, at_of);
    } else {
      end_column<1, 16>(e, col, rows, lane, __fmul_rn(a, e.wscale[n]), e.bias[n], co, inv, at_of);
    }
  }
}

// Copied codes (AC: a 1x1 conv at stride 1 without padding, planes of a multiple of 4 pixels, K a multiple of 4): a
// stage's codes by cp.async, 4 rows of one tap a copy (a plane's rows come in aligned fours), into plane-major bytes
// [4 taps][BM] that convert_codes turns into row words, not through registers. Copy u of thread t is idx = t + TH u:
// tap idx / (BM / 4), rows 4 (idx % (BM / 4)) + 0..3 (mend and M multiples of 4: all or none past the tile's end
// mend). Codes past it are left as they are: any byte is a code, and those rows are never stored. ON = false:
// nothing (the tile does not copy).
template <int BM, int TH, int LR, bool ON>
struct CodeCopies {
  const uint8_t* src[LR];
  bool val[LR];
  __device__ __forceinline__ CodeCopies(const Params& p, long long m0, long long mend, int t) {
#pragma unroll
    for (int u = 0; u < LR && ON; ++u) {
      const int idx = t + TH * u;
      const long long m = m0 + 4 * (idx % (BM / 4)), b = m / p.HoWo;
      val[u] = idx < BM && m < mend;
      src[u] = p.a + (val[u] ? (b * p.C + idx / (BM / 4)) * p.HoWo + (m - b * p.HoWo) : 0);
    }
  }
  // stage q's codes into bytes [4 taps][BM] at dst, one commit group
  __device__ __forceinline__ void issue(const Params& p, uint8_t* dst, int q, int t) const {
#pragma unroll
    for (int u = 0; u < LR; ++u)
      if (val[u]) cp_async4(dst + 4 * (t + TH * u), src[u] + q * 4LL * p.HoWo);
    cp_async_commit();
  }
};

// Rows 4t..4t+3's words (raw codes, byte c tap c) from their 4 taps' bytes [4 taps][BM] (a 4 x 4 byte transpose).
template <int BM>
__device__ __forceinline__ void convert_codes(const uint8_t* bytes, uint32_t* words, int t) {
  if (t >= BM / 4) return;
  const uint8_t* src = bytes + 4 * t;
  uint32_t w[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) w[c] = *reinterpret_cast<const uint32_t*>(src + c * BM);
  const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
  *reinterpret_cast<uint4*>(words + 4 * t) =
      make_uint4(__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632), __byte_perm(hi01, hi23, 0x5410),
                 __byte_perm(hi01, hi23, 0x7632));
}

// The copied codes' prologue of a block's stage loop: stage qa's codes copied into area qa & 1 and turned into row
// words, and stage qa + 1's copy issued. issue(q, area) and convert(area) are the tile's.
template <class Issue, class Convert>
__device__ __forceinline__ void first_copied_codes(int qa, int qb, Issue&& issue, Convert&& convert) {
  issue(qa, qa & 1);
  cp_async_wait<0>();
  __syncthreads();
  convert(qa & 1);
  if (qb - qa > 1) issue(qa + 1, (qa + 1) & 1);
}

// Whether a call takes the copied codes (AC above): tap k of row m is then a[b][k][pixel], 4-byte aligned runs.
inline bool gemm_copies_codes(const Params& p) {
  return p.conv && p.K == p.C && p.sh == 1 && p.sw == 1 && p.ph == 0 && p.pw == 0 &&
         (long long)p.H * p.W == p.HoWo && p.HoWo % 4 == 0 && p.K % 4 == 0 &&
         (reinterpret_cast<uintptr_t>(p.a) & 3) == 0;
}

// A block's stages [qa, qb) of the K / 4: all of them, or (SK) its K split's share, empty where the
// split outnumbers the stages.
template <bool SK>
__device__ __forceinline__ int2 gemm_stages(const Params& p) {
  const int nst = (p.K + 3) / 4;
  if (!SK) return make_int2(0, nst);
  const int per = (nst + gridDim.z - 1) / gridDim.z, qa = blockIdx.z * per;
  return make_int2(qa, min(nst, qa + per));
}

// The taps of a block's stages (4 a stage, those past K included: finish_row's offset-binary bias).
template <bool SK>
__device__ __forceinline__ uint32_t gemm_taps(const Params& p) {
  const int2 st = gemm_stages<SK>(p);
  return static_cast<uint32_t>(4 * (st.y - st.x));
}

// CO staging (r8c, r16c): lane rc's 4 16-byte pieces (rc + 8 u) of the Et16 row of the weight byte at
// rw + k (Et16 row of weight w: w + 128); zeros where k >= rklim (taps past K, channels past N).
__device__ __forceinline__ void et16_load(const Params& p, const uint8_t* rw, int k, int rklim, int rc,
                                          int4 (&L)[4]) {
#pragma unroll
  for (int u = 0; u < 4; ++u) L[u] = make_int4(0, 0, 0, 0);
  if (k < rklim) {
    // one byte offset (OR, not +: kept from being folded into 4 hoisted 64-bit pointers)
    const uint32_t off = ((__ldg(rw + k) ^ 128u) << 9) | (rc << 4);
    const char* src = reinterpret_cast<const char*>(p.Et16) + off;
#pragma unroll
    for (int u = 0; u < 4; ++u) L[u] = __ldg(reinterpret_cast<const int4*>(src + u * 128));
  }
}

__device__ __forceinline__ void et16_store(uint8_t* dst, const int4 (&L)[4]) {
#pragma unroll
  for (int u = 0; u < 4; ++u) *reinterpret_cast<int4*>(dst + u * 128) = L[u];
}

// The slot's pair words of codes 8 ab + 0..7 (dst[32 i], code 8 ab + i) from the 16-byte Et16 pieces ab of
// a channel pair: A the low channel's (made offset binary), B the high one's (signed).
__device__ __forceinline__ void put_pair_words(uint32_t* dst, const int4& A, const int4& B) {
  const uint32_t a4[4] = {(uint32_t)A.x ^ 0x80008000u, (uint32_t)A.y ^ 0x80008000u,
                          (uint32_t)A.z ^ 0x80008000u, (uint32_t)A.w ^ 0x80008000u};
  const uint32_t b4[4] = {(uint32_t)B.x, (uint32_t)B.y, (uint32_t)B.z, (uint32_t)B.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dst[(2 * i) * 32] = __byte_perm(a4[i], b4[i], 0x5410);      // code 8 ab + 2i
    dst[(2 * i + 1) * 32] = __byte_perm(a4[i], b4[i], 0x7632);  // code 8 ab + 2i + 1
  }
}

// int32 products: E32 straight from L1/L2, one lookup per MAC (correct, not fast; auto does not
// time it where the format is known to be int32).
// BN: the tile's channels (a lane's BN / 4).
// EPI: a conv's end in place of the sums (gemm_end), its own instantiation.
template <int R, bool KX, int BN = 32, bool EPI = false>
__device__ __forceinline__ void gemm32_body(const Params& p) {
  constexpr int BM = kGemmThreads / 4 * R, NC = BN / 4;
  const int t = threadIdx.x, g = t >> 2, j = t & 3;
  const long long m0 = (long long)blockIdx.x * BM;
  const int nb = blockIdx.y * BN + NC * j;
  // a K split's other blocks leave it all to the first, which stores into the zeroed output
  if (nb >= p.N || blockIdx.z != 0) return;
  for (int i = 0; i < R; ++i) {
    const long long m = m0 + g + 128 * i;
    if (m >= p.M) break;
    const GemmRow row = gemm_row<KX>(p, m);
    uint32_t v[NC] = {};
    for (int k0 = 0; k0 < p.K; k0 += 4) {
      const uint32_t cw = gemm_codes<KX>(p, row, k0);
      for (int kk = 0; kk < 4 && k0 + kk < p.K; ++kk) {
        const int32_t* er = p.E32 + ((cw >> (8 * kk)) & 255) * 256 + 128;
#pragma unroll
        for (int c = 0; c < NC; ++c)
          if (nb + c < p.N) v[c] += static_cast<uint32_t>(__ldg(er + __ldg(p.w + (long long)(nb + c) * p.K + k0 + kk)));
      }
    }
    if constexpr (EPI) gemm_end<NC>(p, m, nb, v);
    else gemm_store<NC>(p, m, nb, v, false);
  }
}

// The tall tile (gemm_tall.cu): its blocks for a call, its shared memory, and its launch (mode as
// gemm.cu's MODE: 0 format read on the device, 1 int16 products).
int64_t gemm_tall_blocks(const Params& p, int r);
size_t gemm_tall_smem(int r);
void launch_gemm_tall(const Params& p, int mode, int r, int ks, cudaStream_t stream);
int gemm_split(const Params& p, int64_t blocks, int min_stages);

}  // namespace approx_cuda
