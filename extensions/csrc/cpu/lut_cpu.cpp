// CPU kernels for approx::lut_linear and approx::lut_conv2d (arithmetic: see ../ops.cpp).
//
// Both ops run one engine: a linear layer is a conv whose rows are the rows of `a` and whose taps
// are offsets 0..K-1; a conv row is one output pixel of one group, its taps are the offsets of the
// K input codes relative to the pixel's top-left corner in a (zero-code padded) input. So there is
// no im2col: the kernels read codes straight from the input through a K-entry offset table.
//
// Two algorithms:
//   direct    one LUT lookup per MAC (lookup column precomputed per weight). No per-call table,
//             so it suits small batches and training, where weights change every step.
//   expanded  per call, a weight-expanded table T[g][k][a][n] = product(a, w[g*Ng+n][k]) with the
//             weight sign folded in and n padded to a multiple of 16. For one activation code the
//             inner loop then adds a contiguous run of output channels with vector loads into
//             int32 accumulators that stay in registers. int16 entries when every product fits.
//
// Vector code: the hot loops are written once with GCC vector extensions and inlined into
// functions compiled for AVX-512, AVX2 and the baseline; the build needs no -march flag and the
// variant is picked at run time from the CPU's features.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"  // vector types never cross a non-inlined call

#define AR_INLINE inline __attribute__((always_inline))
// Lambdas are functions of their own: without this they could be compiled for the baseline ISA.
#define AR_LAMBDA_INLINE __attribute__((always_inline))

namespace {

// ------------------------------------------------------------------------------------------------
// Problem description shared by both ops.
struct Problem {
  const uint8_t* act;     // activation codes (raw bytes; padded copy for convs with padding)
  uint8_t xmask;          // code ^ xmask = LUT row: 0x80 for int8 (a + 128), 0 for uint8
  bool is_unsigned;
  int64_t K;              // taps per row (per group)
  const int32_t* off;     // [K] tap offsets from a row's base
  int64_t B, G, Ho, Wo;   // rows are (b, g, oh, ow); linear: B = G = Wo = 1, Ho = M
  int64_t a_img, a_grp, a_oh, a_ow;  // strides of a row's base pointer
  int32_t* out;
  int64_t o_img, o_grp, o_pix, o_ch;  // out strides; pixel p = oh * Wo + ow
  int64_t Ng;             // output channels per group
  int64_t Np;             // Ng rounded up to a multiple of 16 (table row length)
};

constexpr int kMaxR = 4;

// ------------------------------------------------------------------------------------------------
// Vector helpers. L = int32 lanes per vector (4 baseline SSE2, 8 AVX2, 16 AVX-512).
template <int L> struct VT {
  typedef uint32_t u32 __attribute__((vector_size(4 * L)));
  typedef int32_t i32 __attribute__((vector_size(4 * L)));
  typedef int16_t i16 __attribute__((vector_size(2 * L)));
};

template <typename TT, int L>
AR_INLINE typename VT<L>::u32 load_widen(const TT* p) {
  if constexpr (sizeof(TT) == 2) {
    typename VT<L>::i16 h;
    std::memcpy(&h, p, sizeof h);
    return (typename VT<L>::u32)__builtin_convertvector(h, typename VT<L>::i32);
  } else {
    typename VT<L>::u32 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
}

// R rows x NT channels of the expanded algorithm. Tg points at the group's table plus n0.
template <typename TT, int L, int NT, int R>
AR_INLINE void exp_tile(const TT* __restrict Tg, const Problem& p, const uint8_t* const* base,
                        int nr, int32_t* const* outp, int64_t n0) {
  using V = typename VT<L>::u32;
  constexpr int NV = NT / L;
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  const int64_t Np = p.Np, slab = 256 * Np;
  const int32_t* __restrict off = p.off;
  const uint8_t x = p.xmask;
  for (int64_t k = 0; k < p.K; ++k) {
    const int32_t o = off[k];
    const TT* tk = Tg + k * slab;
    for (int r = 0; r < R; ++r) {
      const TT* row = tk + (int64_t)(uint8_t)(base[r][o] ^ x) * Np;
      for (int v = 0; v < NV; ++v) acc[r][v] += load_widen<TT, L>(row + v * L);
    }
  }
  const int64_t nvalid = std::min<int64_t>(NT, p.Ng - n0);
  for (int r = 0; r < nr; ++r) {
    uint32_t tmp[NT];
    std::memcpy(tmp, acc[r], sizeof tmp);
    int32_t* o = outp[r] + n0 * p.o_ch;
    for (int64_t n = 0; n < nvalid; ++n) o[n * p.o_ch] = (int32_t)tmp[n];
  }
}

// R rows x NT channels of the direct algorithm: col/neg are [K][Np] per group (plus n0).
template <bool UNS, int NT, int R>
AR_INLINE void direct_tile(const int32_t* __restrict lut, const int32_t* __restrict col,
                           const uint32_t* __restrict neg, const Problem& p,
                           const uint8_t* const* base, int nr, int32_t* const* outp, int64_t n0) {
  uint32_t acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NT; ++n) acc[r][n] = 0;
  const int64_t Np = p.Np;
  const uint8_t x = p.xmask;
  for (int64_t k = 0; k < p.K; ++k) {
    const int32_t o = p.off[k];
    const int32_t* ck = col + k * Np;
    const uint32_t* nk = neg + k * Np;
    for (int r = 0; r < R; ++r) {
      const int32_t* row = lut + (int64_t)(uint8_t)(base[r][o] ^ x) * 256;
      for (int n = 0; n < NT; ++n) {
        uint32_t v = (uint32_t)row[ck[n]];
        if constexpr (UNS) v = (v ^ nk[n]) - nk[n];  // nk = all ones for negative weights
        acc[r][n] += v;
      }
    }
  }
  const int64_t nvalid = std::min<int64_t>(NT, p.Ng - n0);
  for (int r = 0; r < nr; ++r) {
    int32_t* o = outp[r] + n0 * p.o_ch;
    for (int64_t n = 0; n < nvalid; ++n) o[n * p.o_ch] = (int32_t)acc[r][n];
  }
}

// Walks rows [r0, r1) (flattened (b, g, pixel)) in blocks of up to R rows of one (b, g), and
// calls tile(g, base, nr, outp) for each block. Short blocks repeat their last row.
template <int R, typename F>
AR_INLINE void for_row_blocks(const Problem& p, int64_t r0, int64_t r1, F&& tile) {
  const int64_t P = p.Ho * p.Wo;
  int64_t r = r0;
  while (r < r1) {
    const int64_t bg = r / P, b = bg / p.G, g = bg % p.G;
    const int64_t pix0 = r % P;
    const int nr = (int)std::min<int64_t>({(int64_t)R, r1 - r, P - pix0});
    const uint8_t* base[R];
    int32_t* outp[R];
    for (int i = 0; i < R; ++i) {
      const int64_t pix = pix0 + std::min(i, nr - 1);
      const int64_t oh = pix / p.Wo, ow = pix % p.Wo;
      base[i] = p.act + b * p.a_img + g * p.a_grp + oh * p.a_oh + ow * p.a_ow;
      outp[i] = p.out + b * p.o_img + g * p.o_grp + pix * p.o_pix;
    }
    tile(g, base, nr, outp);
    r += nr;
  }
}

// Channel tiles of 64, 32, 16 over Np (a multiple of 16); rows per block chosen so that the
// accumulators (R * NT / L vectors) fit the register file.
template <typename TT, int L>
AR_INLINE void exp_rows(const TT* T, const Problem& p, int64_t r0, int64_t r1) {
  const int64_t tsz = p.K * 256 * p.Np;
  auto run = [&](auto nt_tag, auto r_tag) AR_LAMBDA_INLINE {
    constexpr int NT = decltype(nt_tag)::value, R = decltype(r_tag)::value;
    for_row_blocks<R>(p, r0, r1, [&](int64_t g, const uint8_t* const* base, int nr, int32_t* const* outp) AR_LAMBDA_INLINE {
      const TT* Tg = T + g * tsz;
      int64_t n0 = 0;
      for (; n0 + 64 <= p.Np; n0 += 64) exp_tile<TT, L, 64, R>(Tg + n0, p, base, nr, outp, n0);
      if (n0 + 32 <= p.Np) { exp_tile<TT, L, 32, R>(Tg + n0, p, base, nr, outp, n0); n0 += 32; }
      if (n0 < p.Np) exp_tile<TT, L, 16, R>(Tg + n0, p, base, nr, outp, n0);
    });
    (void)nt_tag;
  };
  using I64 = std::integral_constant<int, 64>;
  // Wide layers: fewer rows per block keep the 64-channel tile's accumulators in registers.
  if (p.Np >= 64) {
    if constexpr (L >= 16) run(I64{}, std::integral_constant<int, 2>{});
    else run(I64{}, std::integral_constant<int, 1>{});
  } else {
    run(I64{}, std::integral_constant<int, kMaxR>{});
  }
}

template <int L>
AR_INLINE void direct_rows(const int32_t* lut, const int32_t* col, const uint32_t* neg,
                           const Problem& p, int64_t r0, int64_t r1) {
  constexpr int R = 2;
  const int64_t csz = p.K * p.Np;
  for_row_blocks<R>(p, r0, r1, [&](int64_t g, const uint8_t* const* base, int nr, int32_t* const* outp) AR_LAMBDA_INLINE {
    const int32_t* cg = col + g * csz;
    const uint32_t* ng = neg + g * csz;
    for (int64_t n0 = 0; n0 < p.Np; n0 += 16) {
      if (p.is_unsigned)
        direct_tile<true, 16, R>(lut, cg + n0, ng + n0, p, base, nr, outp, n0);
      else
        direct_tile<false, 16, R>(lut, cg + n0, ng + n0, p, base, nr, outp, n0);
    }
  });
}

// ISA variants. Each is a plain function with a target attribute so everything inlined into it is
// compiled for that ISA.
#define AR_VARIANTS(NAME, BODY)                                                                  \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2"))) void NAME##_avx512 \
      BODY(16)                                                                                   \
  __attribute__((target("avx2,fma,bmi2"))) void NAME##_avx2 BODY(8)                             \
  void NAME##_base BODY(4)

#define AR_EXP16_BODY(L) (const int16_t* T, const Problem& p, int64_t r0, int64_t r1) { exp_rows<int16_t, L>(T, p, r0, r1); }
#define AR_EXP32_BODY(L) (const int32_t* T, const Problem& p, int64_t r0, int64_t r1) { exp_rows<int32_t, L>(T, p, r0, r1); }
#define AR_DIRECT_BODY(L) (const int32_t* lut, const int32_t* col, const uint32_t* neg, const Problem& p, int64_t r0, int64_t r1) { direct_rows<L>(lut, col, neg, p, r0, r1); }
AR_VARIANTS(exp16, AR_EXP16_BODY)
AR_VARIANTS(exp32, AR_EXP32_BODY)
AR_VARIANTS(direct, AR_DIRECT_BODY)

enum class Isa { Base, Avx2, Avx512 };

Isa detect_isa() {
  static const Isa isa = [] {
    const char* force = std::getenv("APPROX_RUN_CPU_ISA");  // for measuring the variants
    __builtin_cpu_init();
    const bool a512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool a2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
    if (force && std::string(force) == "base") return Isa::Base;
    if (force && std::string(force) == "avx2" && a2) return Isa::Avx2;
    return a512 ? Isa::Avx512 : a2 ? Isa::Avx2 : Isa::Base;
  }();
  return isa;
}

// ------------------------------------------------------------------------------------------------
enum class Algo { Auto, Direct, Expanded };

Algo parse_algo(c10::string_view s, const char* op) {
  if (s == "auto") return Algo::Auto;
  if (s == "direct") return Algo::Direct;
  if (s == "expanded") return Algo::Expanded;
  TORCH_CHECK(false, op, ": unknown algo '", std::string(s.data(), s.size()),
              "'; valid: auto, direct, expanded");
}

void check_common(const char* op, const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut) {
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte, op,
              ": activation codes `a` must be int8 (signed multiplier) or uint8 (unsigned "
              "multiplier), got ", a.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": weight codes `w` must be int8, got ",
              w.scalar_type());
  TORCH_CHECK(lut.scalar_type() == at::kInt && lut.dim() == 2 && lut.size(0) == 256 &&
                  lut.size(1) == 256,
              op, ": `lut` must be an int32 tensor of shape [256, 256], got ", lut.scalar_type(),
              " ", lut.sizes());
  TORCH_CHECK(a.is_contiguous(), op, ": `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(w.is_contiguous(), op, ": `w` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(lut.is_contiguous(), op, ": `lut` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == w.device() && a.device() == lut.device(), op,
              ": a, w and lut must be on the same device, got ", a.device(), ", ", w.device(),
              ", ", lut.device());
  TORCH_CHECK(a.device().is_cpu(), op, ": the CPU kernel got tensors on ", a.device());
}

// Weight column in the LUT and sign mask for weight tap k of output channel n of group g.
struct WeightCols {
  std::vector<int32_t> col;   // [G][K][Np], padded channels -> column of weight 0
  std::vector<uint32_t> neg;  // [G][K][Np], all ones where the weight is negative (unsigned only)
};

WeightCols weight_cols(const at::Tensor& w, const Problem& p) {
  const int8_t* wd = w.data_ptr<int8_t>();
  WeightCols wc;
  const int64_t n = p.G * p.K * p.Np;
  wc.col.assign(n, p.is_unsigned ? 0 : 128);
  wc.neg.assign(n, 0);
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t j = 0; j < p.Ng; ++j)
      for (int64_t k = 0; k < p.K; ++k) {
        const int v = wd[(g * p.Ng + j) * p.K + k];
        const int64_t i = (g * p.K + k) * p.Np + j;
        if (p.is_unsigned) {
          wc.col[i] = v < 0 ? -v : v;
          wc.neg[i] = v < 0 ? 0xFFFFFFFFu : 0u;
        } else {
          wc.col[i] = v + 128;
        }
      }
  return wc;
}

// Whether every product the table would hold fits int16 (unsigned: so does its negation).
bool products_fit_int16(const int32_t* lut, const WeightCols& wc) {
  bool used[256] = {};
  for (int32_t c : wc.col) used[c] = true;
  const int32_t lo = -32767, hi = 32767;
  for (int a = 0; a < 256; ++a)
    for (int c = 0; c < 256; ++c)
      if (used[c] && (lut[a * 256 + c] < lo || lut[a * 256 + c] > hi)) return false;
  return true;
}

template <typename TT>
void build_table(TT* T, const int32_t* lut, const WeightCols& wc, const Problem& p) {
  const int64_t Np = p.Np;
  at::parallel_for(0, p.G * p.K, 16, [&](int64_t s, int64_t e) {
    for (int64_t gk = s; gk < e; ++gk) {
      const int32_t* col = wc.col.data() + gk * Np;
      const uint32_t* neg = wc.neg.data() + gk * Np;
      TT* dst = T + gk * 256 * Np;
      const int64_t g = gk / p.K;
      (void)g;
      for (int a = 0; a < 256; ++a) {
        const int32_t* row = lut + a * 256;
        TT* d = dst + a * Np;
        for (int64_t n = 0; n < p.Ng; ++n) d[n] = (TT)(int32_t)(((uint32_t)row[col[n]] ^ neg[n]) - neg[n]);
        for (int64_t n = p.Ng; n < Np; ++n) d[n] = 0;
      }
    }
  });
}

constexpr int64_t kTableBudget = 64ll << 20;

void run(Problem& p, const at::Tensor& w, const at::Tensor& lut_t, Algo algo) {
  const int64_t rows = p.B * p.G * p.Ho * p.Wo;
  if (rows == 0 || p.Ng == 0) return;
  const int32_t* lut = lut_t.data_ptr<int32_t>();
  WeightCols wc = weight_cols(w, p);
  const bool fit16 = products_fit_int16(lut, wc);
  const int64_t tbytes = p.G * p.K * 256 * p.Np * (fit16 ? 2 : 4);
  if (algo == Algo::Auto) {
    // The table costs about K*256*Np entry writes per group; each row it saves costs about
    // K*Ng lookups. Measured break-even on AVX2/AVX-512 is near rows/group * Ng = 64 * Np.
    const int64_t rows_per_group = p.B * p.Ho * p.Wo;
    algo = (tbytes <= kTableBudget && rows_per_group * p.Ng >= 64 * p.Np) ? Algo::Expanded
                                                                          : Algo::Direct;
  }
  // A few hundred MACs per task at least, so tiny problems stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, p.K * p.Np));
  const Isa isa = detect_isa();
  if (algo == Algo::Direct) {
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      switch (isa) {
        case Isa::Avx512: direct_avx512(lut, wc.col.data(), wc.neg.data(), p, r0, r1); break;
        case Isa::Avx2: direct_avx2(lut, wc.col.data(), wc.neg.data(), p, r0, r1); break;
        default: direct_base(lut, wc.col.data(), wc.neg.data(), p, r0, r1);
      }
    });
    return;
  }
  TORCH_CHECK(tbytes <= 16 * kTableBudget, "expanded table of ", tbytes >> 20,
              " MiB is too large; use algo='direct'");
  at::Tensor table = at::empty({tbytes}, lut_t.options().dtype(at::kByte));
  if (fit16) {
    int16_t* T = reinterpret_cast<int16_t*>(table.data_ptr<uint8_t>());
    build_table(T, lut, wc, p);
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      switch (isa) {
        case Isa::Avx512: exp16_avx512(T, p, r0, r1); break;
        case Isa::Avx2: exp16_avx2(T, p, r0, r1); break;
        default: exp16_base(T, p, r0, r1);
      }
    });
  } else {
    int32_t* T = reinterpret_cast<int32_t*>(table.data_ptr<uint8_t>());
    build_table(T, lut, wc, p);
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      switch (isa) {
        case Isa::Avx512: exp32_avx512(T, p, r0, r1); break;
        case Isa::Avx2: exp32_avx2(T, p, r0, r1); break;
        default: exp32_base(T, p, r0, r1);
      }
    });
  }
}

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

at::Tensor lut_linear_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                          c10::string_view algo_name) {
  check_common("lut_linear", a, w, lut);
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2, "lut_linear: expected a [M, K] and w [N, K], got a ",
              a.sizes(), ", w ", w.sizes());
  TORCH_CHECK(a.size(1) == w.size(1), "lut_linear: a has K=", a.size(1),
              " columns but w has K=", w.size(1));
  const Algo algo = parse_algo(algo_name, "lut_linear");
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kInt));
  if (K == 0) return out.zero_();
  std::vector<int32_t> off(K);
  for (int64_t k = 0; k < K; ++k) off[k] = (int32_t)k;
  Problem p{};
  p.act = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.is_unsigned = a.scalar_type() == at::kByte;
  p.xmask = p.is_unsigned ? 0 : 0x80;
  p.K = K;
  p.off = off.data();
  p.B = 1; p.G = 1; p.Ho = M; p.Wo = 1;
  p.a_img = 0; p.a_grp = 0; p.a_oh = K; p.a_ow = 0;
  p.out = out.data_ptr<int32_t>();
  p.o_img = 0; p.o_grp = 0; p.o_pix = N; p.o_ch = 1;
  p.Ng = N; p.Np = round16(N);
  run(p, w, lut, algo);
  return out;
}

at::Tensor lut_conv2d_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                          at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                          int64_t groups, c10::string_view algo_name) {
  check_common("lut_conv2d", a, w, lut);
  TORCH_CHECK(a.dim() == 4 && w.dim() == 4,
              "lut_conv2d: expected a [B, C, H, W] and w [N, C/groups, kh, kw], got a ", a.sizes(),
              ", w ", w.sizes());
  TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
              "lut_conv2d: stride, padding and dilation must have 2 entries");
  const int64_t sh = stride[0], sw = stride[1], ph = padding[0], pw = padding[1];
  const int64_t dh = dilation[0], dw = dilation[1];
  TORCH_CHECK(sh >= 1 && sw >= 1 && dh >= 1 && dw >= 1 && ph >= 0 && pw >= 0,
              "lut_conv2d: need stride >= 1, dilation >= 1, padding >= 0, got stride ", stride,
              ", padding ", padding, ", dilation ", dilation);
  const int64_t B = a.size(0), C = a.size(1), H = a.size(2), W = a.size(3);
  const int64_t N = w.size(0), Cg = w.size(1), kh = w.size(2), kw = w.size(3);
  TORCH_CHECK(groups >= 1 && C % groups == 0 && N % groups == 0, "lut_conv2d: groups=", groups,
              " must divide input channels (", C, ") and output channels (", N, ")");
  TORCH_CHECK(Cg * groups == C, "lut_conv2d: w expects ", Cg * groups, " input channels (", Cg,
              " per group x ", groups, " groups), a has ", C);
  const int64_t Ho = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  const int64_t Wo = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  TORCH_CHECK(Ho >= 1 && Wo >= 1 && H + 2 * ph - dh * (kh - 1) - 1 >= 0 &&
                  W + 2 * pw - dw * (kw - 1) - 1 >= 0,
              "lut_conv2d: output would be empty for input ", a.sizes().slice(2), ", kernel ",
              w.sizes().slice(2));
  const Algo algo = parse_algo(algo_name, "lut_conv2d");
  at::Tensor out = at::empty({B, N, Ho, Wo}, a.options().dtype(at::kInt));
  const int64_t K = Cg * kh * kw;
  if (K == 0) return out.zero_();

  // Padding becomes stored code 0, so every tap is an in-bounds read; the copy is O(input).
  at::Tensor src = a;
  if (ph || pw) {
    src = at::zeros({B, C, H + 2 * ph, W + 2 * pw}, a.options());
    src.narrow(2, ph, H).narrow(3, pw, W).copy_(a);
  }
  const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw;
  TORCH_CHECK(C * Hp * Wp < (int64_t(1) << 31), "lut_conv2d: image too large");
  std::vector<int32_t> off(K);
  for (int64_t c = 0; c < Cg; ++c)
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j)
        off[(c * kh + i) * kw + j] = (int32_t)(c * Hp * Wp + i * dh * Wp + j * dw);
  Problem p{};
  p.act = reinterpret_cast<const uint8_t*>(src.data_ptr());
  p.is_unsigned = a.scalar_type() == at::kByte;
  p.xmask = p.is_unsigned ? 0 : 0x80;
  p.K = K;
  p.off = off.data();
  p.B = B; p.G = groups; p.Ho = Ho; p.Wo = Wo;
  p.a_img = C * Hp * Wp; p.a_grp = Cg * Hp * Wp; p.a_oh = sh * Wp; p.a_ow = sw;
  p.out = out.data_ptr<int32_t>();
  p.Ng = N / groups; p.Np = round16(p.Ng);
  p.o_img = N * Ho * Wo; p.o_grp = p.Ng * Ho * Wo; p.o_pix = 1; p.o_ch = Ho * Wo;
  run(p, w, lut, algo);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("lut_linear", &lut_linear_cpu);
  m.impl("lut_conv2d", &lut_conv2d_cpu);
}
