// CPU kernels for approx::lut_grad_a and approx::lut_grad_w (arithmetic: see ../ops.cpp), in rows
// form: a [M, K] codes, w [N, K] codes, grad [M, N] float32, slope [256, 256] float32 indexed
// [row(a)][w + 128] (row(a) = a + 128 for int8, a for uint8).
//   lut_grad_a: out[m, k] = sum_n grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   [M, K]
//   lut_grad_w: out[n, k] = sum_m grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   [N, K]
//
// Two algorithms per op (hot loops in lut_grad_cpu_kernels.inc):
//   lut_grad_a
//     direct  8 taps per vector: for each (m, 8 taps, n) one 8-lane gather from slope at
//             row(a[m, k]) * 256 + w[n, k] + 128, times grad[m, n]. No per-call table; the 8
//             taps' slope rows (8 KiB) stay in L1 across n. Parallel over m.
//     table   the weight-expanded table TA[k][r][n] = slope[r][w[n, k] + 128] (K * 256 * Np
//             floats, n padded to Np = 8 * ceil(N / 8)), built per call (parallel over k); then
//             each (m, k) is a contiguous dot product of TA[k][row(a[m, k])][:] with the padded
//             grad row, taken tap by tap over a block of rows (TA[k] stays in L1 for N <= 16),
//             8 rows' vectors reduced at once. Parallel over m.
//   lut_grad_w
//     direct  ("rows") 8 rows per vector: a block of rows is transposed so that, for a fixed
//             (n, k), all lookups fall in one 1 KiB row of the transposed slope table (L1): one
//             gather per (8 rows, n, k); float sums per 64-row block, double across blocks.
//             Parallel over k. Costs a 256 x 256 transpose of slope per call.
//     table   histogram: H[k][r][n] = sum of grad[m, n] over rows with row(a[m, k]) = r (one
//             vector add per (m, k, 8 channels)), then out[n, k] = sum_r H[k][r][n] *
//             slope[r][w[n, k] + 128] in double. Parallel over k, so threads own disjoint
//             histograms; float histograms are folded into double ones every 16384 rows.
//
// Per-call rule (choose_a / choose_w): estimated single-thread times in ns, measured on a 2-core
// AMD EPYC (Zen 3, AVX2) with the LeNet-5 shapes,
//   grad_a  direct = 0.8 * M * Kp * N                 (Kp = 8 * ceil(K / 8))
//           table  = 0.7 * K * 256 * Np + M * K * (1.5 + 1.5 * Np / 8)
//   grad_w  direct = 0.7 * M8 * K * N + 50000         (M8 = 8 * ceil(M / 8); + the transpose)
//           table  = 1.4 * K * 256 * Np + 2.5 * M * K * Np / 8
// and the cheaper one runs (grad_a's table also needs K * 256 * Np * 4 <= 64 MiB). So the table /
// histogram wins once M is a few hundred to a couple of thousand rows (convs in training: M =
// batch * output pixels), direct wins for small M (fully-connected layers at training batch
// sizes) and for N = 1 (grad_w). APPROX_RUN_GRAD_ALGO=direct|table forces one algorithm (tests,
// measurements).
//
// Accuracy: float32 products and sums, except where a sum can run over many rows (grad_w: double
// across row blocks / histogram flushes). Every algorithm's pairing of terms differs from the
// float64 reference only by float32 rounding.
//
// Vector code: lut_grad_cpu_kernels.inc is compiled twice (AVX2+FMA, baseline x86-64) under
// `#pragma GCC target`; the variant is picked at run time (APPROX_RUN_CPU_ISA=base forces the
// baseline one). AVX-512 machines run the AVX2 variant.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu_isa.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // vector types never cross a non-inlined call

#define AR_INLINE inline __attribute__((always_inline))

namespace {

struct GradProblem {
  const uint8_t* a;      // activation codes (raw bytes), [M, K]
  uint8_t xmask;         // code ^ xmask = slope row: 0x80 for int8 (a + 128), 0 for uint8
  int64_t M, K, N;
  int64_t Kp, Np;        // K and N rounded up to multiples of 8
  const float* g;        // grad [M, N]
  const float* slope;    // [256, 256]
  const int32_t* colT;   // [N][Kp] w[n][k] + 128 (0 for k >= K); direct algorithms
  const int32_t* colK;   // [K][Np] w[n][k] + 128 (0 for n >= N); table algorithms
  float* out;
};

}  // namespace

#define AR_NS isabase
#define AR_ISA 0
namespace {
#include "lut_grad_cpu_kernels.inc"
}
#undef AR_NS
#undef AR_ISA

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")
#define AR_NS isa256
#define AR_ISA 256
namespace {
#include "lut_grad_cpu_kernels.inc"
}
#undef AR_NS
#undef AR_ISA
#pragma GCC pop_options

namespace {

#define AR_DISPATCH(FN, ...)          \
  if (approx_cpu::has_avx2()) {       \
    isa256::FN(__VA_ARGS__);          \
  } else {                            \
    isabase::FN(__VA_ARGS__);         \
  }

// ---- per-call rule (see the top of the file) ----------------------------------------------------
constexpr int64_t kTableBudget = 64ll << 20;
// At least ~1M multiply-adds per task: below that, waking a second thread costs more than it
// saves (as in lut_cpu.cpp).
constexpr int64_t kMinTask = 1 << 20;

enum class GradAlgo { Auto, Direct, Table };

GradAlgo forced_algo(const char* op) {
  const char* e = std::getenv("APPROX_RUN_GRAD_ALGO");
  if (!e || !*e || std::string(e) == "auto") return GradAlgo::Auto;
  if (std::string(e) == "direct") return GradAlgo::Direct;
  if (std::string(e) == "table") return GradAlgo::Table;
  TORCH_CHECK(false, op, ": APPROX_RUN_GRAD_ALGO='", e, "' is not one of auto, direct, table");
}

int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

void check_grad(const char* op, const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                const at::Tensor& slope) {
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte, op,
              ": activation codes `a` must be int8 (signed multiplier) or uint8 (unsigned "
              "multiplier), got ", a.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": weight codes `w` must be int8, got ",
              w.scalar_type());
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2, op, ": expected a [M, K] and w [N, K], got a ",
              a.sizes(), ", w ", w.sizes());
  TORCH_CHECK(a.size(1) == w.size(1), op, ": a has K=", a.size(1), " columns but w has K=",
              w.size(1));
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.size(0) == a.size(0) &&
                  grad.size(1) == w.size(0),
              op, ": `grad` must be a float32 tensor of shape [M, N] = [", a.size(0), ", ",
              w.size(0), "], got ", grad.scalar_type(), " ", grad.sizes());
  TORCH_CHECK(slope.scalar_type() == at::kFloat && slope.dim() == 2 && slope.size(0) == 256 &&
                  slope.size(1) == 256,
              op, ": `slope` must be a float32 tensor of shape [256, 256], got ",
              slope.scalar_type(), " ", slope.sizes());
  TORCH_CHECK(a.is_contiguous(), op, ": `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(w.is_contiguous(), op, ": `w` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(grad.is_contiguous(), op, ": `grad` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(slope.is_contiguous(), op, ": `slope` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == w.device() && a.device() == grad.device() &&
                  a.device() == slope.device(),
              op, ": a, w, grad and slope must be on the same device, got ", a.device(), ", ",
              w.device(), ", ", grad.device(), ", ", slope.device());
  TORCH_CHECK(a.device().is_cpu(), op, ": the CPU kernel got tensors on ", a.device());
}

GradProblem make_problem(const at::Tensor& a, const at::Tensor& grad, const at::Tensor& slope,
                         int64_t N, at::Tensor& out) {
  GradProblem p{};
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.xmask = a.scalar_type() == at::kChar ? 0x80 : 0;
  p.M = a.size(0);
  p.K = a.size(1);
  p.N = N;
  p.Kp = round8(p.K);
  p.Np = round8(p.N);
  p.g = grad.data_ptr<float>();
  p.slope = slope.data_ptr<float>();
  p.out = out.data_ptr<float>();
  return p;
}

// colT[n][k] = w[n][k] + 128 for k < K, 0 for K <= k < Kp.
std::vector<int32_t> cols_by_channel(const at::Tensor& w, const GradProblem& p) {
  std::vector<int32_t> c(p.N * p.Kp, 0);
  const int8_t* wd = w.data_ptr<int8_t>();
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t k = 0; k < p.K; ++k) c[n * p.Kp + k] = wd[n * p.K + k] + 128;
  return c;
}

// colK[k][n] = w[n][k] + 128 for n < N, 0 for N <= n < Np.
std::vector<int32_t> cols_by_tap(const at::Tensor& w, const GradProblem& p) {
  std::vector<int32_t> c(p.K * p.Np, 0);
  const int8_t* wd = w.data_ptr<int8_t>();
  for (int64_t n = 0; n < p.N; ++n)
    for (int64_t k = 0; k < p.K; ++k) c[k * p.Np + n] = wd[n * p.K + k] + 128;
  return c;
}

bool ta_fits(const GradProblem& p) { return p.K * 256 * p.Np * 4 <= kTableBudget; }

GradAlgo choose_a(const GradProblem& p, GradAlgo forced) {
  if (forced != GradAlgo::Auto) return forced == GradAlgo::Table && !ta_fits(p) ? GradAlgo::Direct : forced;
  const double M = p.M, K = p.K, N = p.N, Kp = p.Kp, Np = p.Np;
  const double direct = 0.8 * M * Kp * N;
  const double table = 0.7 * K * 256 * Np + M * K * (1.5 + 1.5 * Np / 8);
  return ta_fits(p) && table < direct ? GradAlgo::Table : GradAlgo::Direct;
}

GradAlgo choose_w(const GradProblem& p, GradAlgo forced) {
  if (forced != GradAlgo::Auto) return forced;
  const double M8 = (p.M + 7) / 8 * 8, M = p.M, K = p.K, N = p.N, Np = p.Np;
  const double direct = 0.7 * M8 * K * N + 50000;
  const double table = 1.4 * K * 256 * Np + 2.5 * M * K * Np / 8;
  return table < direct ? GradAlgo::Table : GradAlgo::Direct;
}

at::Tensor lut_grad_a_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                          const at::Tensor& slope) {
  check_grad("lut_grad_a", a, w, grad, slope);
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (M == 0 || K == 0 || N == 0) return at::zeros({M, K}, grad.options());
  at::Tensor out = at::empty({M, K}, grad.options());
  GradProblem p = make_problem(a, grad, slope, N, out);
  const GradAlgo algo = choose_a(p, forced_algo("lut_grad_a"));
  const int64_t grain = std::max<int64_t>(1, kMinTask / std::max<int64_t>(1, K * N));
  if (algo == GradAlgo::Direct) {
    const std::vector<int32_t> colT = cols_by_channel(w, p);
    p.colT = colT.data();
    at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) { AR_DISPATCH(grad_a_direct, p, m0, m1) });
    return out;
  }
  const std::vector<int32_t> colK = cols_by_tap(w, p);
  p.colK = colK.data();
  std::unique_ptr<float[]> TA(new float[p.K * 256 * p.Np]);
  float* T = TA.get();
  at::parallel_for(0, K, std::max<int64_t>(1, (1 << 18) / (256 * p.Np)),
                   [&](int64_t k0, int64_t k1) { AR_DISPATCH(build_ta, p, T, k0, k1) });
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) { AR_DISPATCH(grad_a_table, p, T, m0, m1) });
  return out;
}

at::Tensor lut_grad_w_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                          const at::Tensor& slope) {
  check_grad("lut_grad_w", a, w, grad, slope);
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (M == 0 || K == 0 || N == 0) return at::zeros({N, K}, grad.options());
  at::Tensor out = at::empty({N, K}, grad.options());
  GradProblem p = make_problem(a, grad, slope, N, out);
  const GradAlgo algo = choose_w(p, forced_algo("lut_grad_w"));
  if (algo == GradAlgo::Direct) {
    const std::vector<int32_t> colT = cols_by_channel(w, p);
    p.colT = colT.data();
    std::unique_ptr<float[]> sT(new float[256 * 256]);
    float* S = sT.get();
    const float* slope_p = p.slope;
    AR_DISPATCH(transpose_slope, slope_p, S, 0, 256)  // ~20 us: not worth a second thread
    const int64_t grain = std::max<int64_t>(1, kMinTask / std::max<int64_t>(1, M * N));
    at::parallel_for(0, K, grain, [&](int64_t k0, int64_t k1) { AR_DISPATCH(grad_w_rows, p, S, k0, k1) });
    return out;
  }
  const std::vector<int32_t> colK = cols_by_tap(w, p);
  p.colK = colK.data();
  const int64_t grain = std::max<int64_t>(1, kMinTask / std::max<int64_t>(1, M * p.Np));
  at::parallel_for(0, K, grain, [&](int64_t k0, int64_t k1) { AR_DISPATCH(grad_w_hist, p, k0, k1) });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("lut_grad_a", &lut_grad_a_cpu);
  m.impl("lut_grad_w", &lut_grad_w_cpu);
}
