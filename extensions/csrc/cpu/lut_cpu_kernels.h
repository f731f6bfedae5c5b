// Hot loops of lut_cpu.cpp, compiled once per instruction set: lut_cpu.cpp includes this file
// three times inside `#pragma GCC target` regions, with AR_NS naming the namespace and AR_ISA
// selecting the vector width (512: AVX-512, 256: AVX2, 0: baseline x86-64 / SSE2).
// Everything defined here (templates and lambdas included) inherits the region's target, so no
// -march flag is needed and the right variant is chosen at run time.
//
// Needs, from the includer: struct Problem, AR_INLINE, <immintrin.h>, <ATen/Parallel.h>.

namespace AR_NS {

// ---- vector primitives: L int32 lanes; adds wrap (two's complement), like an int32 accumulator.
#if AR_ISA == 512
constexpr int L = 16;
using V = __m512i;
AR_INLINE V vzero() { return _mm512_setzero_si512(); }
AR_INLINE V vadd(V a, V b) { return _mm512_add_epi32(a, b); }
AR_INLINE V vload(const int32_t* p) { return _mm512_loadu_si512(p); }
AR_INLINE void vstore(int32_t* p, V v) { _mm512_storeu_si512(p, v); }
AR_INLINE V vload(const int16_t* p) {
  return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// row[idx[i]] for L lanes, negated where neg[i] is all ones.
AR_INLINE V vgather(const int32_t* row, const int32_t* idx) {
  return _mm512_i32gather_epi32(_mm512_loadu_si512(idx), row, 4);
}
AR_INLINE V vfold(V v, const uint32_t* neg, const uint32_t* keep) {
  const V s = _mm512_loadu_si512(neg);
  return _mm512_and_si512(_mm512_sub_epi32(_mm512_xor_si512(v, s), s), _mm512_loadu_si512(keep));
}
#elif AR_ISA == 256
constexpr int L = 8;
using V = __m256i;
AR_INLINE V vzero() { return _mm256_setzero_si256(); }
AR_INLINE V vadd(V a, V b) { return _mm256_add_epi32(a, b); }
AR_INLINE V vload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
AR_INLINE void vstore(int32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
AR_INLINE V vload(const int16_t* p) {
  return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AR_INLINE V vgather(const int32_t* row, const int32_t* idx) {
  return _mm256_i32gather_epi32(row, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)), 4);
}
AR_INLINE V vfold(V v, const uint32_t* neg, const uint32_t* keep) {
  const V s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(neg));
  return _mm256_and_si256(_mm256_sub_epi32(_mm256_xor_si256(v, s), s),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keep)));
}
#else
constexpr int L = 4;
typedef uint32_t V __attribute__((vector_size(16)));
typedef int32_t VI __attribute__((vector_size(16)));
typedef int16_t VH __attribute__((vector_size(8)));
AR_INLINE V vzero() { return V{}; }
AR_INLINE V vadd(V a, V b) { return a + b; }
AR_INLINE V vload(const int32_t* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
AR_INLINE void vstore(int32_t* p, V v) { std::memcpy(p, &v, sizeof v); }
AR_INLINE V vload(const int16_t* p) {
  VH h;
  std::memcpy(&h, p, sizeof h);
  return (V)__builtin_convertvector(h, VI);
}
AR_INLINE V vgather(const int32_t* row, const int32_t* idx) {
  return V{(uint32_t)row[idx[0]], (uint32_t)row[idx[1]], (uint32_t)row[idx[2]], (uint32_t)row[idx[3]]};
}
AR_INLINE V vfold(V v, const uint32_t* neg, const uint32_t* keep) {
  V s, m;
  std::memcpy(&s, neg, sizeof s);
  std::memcpy(&m, keep, sizeof m);
  return ((v ^ s) - s) & m;
}
#endif

// ---- row blocks --------------------------------------------------------------------------------
// Rows are ordered (g, b, pixel) so a block of consecutive rows shares one group's table. The
// block's row base pointers and output pointers are computed once per block.
struct Block {
  int64_t g = 0;
  int nr = 0;  // valid rows; the pointer arrays are padded to a multiple of kRowPad with the last
};
constexpr int kRowPad = 8;

AR_INLINE Block next_block(const Problem& p, int64_t r, int64_t r1, int64_t RB, const uint8_t** base,
                           int32_t** outp) {
  const int64_t P = p.Ho * p.Wo, BP = p.B * P;
  Block blk;
  blk.g = r / BP;
  const int64_t seg_end = std::min(r1, (blk.g + 1) * BP);
  blk.nr = (int)std::min(RB, seg_end - r);
  int64_t rem = r % BP, b = rem / P, pix = rem % P, oh = pix / p.Wo, ow = pix % p.Wo;
  for (int i = 0; i < blk.nr; ++i) {
    base[i] = p.act + b * p.a_img + blk.g * p.a_grp + oh * p.a_oh + ow * p.a_ow;
    outp[i] = p.out + b * p.o_img + blk.g * p.o_grp + (oh * p.Wo + ow) * p.o_pix;
    if (++ow == p.Wo) { ow = 0; if (++oh == p.Ho) { oh = 0; ++b; } }
  }
  const int padded = (blk.nr + kRowPad - 1) / kRowPad * kRowPad;
  for (int i = blk.nr; i < padded; ++i) base[i] = base[blk.nr - 1];
  return blk;
}

// Copies accumulators acc[i][0..Ng) of the block's rows to their outputs.
AR_INLINE void scatter(const Problem& p, const int32_t* acc, int nr, int32_t* const* outp) {
  for (int i = 0; i < nr; ++i) {
    const int32_t* a = acc + (int64_t)i * p.Np;
    if (p.o_ch == 1) {
      std::memcpy(outp[i], a, p.Ng * sizeof(int32_t));
    } else {
      for (int64_t n = 0; n < p.Ng; ++n) outp[i][n * p.o_ch] = a[n];
    }
  }
}

// ---- expanded algorithm ------------------------------------------------------------------------
// R rows x NT channels over taps [k0, k1): accumulators live in registers for the whole k range,
// and are loaded from / stored to the block's L1/L2-resident accumulator buffer around it.
template <typename TT, int NT, int R>
AR_INLINE void exp_tile(const TT* __restrict Tg, const Problem& p, int64_t k0, int64_t k1,
                        const uint8_t* const* base, int32_t* acc, bool first) {
  constexpr int NV = NT / L;
  const int64_t Np = p.Np, slab = 256 * Np;
  V v[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) v[r][j] = first ? vzero() : vload(acc + r * Np + j * L);
  const uint8_t* b[R];
  for (int r = 0; r < R; ++r) b[r] = base[r];
  const int32_t* __restrict off = p.off;
  const TT* tk = Tg + k0 * slab;
  for (int64_t k = k0; k < k1; ++k, tk += slab) {
    const int32_t o = off[k];
    for (int r = 0; r < R; ++r) {
      const TT* row = tk + (int64_t)b[r][o] * Np;  // table rows are indexed by the raw code byte
      for (int j = 0; j < NV; ++j) v[r][j] = vadd(v[r][j], vload(row + j * L));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) vstore(acc + r * Np + j * L, v[r][j]);
}

// Rows per register tile, so that R * NT / L accumulator vectors fit the register file.
template <int NT> constexpr int rows_for() {
  static_assert(NT % L == 0, "channel tile narrower than a vector");
  constexpr int vecs = NT / L;
  return vecs >= 8 ? 1 : vecs >= 4 ? 2 : vecs >= 2 ? 4 : 8;
}

template <typename TT, int NT>
AR_INLINE void exp_tile_rows(const TT* Tg, const Problem& p, int64_t k0, int64_t k1,
                             const uint8_t* const* base, int32_t* acc, int nr, int64_t n0, bool first) {
  constexpr int R = rows_for<NT>();
  for (int r = 0; r < nr; r += R)
    exp_tile<TT, NT, R>(Tg + n0, p, k0, k1, base + r, acc + (int64_t)r * p.Np + n0, first);
}

// Rows [r0, r1) of the expanded algorithm. T: [G][K][256][Np]. Rows go in blocks of RB whose
// accumulators stay in cache while taps go in chunks whose table slice (KC * 256 * Np entries)
// stays in L2, so a large table (fc1: 16 MB) is streamed from L3 once per block, not per row.
template <typename TT>
void exp_rows(const TT* T, const Problem& p, int64_t r0, int64_t r1) {
  const int64_t Np = p.Np;
  const int64_t RB = std::clamp<int64_t>((256 << 10) / (Np * 4), 64, 1024) / kRowPad * kRowPad;
  const int64_t KC = std::max<int64_t>(1, (256 << 10) / (256 * Np * (int64_t)sizeof(TT)));
  std::vector<int32_t> acc((RB + kRowPad) * Np);
  std::vector<const uint8_t*> base(RB + kRowPad);
  std::vector<int32_t*> outp(RB + kRowPad);
  const int64_t tsz = p.K * 256 * Np;
  for (int64_t r = r0; r < r1;) {
    const Block blk = next_block(p, r, r1, RB, base.data(), outp.data());
    const TT* Tg = T + blk.g * tsz;
    for (int64_t k0 = 0; k0 < p.K; k0 += KC) {
      const int64_t k1 = std::min(p.K, k0 + KC);
      int64_t n0 = 0;
      for (; n0 + 64 <= Np; n0 += 64)
        exp_tile_rows<TT, 64>(Tg, p, k0, k1, base.data(), acc.data(), blk.nr, n0, k0 == 0);
      if (n0 + 32 <= Np) {
        exp_tile_rows<TT, 32>(Tg, p, k0, k1, base.data(), acc.data(), blk.nr, n0, k0 == 0);
        n0 += 32;
      }
      if (n0 + 16 <= Np) {
        exp_tile_rows<TT, 16>(Tg, p, k0, k1, base.data(), acc.data(), blk.nr, n0, k0 == 0);
        n0 += 16;
      }
      if (n0 < Np) {  // Np is a multiple of 8
#if AR_ISA == 512
        isa256::exp_tile_rows<TT, 8>(Tg, p, k0, k1, base.data(), acc.data(), blk.nr, n0, k0 == 0);
#else
        exp_tile_rows<TT, 8>(Tg, p, k0, k1, base.data(), acc.data(), blk.nr, n0, k0 == 0);
#endif
      }
    }
    scatter(p, acc.data(), blk.nr, outp.data());
    r += blk.nr;
  }
}

// ---- direct algorithm --------------------------------------------------------------------------
// One LUT lookup per MAC: for tap k and row r, the LUT row of the row's activation code is read
// at the precomputed weight columns col[k][n], sign-applied for unsigned multipliers. Plain scalar
// loads: hardware gathers measured 2x slower here (microcode-assisted on current Intel parts), so
// the vector variants call the baseline one.
template <bool UNS, int NT, int R>
AR_INLINE void direct_tile(const int32_t* __restrict lut, const int32_t* __restrict col,
                           const uint32_t* __restrict neg, const uint32_t* __restrict keep,
                           const Problem& p,
                           const uint8_t* const* base, int32_t* acc) {
  const int64_t Np = p.Np;
  uint32_t v[R][NT] = {};
  const uint8_t x = p.xmask;
  for (int64_t k = 0; k < p.K; ++k) {
    const int32_t o = p.off[k];
    const int32_t* ck = col + k * Np;
    const uint32_t* nk = neg + k * Np;
    const uint32_t* mk = keep + k * Np;
    const int32_t* row[R];
    for (int r = 0; r < R; ++r) row[r] = lut + (int64_t)(uint8_t)(base[r][o] ^ x) * 256;
    for (int n = 0; n < NT; ++n) {
      const int32_t c = ck[n];
      const uint32_t s = nk[n], m = mk[n];
      for (int r = 0; r < R; ++r) {
        uint32_t t = (uint32_t)row[r][c];
        if constexpr (UNS) t = ((t ^ s) - s) & m;  // negate for w < 0, zero for w == 0
        v[r][n] += t;
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(acc + r * Np, v[r], sizeof v[r]);
}

template <bool UNS>
void direct_rows_t(const int32_t* lut, const int32_t* col, const uint32_t* neg,
                   const uint32_t* keep, const Problem& p, int64_t r0, int64_t r1) {
  constexpr int R = 4, NT = 8;
  const int64_t Np = p.Np, RB = 64;
  std::vector<int32_t> acc((RB + kRowPad) * Np);
  std::vector<const uint8_t*> base(RB + kRowPad);
  std::vector<int32_t*> outp(RB + kRowPad);
  const int64_t csz = p.K * Np;
  for (int64_t r = r0; r < r1;) {
    const Block blk = next_block(p, r, r1, RB, base.data(), outp.data());
    const int32_t* cg = col + blk.g * csz;
    const uint32_t* ng = neg + blk.g * csz;
    const uint32_t* mg = keep + blk.g * csz;
    for (int i = 0; i < blk.nr; i += R)
      for (int64_t n0 = 0; n0 < Np; n0 += NT)
        direct_tile<UNS, NT, R>(lut, cg + n0, ng + n0, mg + n0, p, base.data() + i,
                                acc.data() + i * Np + n0);
    scatter(p, acc.data(), blk.nr, outp.data());
    r += blk.nr;
  }
}

void direct_rows(const int32_t* lut, const int32_t* col, const uint32_t* neg, const uint32_t* keep,
                 const Problem& p, int64_t r0, int64_t r1) {
#if AR_ISA == 0
  if (p.is_unsigned) direct_rows_t<true>(lut, col, neg, keep, p, r0, r1);
  else direct_rows_t<false>(lut, col, neg, keep, p, r0, r1);
#else
  isabase::direct_rows(lut, col, neg, keep, p, r0, r1);
#endif
}

void exp16_rows(const int16_t* T, const Problem& p, int64_t r0, int64_t r1) { exp_rows(T, p, r0, r1); }
void exp32_rows(const int32_t* T, const Problem& p, int64_t r0, int64_t r1) { exp_rows(T, p, r0, r1); }

// Table build: T[gk][b][n] = product(code whose byte is b, weight n of tap gk), zero in the
// padded channels. Indexing by the raw byte (not the LUT row, which is b ^ 0x80 for int8 codes)
// saves the hot loop one operation per lookup.
template <typename TT>
void build_rows(TT* T, const int32_t* lut, const int32_t* col, const uint32_t* neg,
                const uint32_t* keep, const Problem& p, int64_t gk0, int64_t gk1) {
  const int64_t Np = p.Np;
  for (int64_t gk = gk0; gk < gk1; ++gk) {
    const int32_t* c = col + gk * Np;
    const uint32_t* s = neg + gk * Np;
    const uint32_t* m = keep + gk * Np;
    TT* dst = T + gk * 256 * Np;
    for (int a = 0; a < 256; ++a) {
      const int32_t* row = lut + (a ^ p.xmask) * 256;
      TT* d = dst + a * Np;
      int64_t n = 0;
      for (; n + L <= Np; n += L) {
        int32_t tmp[L];
        vstore(tmp, vfold(vgather(row, c + n), s + n, m + n));
        for (int i = 0; i < L; ++i) d[n + i] = (TT)tmp[i];
      }
      for (; n < Np; ++n) d[n] = (TT)(int32_t)((((uint32_t)row[c[n]] ^ s[n]) - s[n]) & m[n]);
      for (n = p.Ng; n < Np; ++n) d[n] = 0;
    }
  }
}
void build16(int16_t* T, const int32_t* lut, const int32_t* col, const uint32_t* neg,
             const uint32_t* keep, const Problem& p, int64_t gk0, int64_t gk1) {
  build_rows(T, lut, col, neg, keep, p, gk0, gk1);
}
void build32(int32_t* T, const int32_t* lut, const int32_t* col, const uint32_t* neg,
             const uint32_t* keep, const Problem& p, int64_t gk0, int64_t gk1) {
  build_rows(T, lut, col, neg, keep, p, gk0, gk1);
}

}  // namespace AR_NS
