// CPU kernels for approx::quantize, approx::dequantize (with a residual block's add and ReLU), approx::requantize
// and requantize_codes (arithmetic: see ../ops.cpp).
// setup.py compiles with -ffp-contract=off, so `a * b + c` below is two roundings, as in eager PyTorch.
//
// The loops are written so that a build without -march runs them in vector registers: quantize in SSE2
// (part of every x86-64), requantize in AVX2 where the CPU has it (picked at run time in cpu_isa.h, as
// for the LUT kernels). Each vector loop computes the same bits as the scalar loop beside it, which
// defines the op; tests/ops/test_quant_ops.py checks the two against runner.quant's reference over the
// whole code range.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AR_X86 1
#include "cpu_isa.h"
#endif

#include "../checks.h"

namespace {

using approx_checks::check_nonfinite_flag;
using approx_checks::check_scale;

// x + 1.5 * 2^23 - 1.5 * 2^23 rounds |x| <= 2^22 to the nearest integer, ties to even, in the default rounding
// mode (the sum lies in [2^23, 2^24), whose spacing is 1; the subtraction is exact): std::nearbyint's answer
// for the clamped value, without SSE4.1's round instruction or a libm call per element.
constexpr float kRoundMagic = 12582912.0f;

template <typename T>
bool quantize_loop(const float* x, T* out, int64_t n, float inv, float qmin, float qmax) {
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, n, 1 << 15, [&](int64_t b, int64_t e) {
    bool bad = false;
    int64_t i = b;
#ifdef AR_X86
    // clamp, then round: the same code as round, then clamp, since the bounds are integers and rounding is
    // monotone. max_ps(NaN, lo) is lo, as fmax(NaN, lo) in the scalar loop.
    const __m128 vinv = _mm_set1_ps(inv), vlo = _mm_set1_ps(qmin), vhi = _mm_set1_ps(qmax);
    const __m128 magic = _mm_set1_ps(kRoundMagic);
    const __m128i exponent = _mm_set1_epi32(0x7f800000);  // all ones: Inf or NaN
    __m128i seen = _mm_setzero_si128();
    for (; i + 16 <= e; i += 16) {
      __m128i c[4];
      for (int j = 0; j < 4; ++j) {
        const __m128 v = _mm_loadu_ps(x + i + 4 * j);
        seen = _mm_or_si128(seen, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(v), exponent), exponent));
        const __m128 q = _mm_min_ps(_mm_max_ps(_mm_mul_ps(v, vinv), vlo), vhi);
        c[j] = _mm_cvtps_epi32(_mm_sub_ps(_mm_add_ps(q, magic), magic));  // integral: converts exactly
      }
      const __m128i lo16 = _mm_packs_epi32(c[0], c[1]), hi16 = _mm_packs_epi32(c[2], c[3]);
      const __m128i bytes = std::is_signed_v<T> ? _mm_packs_epi16(lo16, hi16) : _mm_packus_epi16(lo16, hi16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bytes);
    }
    bad = _mm_movemask_epi8(seen) != 0;
#endif
    for (; i < e; ++i) {
      bad |= !std::isfinite(x[i]);
      const float q = std::nearbyint(x[i] * inv);
      out[i] = static_cast<T>(std::fmin(std::fmax(q, qmin), qmax));
    }
    if (bad) nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

at::Tensor quantize_cpu(const at::Tensor& x, const at::Tensor& scale, bool is_signed,
                        const std::optional<at::Tensor>& nonfinite) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize: `x` must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "quantize: `x` must be contiguous");
  check_scale("quantize", scale, x, 1, "scale");
  check_nonfinite_flag(nonfinite, x);
  const float inv = 1.0f / scale.item<float>();
  auto out = at::empty(x.sizes(), x.options().dtype(is_signed ? at::kChar : at::kByte));
  const bool bad = is_signed
      ? quantize_loop(x.data_ptr<float>(), out.data_ptr<int8_t>(), x.numel(), inv, -128.f, 127.f)
      : quantize_loop(x.data_ptr<float>(), out.data_ptr<uint8_t>(), x.numel(), inv, 0.f, 255.f);
  if (bad && nonfinite) nonfinite->fill_(true);
  return out;
}

at::Tensor dequantize_cpu(const at::Tensor& acc, const at::Tensor& act_scale, const at::Tensor& weight_scale,
                          const at::Tensor& bias, const std::optional<at::Tensor>& residual, bool relu,
                          const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& codes_scale) {
  const int64_t n = approx_checks::check_dequantize(acc, act_scale, weight_scale, bias);
  approx_checks::check_residual(residual, acc);
  approx_checks::check_dequantize_codes(codes, codes_scale, acc);
  const int64_t inner = approx_checks::plane_size(acc);
  const float sa = act_scale.item<float>();
  const float* sw = weight_scale.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  const int32_t* in = acc.data_ptr<int32_t>();
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t rows = acc.size(0) * n;  // one (batch, channel) plane of `inner` values each
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(inner, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % n;
      const float s = sa * sw[c], bc = b[c];
      const int32_t* src = in + r * inner;
      float* dst = o + r * inner;
      for (int64_t i = 0; i < inner; ++i) dst[i] = static_cast<float>(src[i]) * s + bc;
      if (res != nullptr) {
        const float* add = res + r * inner;
        for (int64_t i = 0; i < inner; ++i) dst[i] += add[i];
      }
      if (relu) {  // v < 0, not max: NaN and -0.0 stay, as torch.relu keeps them
        for (int64_t i = 0; i < inner; ++i) dst[i] = dst[i] < 0.0f ? 0.0f : dst[i];
      }
    }
  });
  if (codes) {  // quantize's own loop over the output: its codes by construction (a second pass on the CPU)
    const float inv = 1.0f / codes_scale->item<float>();
    if (codes->scalar_type() == at::kChar)
      quantize_loop(o, codes->data_ptr<int8_t>(), out.numel(), inv, -128.f, 127.f);
    else
      quantize_loop(o, codes->data_ptr<uint8_t>(), out.numel(), inv, 0.f, 255.f);
  }
  return out;
}

// requantize's code, floor((acc + bias) * M0 / 2^shift + 1/2) clamped to [qmin, qmax], in double instead of
// int64 where that gives the same integer: for shift <= kExactShift. Proof: t = acc + bias (|t| < 2^33) and
// r = M0 * 2^-shift are exact doubles, so y = t * r is v = t * M0 * 2^-shift rounded once. Where |v| < 512,
// t * M0 < 2^(9 + shift) <= 2^52 is an integer and v is exact (y = v), and so are y + 1/2 (a multiple of
// 2^-shift below 2^10) and its floor. Where |v| >= 512, rounding is monotone, so |y| >= 512 and the code
// clamps to qmax or qmin (within [-128, 255]) as the exact one does. Larger shifts keep the int64 formula.
constexpr int kExactShift = 43;

inline double requantize_code(int32_t a, double bias, double r, double qmin, double qmax) {
  const double y = std::min(std::max((static_cast<double>(a) + bias) * r, -512.0), 512.0);
  return std::min(std::max(std::floor(y + 0.5), qmin), qmax);
}

#ifdef AR_X86
#pragma GCC push_options
#pragma GCC target("avx2")
// requantize_code times os on four values at a time; returns the index after the last one done
int64_t requantize_row_avx2(const int32_t* src, float* dst, int64_t n, double bias, double r, double qmin,
                            double qmax, float os) {
  const __m256d vb = _mm256_set1_pd(bias), vr = _mm256_set1_pd(r), half = _mm256_set1_pd(0.5);
  const __m256d lo = _mm256_set1_pd(-512.0), hi = _mm256_set1_pd(512.0);
  const __m256d clo = _mm256_set1_pd(qmin), chi = _mm256_set1_pd(qmax);
  const __m128 vos = _mm_set1_ps(os);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d t = _mm256_add_pd(_mm256_cvtepi32_pd(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), vb);
    const __m256d y = _mm256_min_pd(_mm256_max_pd(_mm256_mul_pd(t, vr), lo), hi);
    const __m256d code = _mm256_min_pd(_mm256_max_pd(_mm256_floor_pd(_mm256_add_pd(y, half)), clo), chi);
    _mm_storeu_ps(dst + i, _mm_mul_ps(_mm256_cvtpd_ps(code), vos));  // integral: converts exactly
  }
  return i;
}
#pragma GCC pop_options
#endif

// requantize's codes of acc, each passed to put(index, code) as a double (exact: an integer in [qmin, qmax]);
// the AVX2 row kernel, where given, does a row's first elements itself and returns where it stopped.
template <typename Put, typename Row>
void requantize_rows(const at::Tensor& acc, int64_t n, const at::Tensor& bias, const at::Tensor& multiplier,
                     const at::Tensor& shift, int64_t qmin, int64_t qmax, Put put, Row avx2_row) {
  const int64_t inner = approx_checks::plane_size(acc);
  const int32_t* b = bias.data_ptr<int32_t>();
  const int32_t* m0 = multiplier.data_ptr<int32_t>();
  const int32_t* sh = shift.data_ptr<int32_t>();
  const int32_t* in = acc.data_ptr<int32_t>();
  const int64_t rows = acc.size(0) * n;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(inner, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % n, bc = b[c], mc = m0[c], base = r * inner;
      const int s = std::min(std::max<int>(sh[c], 1), 63);  // the documented range; a shift outside it is UB
      const int32_t* src = in + base;
      int64_t i = 0;
      if (s <= kExactShift) {
        const double rc = std::ldexp(static_cast<double>(mc), -s), bd = static_cast<double>(bc);
        i = avx2_row(base, src, inner, bd, rc);
        for (; i < inner; ++i) put(base + i, requantize_code(src[i], bd, rc, double(qmin), double(qmax)));
      }
      for (; i < inner; ++i) {
        const int64_t p = (static_cast<int64_t>(src[i]) + bc) * mc;
        const int64_t code = ((p >> (s - 1)) + 1) >> 1;
        put(base + i, static_cast<double>(std::min(std::max(code, qmin), qmax)));
      }
    }
  });
}

at::Tensor requantize_cpu(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                          const at::Tensor& shift, const at::Tensor& out_scale, int64_t qmin, int64_t qmax) {
  const int64_t n = approx_checks::check_requantize(acc, bias, multiplier, shift, out_scale, qmin, qmax);
  const float os = out_scale.item<float>();
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
#ifdef AR_X86
  const bool avx2 = approx_cpu::has_avx2();
#endif
  requantize_rows(
      acc, n, bias, multiplier, shift, qmin, qmax,
      [&](int64_t i, double code) { o[i] = static_cast<float>(code) * os; },
      [&](int64_t base, const int32_t* src, int64_t inner, double bd, double rc) -> int64_t {
#ifdef AR_X86
        if (avx2) return requantize_row_avx2(src, o + base, inner, bd, rc, double(qmin), double(qmax), os);
#endif
        return 0;
      });
  return out;
}

template <typename T>
at::Tensor requantize_codes_as(const at::Tensor& acc, int64_t n, const at::Tensor& bias, const at::Tensor& multiplier,
                               const at::Tensor& shift, int64_t qmin, int64_t qmax, at::ScalarType dtype) {
  auto out = at::empty(acc.sizes(), acc.options().dtype(dtype));
  T* o = out.data_ptr<T>();
  requantize_rows(
      acc, n, bias, multiplier, shift, qmin, qmax, [&](int64_t i, double code) { o[i] = static_cast<T>(code); },
      [](int64_t, const int32_t*, int64_t, double, double) -> int64_t { return 0; });
  return out;
}

at::Tensor requantize_codes_cpu(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                                const at::Tensor& shift, int64_t qmin, int64_t qmax, bool is_signed) {
  const int64_t n = approx_checks::check_requantize_codes(acc, bias, multiplier, shift, qmin, qmax, is_signed);
  return is_signed ? requantize_codes_as<int8_t>(acc, n, bias, multiplier, shift, qmin, qmax, at::kChar)
                   : requantize_codes_as<uint8_t>(acc, n, bias, multiplier, shift, qmin, qmax, at::kByte);
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("requantize", &requantize_cpu);
  m.impl("requantize_codes", &requantize_codes_cpu);
}
