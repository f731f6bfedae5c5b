// CPU kernels for approx::quantize, approx::dequantize and approx::requantize (arithmetic: see ../ops.cpp).
// setup.py compiles with -ffp-contract=off, so `a * b + c` below is two roundings, as in eager PyTorch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>

#include "../checks.h"

namespace {

using approx_checks::check_nonfinite_flag;
using approx_checks::check_scale;

template <typename T>
bool quantize_loop(const float* x, T* out, int64_t n, float inv, float qmin, float qmax) {
  std::atomic<bool> nonfinite{false};
  at::parallel_for(0, n, 1 << 15, [&](int64_t b, int64_t e) {
    bool bad = false;
    for (int64_t i = b; i < e; ++i) {
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
                          const at::Tensor& bias) {
  const int64_t n = approx_checks::check_dequantize(acc, act_scale, weight_scale, bias);
  const int64_t inner = approx_checks::plane_size(acc);
  const float sa = act_scale.item<float>();
  const float* sw = weight_scale.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  const int32_t* in = acc.data_ptr<int32_t>();
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
    }
  });
  return out;
}

at::Tensor requantize_cpu(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                          const at::Tensor& shift, const at::Tensor& out_scale, int64_t qmin, int64_t qmax) {
  const int64_t n = approx_checks::check_requantize(acc, bias, multiplier, shift, out_scale, qmin, qmax);
  const int64_t inner = approx_checks::plane_size(acc);
  const float os = out_scale.item<float>();
  const int32_t* b = bias.data_ptr<int32_t>();
  const int32_t* m0 = multiplier.data_ptr<int32_t>();
  const int32_t* sh = shift.data_ptr<int32_t>();
  const int32_t* in = acc.data_ptr<int32_t>();
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t rows = acc.size(0) * n;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(inner, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r % n, bc = b[c], mc = m0[c];
      const int s = std::min(std::max<int>(sh[c], 1), 63);  // the documented range; a shift outside it is UB
      const int32_t* src = in + r * inner;
      float* dst = o + r * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const int64_t p = (static_cast<int64_t>(src[i]) + bc) * mc;
        const int64_t code = ((p >> (s - 1)) + 1) >> 1;
        dst[i] = static_cast<float>(std::min(std::max(code, qmin), qmax)) * os;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("requantize", &requantize_cpu);
}
