// Hot loops of lut_grad_cpu.cpp, compiled once per instruction set: lut_grad_cpu.cpp includes
// this file twice, inside a `#pragma GCC target("avx2,fma")` region (AR_ISA 256) and without one
// (AR_ISA 0, baseline x86-64), AR_NS naming the namespace. Everything defined here (lambdas
// included) inherits the region's target, so no -march flag is needed; the variant is picked at
// run time. Vectors are 8 float32 lanes in both variants (GCC generic vectors in the baseline one).
//
// Needs, from the includer: struct GradProblem, AR_INLINE, <immintrin.h>, <algorithm>, <cstring>,
// <vector>. The algorithms and the rule that picks them: see lut_grad_cpu.cpp.

namespace AR_NS {

// ---- vector primitives: 8 float lanes; VI: 8 int32 lanes ---------------------------------------
#if AR_ISA == 256
using V = __m256;
using VI = __m256i;
AR_INLINE V vzero() { return _mm256_setzero_ps(); }
AR_INLINE V vload(const float* p) { return _mm256_loadu_ps(p); }
AR_INLINE void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
AR_INLINE V vbcast(float x) { return _mm256_set1_ps(x); }
AR_INLINE V vadd(V a, V b) { return _mm256_add_ps(a, b); }
AR_INLINE V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
AR_INLINE V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
AR_INLINE VI viload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
AR_INLINE VI viadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
// base[idx[i]] for the 8 lanes
AR_INLINE V vgather(const float* base, VI idx) { return _mm256_i32gather_ps(base, idx, 4); }
// Lane j of the result = sum of the 8 lanes of v[j].
AR_INLINE V reduce8(const V* v) {
  const V t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const V t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [j0..3 lo | j0..3 hi], [j4..7 ..]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// out[i] = sum_{r < 256} H[r * hs + i] * slope[r * 256 + col[i]], in double, i < 8
AR_INLINE void finish8(const double* H, int64_t hs, const float* slope, const int32_t* col, double* out) {
  const VI c = viload(col);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (int r = 0; r < 256; ++r, H += hs) {
    const V s = vgather(slope + r * 256, c);
    a0 = _mm256_fmadd_pd(_mm256_loadu_pd(H), _mm256_cvtps_pd(_mm256_castps256_ps128(s)), a0);
    a1 = _mm256_fmadd_pd(_mm256_loadu_pd(H + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)), a1);
  }
  _mm256_storeu_pd(out, a0);
  _mm256_storeu_pd(out + 4, a1);
}
#else
typedef float V __attribute__((vector_size(32)));
typedef int32_t VI __attribute__((vector_size(32)));
AR_INLINE V vzero() { return V{}; }
AR_INLINE V vload(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
AR_INLINE void vstore(float* p, V v) { std::memcpy(p, &v, sizeof v); }
AR_INLINE V vbcast(float x) { return V{x, x, x, x, x, x, x, x}; }
AR_INLINE V vadd(V a, V b) { return a + b; }
AR_INLINE V vmul(V a, V b) { return a * b; }
AR_INLINE V vfma(V a, V b, V c) { return a * b + c; }
AR_INLINE VI viload(const int32_t* p) { VI v; std::memcpy(&v, p, sizeof v); return v; }
AR_INLINE VI viadd(VI a, VI b) { return a + b; }
AR_INLINE V vgather(const float* base, VI i) {
  return V{base[i[0]], base[i[1]], base[i[2]], base[i[3]], base[i[4]], base[i[5]], base[i[6]], base[i[7]]};
}
AR_INLINE V reduce8(const V* v) {
  V r;
  for (int j = 0; j < 8; ++j) {
    const V x = v[j];
    r[j] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  }
  return r;
}
AR_INLINE void finish8(const double* H, int64_t hs, const float* slope, const int32_t* col, double* out) {
  double a[8] = {};
  for (int r = 0; r < 256; ++r, H += hs) {
    const float* s = slope + r * 256;
    for (int i = 0; i < 8; ++i) a[i] += H[i] * (double)s[col[i]];
  }
  for (int i = 0; i < 8; ++i) out[i] = a[i];
}
#endif

// Stores the first n (<= 8) lanes of v.
AR_INLINE void vstore_n(float* p, V v, int64_t n) {
  if (n >= 8) { vstore(p, v); return; }
  float t[8];
  vstore(t, v);
  for (int64_t i = 0; i < n; ++i) p[i] = t[i];
}

// ================================================================================================
// lut_grad_a: out[m, k] = sum_n g[m, n] * slope[row(a[m, k])][col(n, k)]
// ================================================================================================

// direct, rows [m0, m1): 8 taps per vector, one 8-lane gather from slope per (8 taps, n).
// Indices are row(a[m, k]) * 256 + colT[n][k]; padded taps (k >= K) read row 0, col 0, unused.
void grad_a_direct(const GradProblem& p, int64_t m0, int64_t m1) {
  const int64_t K = p.K, N = p.N, Kp = p.Kp;
  std::vector<int32_t> roff(Kp, 0);
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* am = p.a + m * K;
    for (int64_t k = 0; k < K; ++k) roff[k] = (int32_t)(am[k] ^ p.xmask) << 8;
    const float* gm = p.g + m * N;
    float* om = p.out + m * K;
    for (int64_t kc = 0; kc < Kp; kc += 8) {
      const VI ro = viload(roff.data() + kc);
      const int32_t* ct = p.colT + kc;
      V acc0 = vzero(), acc1 = vzero();
      int64_t n = 0;
      for (; n + 2 <= N; n += 2) {
        acc0 = vfma(vbcast(gm[n]), vgather(p.slope, viadd(ro, viload(ct + n * Kp))), acc0);
        acc1 = vfma(vbcast(gm[n + 1]), vgather(p.slope, viadd(ro, viload(ct + (n + 1) * Kp))), acc1);
      }
      if (n < N) acc0 = vfma(vbcast(gm[n]), vgather(p.slope, viadd(ro, viload(ct + n * Kp))), acc0);
      vstore_n(om + kc, vadd(acc0, acc1), K - kc);
    }
  }
}

// rT[j][i] = row(a[m0 + i, k0 + j]) for i < nb, j < nk (row stride ld); rows nb .. 8 * ceil(nb / 8)
// get row 0. Reading each row's codes once, in order, beats gathering a tap's codes from every
// row of the block (one cache line per row) once per tap.
AR_INLINE void codes_T(const GradProblem& p, int64_t m0, int64_t nb, int64_t k0, int64_t nk, int64_t ld,
                       uint8_t* rT) {
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* am = p.a + (m0 + i) * p.K + k0;
    for (int64_t j = 0; j < nk; ++j) rT[j * ld + i] = am[j] ^ p.xmask;
  }
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t i = nb; i < (nb + 7) / 8 * 8; ++i) rT[j * ld + i] = 0;
}

// The weight-expanded slope table TA[k][r][n] = slope[r][colK[k][n]] for taps [k0, k1);
// channels n >= N hold 0.
void build_ta(const GradProblem& p, float* TA, int64_t k0, int64_t k1) {
  const int64_t Np = p.Np, N = p.N;
  for (int64_t k = k0; k < k1; ++k) {
    float* t = TA + k * 256 * Np;
    const int32_t* col = p.colK + k * Np;
    for (int r = 0; r < 256; ++r, t += Np) {
      const float* s = p.slope + r * 256;
      for (int64_t n = 0; n < N; ++n) t[n] = s[col[n]];
      for (int64_t n = N; n < Np; ++n) t[n] = 0.f;
    }
  }
}

// table, rows [m0, m1): per (m, k) one contiguous row TA[k][row(a[m, k])][0..Np) dotted with the
// zero-padded grad row. Rows go in blocks of RB whose padded grad rows take ~16 KiB, so that
// they and one tap's TA[k] (256 * Np floats: 8 / 16 KiB for N <= 8 / 16) share L1 while the block
// is taken tap by tap, 8 rows at a time whose partial vectors are reduced together (reduce8): no
// per-output horizontal sum. (Larger blocks, whose grad rows evict TA[k], measured ~2x slower.)
// NV = Np / 8 when known at compile time (1, 2), else 0.
template <int NV>
void grad_a_table_t(const GradProblem& p, const float* TA, int64_t m0, int64_t m1) {
  const int64_t K = p.K, N = p.N, Np = NV ? NV * 8 : p.Np, slab = 256 * Np;
  const int64_t RB = std::clamp<int64_t>((4 << 10) / Np, 32, 1024) / 8 * 8;
  std::vector<float> gb(RB * Np, 0.f);  // padding lanes and rows stay 0
  std::vector<uint8_t> rT(K * RB);      // the block's slope rows, tap-major: rT[k][i]
  for (int64_t mb = m0; mb < m1; mb += RB) {
    const int64_t nb = std::min(RB, m1 - mb), nb8 = (nb + 7) / 8 * 8;
    for (int64_t i = 0; i < nb; ++i) std::memcpy(gb.data() + i * Np, p.g + (mb + i) * N, N * sizeof(float));
    for (int64_t i = nb; i < nb8; ++i) std::fill(gb.data() + i * Np, gb.data() + (i + 1) * Np, 0.f);
    codes_T(p, mb, nb, 0, K, RB, rT.data());
    for (int64_t k = 0; k < K; ++k) {
      const float* Tk = TA + k * slab;
      const uint8_t* rk = rT.data() + k * RB;
      for (int64_t i8 = 0; i8 < nb8; i8 += 8) {
        const float* gv = gb.data() + i8 * Np;
        V s[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const float* t = Tk + (int64_t)rk[i8 + j] * Np;
          const float* gj = gv + j * Np;
          if constexpr (NV == 1) {
            s[j] = vmul(vload(gj), vload(t));
          } else if constexpr (NV == 2) {
            s[j] = vfma(vload(gj + 8), vload(t + 8), vmul(vload(gj), vload(t)));
          } else {
            V acc = vmul(vload(gj), vload(t));
            for (int64_t nc = 8; nc < Np; nc += 8) acc = vfma(vload(gj + nc), vload(t + nc), acc);
            s[j] = acc;
          }
        }
        float o[8];
        vstore(o, reduce8(s));
        float* om = p.out + (mb + i8) * K + k;
        const int64_t nr = std::min<int64_t>(8, nb - i8);
        for (int64_t j = 0; j < nr; ++j) om[j * K] = o[j];
      }
    }
  }
}

void grad_a_table(const GradProblem& p, const float* TA, int64_t m0, int64_t m1) {
  if (p.Np == 8) grad_a_table_t<1>(p, TA, m0, m1);
  else if (p.Np == 16) grad_a_table_t<2>(p, TA, m0, m1);
  else grad_a_table_t<0>(p, TA, m0, m1);
}

// ================================================================================================
// lut_grad_w: out[n, k] = sum_m g[m, n] * slope[row(a[m, k])][col(n, k)]
// ================================================================================================

// direct ("rows"), taps [k0, k1): rows go in blocks of kMB, transposed so that 8 consecutive rows
// form a vector: rT[j][i] = row(a[m0 + i, k0 + j]), gT[n][i] = grad[m0 + i, n]. For a fixed
// (n, k) every lookup then falls in one 1 KiB row of sT = slope transposed (sT[col][row]), which
// stays in L1 while the block's rows go past: one L1 gather per (8 rows, n, k). The block's
// products are summed in float vectors (rows past the last full vector: scalar), 8 channels'
// vectors reduced together, and added to a double accumulator per (n, k).
constexpr int64_t kMB = 64;

void transpose_slope(const float* slope, float* sT, int64_t c0, int64_t c1) {
  for (int64_t r0 = 0; r0 < 256; r0 += 16)
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = r0; r < r0 + 16; ++r) sT[c * 256 + r] = slope[r * 256 + c];
}

void grad_w_rows(const GradProblem& p, const float* sT, int64_t k0, int64_t k1) {
  constexpr int NV = kMB / 8;
  const int64_t K = p.K, N = p.N, nk = k1 - k0, Kp = p.Kp;
  std::vector<int32_t> rT(nk * kMB);
  std::vector<float> gT(N * kMB);
  std::vector<double> acc(nk * N, 0.0);
  std::vector<float> part((N + 7) / 8 * 8);
  for (int64_t m0 = 0; m0 < p.M; m0 += kMB) {
    const int64_t nb = std::min(kMB, p.M - m0), nv = nb / 8;
    for (int64_t i = 0; i < nb; ++i) {
      const uint8_t* am = p.a + (m0 + i) * K + k0;
      const float* gm = p.g + (m0 + i) * N;
      for (int64_t j = 0; j < nk; ++j) rT[j * kMB + i] = am[j] ^ p.xmask;
      for (int64_t n = 0; n < N; ++n) gT[n * kMB + i] = gm[n];
    }
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t k = k0 + j;
      const int32_t* rk = rT.data() + j * kMB;
      VI ri[NV];
      for (int v = 0; v < nv; ++v) ri[v] = viload(rk + 8 * v);
      for (int64_t n8 = 0; n8 < N; n8 += 8) {
        V s[8];
        for (int c = 0; c < 8; ++c) {
          const int64_t n = n8 + c;
          V x = vzero();
          if (n < N) {
            const float* srow = sT + (int64_t)p.colT[n * Kp + k] * 256;
            const float* gn = gT.data() + n * kMB;
            for (int v = 0; v < nv; ++v) x = vfma(vload(gn + 8 * v), vgather(srow, ri[v]), x);
          }
          s[c] = x;
        }
        vstore(part.data() + n8, reduce8(s));
      }
      double* ak = acc.data() + j * N;
      for (int64_t n = 0; n < N; ++n) {
        float t = part[n];
        if (nv * 8 < nb) {
          const float* srow = sT + (int64_t)p.colT[n * Kp + k] * 256;
          const float* gn = gT.data() + n * kMB;
          for (int64_t i = nv * 8; i < nb; ++i) t += gn[i] * srow[rk[i]];
        }
        ak[n] += t;
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t n = 0; n < N; ++n) p.out[n * K + k0 + j] = (float)acc[j * N + n];
}

// histogram, taps [k0, k1): H[k][r][n] = sum over rows m with row(a[m, k]) = r of g[m, n] (float,
// one vector add per (m, k, 8 channels)), folded into a double histogram every kFlush rows so no
// float sum runs over more than kFlush terms; then out[n][k] = sum_r H[k][r][n] * slope[r][col]
// (finish8, in double). Taps go in chunks whose float histogram stays in L2.
void grad_w_hist(const GradProblem& p, int64_t k0, int64_t k1) {
  constexpr int64_t kFlush = 16384;
  const int64_t K = p.K, N = p.N, Np = p.Np, M = p.M, slab = 256 * Np;
  const int64_t kRB = std::clamp<int64_t>((16 << 10) / Np, 32, 1024) / 8 * 8;
  const int64_t kc = std::clamp<int64_t>((256 << 10) / (slab * 4), 1, k1 - k0);
  std::vector<float> H(kc * slab);
  std::vector<double> Hd(kc * slab);
  const bool pad = Np != N;
  std::vector<float> gb(pad ? kRB * Np : 0, 0.f);  // padding lanes stay 0
  std::vector<uint8_t> rT(kc * kRB);
  for (int64_t ks = k0; ks < k1; ks += kc) {
    const int64_t nk = std::min(kc, k1 - ks);
    std::fill(Hd.begin(), Hd.begin() + nk * slab, 0.0);
    for (int64_t f0 = 0; f0 < M; f0 += kFlush) {
      const int64_t f1 = std::min(M, f0 + kFlush);
      std::fill(H.begin(), H.begin() + nk * slab, 0.f);
      for (int64_t mb = f0; mb < f1; mb += kRB) {
        const int64_t nb = std::min(kRB, f1 - mb);
        const float* gsrc = p.g + mb * N;
        if (pad) {
          for (int64_t i = 0; i < nb; ++i) std::memcpy(gb.data() + i * Np, p.g + (mb + i) * N, N * sizeof(float));
          gsrc = gb.data();
        }
        codes_T(p, mb, nb, ks, nk, kRB, rT.data());
        for (int64_t j = 0; j < nk; ++j) {
          const uint8_t* rj = rT.data() + j * kRB;
          float* Hj = H.data() + j * slab;
          for (int64_t i = 0; i < nb; ++i) {
            float* h = Hj + (int64_t)rj[i] * Np;
            const float* gv = gsrc + i * Np;
            for (int64_t c = 0; c < Np; c += 8) vstore(h + c, vadd(vload(h + c), vload(gv + c)));
          }
        }
      }
      double* hd = Hd.data();
      const float* hf = H.data();
      for (int64_t e = 0; e < nk * slab; ++e) hd[e] += hf[e];
    }
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t k = ks + j;
      for (int64_t c = 0; c < Np; c += 8) {
        double o[8];
        finish8(Hd.data() + j * slab + c, Np, p.slope, p.colK + k * Np + c, o);
        for (int64_t t = 0; t < 8 && c + t < N; ++t) p.out[(c + t) * K + k] = (float)o[t];
      }
    }
  }
}

}  // namespace AR_NS
