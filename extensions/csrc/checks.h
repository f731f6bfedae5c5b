// Input checks of approx::lut_linear / approx::lut_conv2d and of quantize / dequantize, shared by every
// backend's entry points (cpu/lut_cpu.cpp, cpu/quant_cpu.cpp, cuda/lut_ops.cpp, cuda/quant_cuda.cu), so
// that each mistake reads the same everywhere; the python
// reference (runner/ops.py) words them alike. Host code only: error messages are built from
// strings (streaming integers into TORCH_CHECK from nvcc-compiled files crashed on the GPU
// machine with torch 2.11 / nvcc 13.0).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace approx_checks {

inline std::string I(int64_t v) { return std::to_string(v); }
inline std::string D(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline const char* T(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

// dtypes, LUT shape, contiguity, one device, and that device is the backend's.
inline void check_common(const char* op, const at::Tensor& a, const at::Tensor& w,
                         const at::Tensor& lut, c10::DeviceType backend) {
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte, op,
              ": activation codes `a` must be int8 (signed multiplier) or uint8 (unsigned "
              "multiplier), got ", T(a));
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": weight codes `w` must be int8, got ", T(w));
  TORCH_CHECK(lut.scalar_type() == at::kInt && lut.dim() == 2 && lut.size(0) == 256 &&
                  lut.size(1) == 256,
              op, ": `lut` must be an int32 tensor of shape [256, 256], got ", T(lut), " ",
              D(lut.sizes()));
  TORCH_CHECK(a.is_contiguous(), op, ": `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(w.is_contiguous(), op, ": `w` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(lut.is_contiguous(), op, ": `lut` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == w.device() && a.device() == lut.device(), op,
              ": a, w and lut must be on the same device, got ", a.device().str(), ", ",
              w.device().str(), ", ", lut.device().str());
  TORCH_CHECK(a.device().type() == backend, op, ": the ", c10::DeviceTypeName(backend),
              " kernel got tensors on ", a.device().str());
}

// A scale of quantize / dequantize / requantize (or an int32 parameter of requantize): float32 (int32),
// `numel` values, on x's device, contiguous.
inline void check_scale(const char* op, const at::Tensor& s, const at::Tensor& x, int64_t numel,
                        const char* name, bool int32 = false) {
  const std::string what = std::string(op) + ": `" + name + "` must ";
  TORCH_CHECK(s.scalar_type() == (int32 ? at::kInt : at::kFloat),
              what + "be " + (int32 ? "int32" : "float32") + ", got " + T(s));
  TORCH_CHECK(s.numel() == numel, what + "have " + I(numel) + " element(s), got " + I(s.numel()));
  TORCH_CHECK(s.device() == x.device(), what + "be on " + x.device().str() + ", got " + s.device().str());
  TORCH_CHECK(s.is_contiguous(), what + "be contiguous");
}

// quantize's optional non-finite flag: one bool on x's device.
inline void check_nonfinite_flag(const std::optional<at::Tensor>& flag, const at::Tensor& x) {
  TORCH_CHECK(!flag || (flag->scalar_type() == at::kBool && flag->numel() == 1 && flag->device() == x.device()),
              "quantize: `nonfinite` must be one bool on " + x.device().str() + ", got " +
                  (flag ? std::string(T(*flag)) + " " + D(flag->sizes()) + " on " + flag->device().str() : ""));
}

// requantize's accumulators, code range and per-channel parameters, for the CPU and CUDA kernels alike.
// The accumulators a layer's last step reads: int32 [B, N, ...], contiguous. Returns N (the channels).
inline int64_t check_acc(const char* op, const at::Tensor& acc) {
  TORCH_CHECK(acc.scalar_type() == at::kInt, std::string(op) + ": `acc` must be int32, got " + T(acc));
  TORCH_CHECK(acc.dim() >= 2, std::string(op) + ": `acc` must be [B, N, ...], got " + I(acc.dim()) + " dims");
  TORCH_CHECK(acc.is_contiguous(), std::string(op) + ": `acc` must be contiguous");
  return acc.size(1);
}

// Values per (batch, channel) plane of acc: the spatial size of a conv's output, 1 for a linear layer's.
inline int64_t plane_size(const at::Tensor& acc) {
  int64_t inner = 1;
  for (int64_t d = 2; d < acc.dim(); ++d) inner *= acc.size(d);
  return inner;
}

inline int64_t check_dequantize(const at::Tensor& acc, const at::Tensor& act_scale, const at::Tensor& weight_scale,
                                const at::Tensor& bias) {
  const int64_t n = check_acc("dequantize", acc);
  check_scale("dequantize", act_scale, acc, 1, "act_scale");
  check_scale("dequantize", weight_scale, acc, n, "weight_scale");
  check_scale("dequantize", bias, acc, n, "bias");
  return n;
}

// A tensor dequantize reads or writes beside acc (its residual, its codes): acc's shape, on its device, contiguous.
inline void check_beside_acc(const at::Tensor& t, const at::Tensor& acc, const std::string& name) {
  const std::string what = "dequantize: `" + name + "` must ";
  TORCH_CHECK(t.sizes() == acc.sizes(), what + "have acc's shape " + D(acc.sizes()) + ", got " + D(t.sizes()));
  TORCH_CHECK(t.device() == acc.device(), what + "be on " + acc.device().str() + ", got " + t.device().str());
  TORCH_CHECK(t.is_contiguous(), what + "be contiguous");
}

// dequantize's optional residual: float32 of acc's shape, on its device, contiguous.
inline void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& acc) {
  if (!residual) return;
  TORCH_CHECK(residual->scalar_type() == at::kFloat,
              std::string("dequantize: `residual` must be float32, got ") + T(*residual));
  check_beside_acc(*residual, acc, "residual");
}

// dequantize's optional codes (int8 / uint8 of acc's shape, contiguous, on its device) and their scale.
inline void check_dequantize_codes(const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& scale,
                                   const at::Tensor& acc) {
  TORCH_CHECK(codes.has_value() == scale.has_value(), "dequantize: `codes` and `codes_scale` come together");
  if (!codes) return;
  TORCH_CHECK(codes->scalar_type() == at::kChar || codes->scalar_type() == at::kByte,
              std::string("dequantize: `codes` must be int8 or uint8, got ") + T(*codes));
  check_beside_acc(*codes, acc, "codes");
  check_scale("dequantize", *scale, acc, 1, "codes_scale");
}

// The accumulators, the code range [lo, hi] qmin and qmax must lie in, and the per-channel int32 parameters.
inline int64_t check_requant_args(const char* op, const at::Tensor& acc, const at::Tensor& bias,
                                  const at::Tensor& multiplier, const at::Tensor& shift, int64_t qmin, int64_t qmax,
                                  int64_t lo, int64_t hi) {
  check_acc(op, acc);
  TORCH_CHECK(lo <= qmin && qmin < qmax && qmax <= hi, std::string(op) + ": need " + I(lo) + " <= qmin < qmax <= " +
                                                           I(hi) + ", got qmin " + I(qmin) + ", qmax " + I(qmax));
  const int64_t n = acc.size(1);
  check_scale(op, bias, acc, n, "bias", true);
  check_scale(op, multiplier, acc, n, "multiplier", true);
  check_scale(op, shift, acc, n, "shift", true);
  return n;
}

inline int64_t check_requantize(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                                const at::Tensor& shift, const at::Tensor& out_scale, int64_t qmin, int64_t qmax) {
  const int64_t n = check_requant_args("requantize", acc, bias, multiplier, shift, qmin, qmax, -128, 255);
  check_scale("requantize", out_scale, acc, 1, "out_scale");
  return n;
}

// requantize_codes: the code range within the codes' dtype (int8 if signed).
inline int64_t check_requantize_codes(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                                      const at::Tensor& shift, int64_t qmin, int64_t qmax, bool is_signed) {
  return check_requant_args("requantize_codes", acc, bias, multiplier, shift, qmin, qmax, is_signed ? -128 : 0,
                            is_signed ? 127 : 255);
}

struct LinearShape {
  int64_t M, K, N;
};

inline LinearShape check_linear(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                c10::DeviceType backend) {
  check_common("lut_linear", a, w, lut, backend);
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2, "lut_linear: expected a [M, K] and w [N, K], got a ",
              D(a.sizes()), ", w ", D(w.sizes()));
  TORCH_CHECK(a.size(1) == w.size(1), "lut_linear: a has K=", I(a.size(1)),
              " columns but w has K=", I(w.size(1)));
  return {a.size(0), a.size(1), w.size(0)};
}

struct BmmShape {
  int64_t B, M, N, K;
};

// lut_bmm: a [B, M, K] codes as lut_linear's a, b [B, N, K] int8 codes as its w (runner/reference.py _check_bmm
// words them alike, in the same order).
inline BmmShape check_bmm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut, c10::DeviceType backend) {
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte,
              std::string("lut_bmm: codes `a` must be int8 (signed multiplier) or uint8 (unsigned multiplier), got ") +
                  T(a));
  TORCH_CHECK(b.scalar_type() == at::kChar, std::string("lut_bmm: codes `b` must be int8, got ") + T(b));
  TORCH_CHECK(lut.scalar_type() == at::kInt && lut.dim() == 2 && lut.size(0) == 256 && lut.size(1) == 256,
              std::string("lut_bmm: `lut` must be an int32 tensor of shape [256, 256], got ") + T(lut) + " " +
                  D(lut.sizes()));
  TORCH_CHECK(a.is_contiguous(), "lut_bmm: `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(b.is_contiguous(), "lut_bmm: `b` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(lut.is_contiguous(), "lut_bmm: `lut` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == b.device() && a.device() == lut.device(),
              "lut_bmm: a, b and lut must be on the same device, got " + a.device().str() + ", " + b.device().str() +
                  ", " + lut.device().str());
  TORCH_CHECK(a.device().type() == backend, std::string("lut_bmm: the ") + c10::DeviceTypeName(backend) +
                                                " kernel got tensors on " + a.device().str());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(2),
              "lut_bmm: expected a [B, M, K] and b [B, N, K], got a " + D(a.sizes()) + ", b " + D(b.sizes()));
  return {a.size(0), a.size(1), b.size(1), a.size(2)};
}

// approx::lut_bmm_variant's variants: the CUDA kernel's layouts (cuda/lut_bmm_cuda.cu says what each is), by
// index. lut_bmm on CUDA picks among the first four by timing them on a shape's first call (variant 0 inside a
// CUDA graph capture); the CPU backend has one kernel, which every valid index runs. One list for every backend,
// so an index is validated alike everywhere (tests/ops/test_lut_bmm.py checks it on the CPU).
inline constexpr const char* kBmmVariants[] = {"g2_r4c8_k64_pad", "g3_k64_pad",  "g2_r8c4_k64_pad",
                                               "g2_r4c8_k64_rowlanes", "g2_r4c8_pad", "g3_pad"};
inline constexpr int64_t kBmmVariantCount = (int64_t)(sizeof(kBmmVariants) / sizeof(kBmmVariants[0]));

inline void check_bmm_variant(int64_t v) {
  if (v >= 0 && v < kBmmVariantCount) return;
  std::string names;
  for (int64_t i = 0; i < kBmmVariantCount; ++i) names += (i ? ", " : "") + I(i) + " " + kBmmVariants[i];
  TORCH_CHECK(false, "lut_bmm: unknown variant " + I(v) + "; variants: " + names);
}

struct ConvShape {
  int64_t B, C, H, W, N, Cg, kh, kw, sh, sw, ph, pw, dh, dw, groups, Ho, Wo, K;
};

inline std::pair<int64_t, int64_t> pair_arg(c10::IntArrayRef v, const char* name) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, "lut_conv2d: ", name,
              " must have 1 or 2 values, got ", D(v));
  return {v[0], v[v.size() - 1]};
}

inline ConvShape check_conv(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                            c10::IntArrayRef stride, c10::IntArrayRef padding,
                            c10::IntArrayRef dilation, int64_t groups, c10::DeviceType backend) {
  check_common("lut_conv2d", a, w, lut, backend);
  TORCH_CHECK(a.dim() == 4 && w.dim() == 4,
              "lut_conv2d: expected a [B, C, H, W] and w [N, C/groups, kh, kw], got a ",
              D(a.sizes()), ", w ", D(w.sizes()));
  ConvShape s{};
  std::tie(s.sh, s.sw) = pair_arg(stride, "stride");
  std::tie(s.ph, s.pw) = pair_arg(padding, "padding");
  std::tie(s.dh, s.dw) = pair_arg(dilation, "dilation");
  TORCH_CHECK(s.sh >= 1 && s.sw >= 1 && s.dh >= 1 && s.dw >= 1 && s.ph >= 0 && s.pw >= 0,
              "lut_conv2d: need stride >= 1, dilation >= 1, padding >= 0, got stride ", D(stride),
              ", padding ", D(padding), ", dilation ", D(dilation));
  s.B = a.size(0), s.C = a.size(1), s.H = a.size(2), s.W = a.size(3);
  s.N = w.size(0), s.kh = w.size(2), s.kw = w.size(3), s.groups = groups;
  TORCH_CHECK(groups >= 1 && s.C % groups == 0 && s.N % groups == 0, "lut_conv2d: groups=",
              I(groups), " must divide input channels (", I(s.C), ") and output channels (",
              I(s.N), ")");
  TORCH_CHECK(w.size(1) * groups == s.C, "lut_conv2d: w expects ", I(w.size(1) * groups),
              " input channels (", I(w.size(1)), " per group x ", I(groups), " groups), a has ",
              I(s.C));
  s.Cg = s.C / groups;
  const int64_t hspan = s.H + 2 * s.ph - s.dh * (s.kh - 1) - 1;
  const int64_t wspan = s.W + 2 * s.pw - s.dw * (s.kw - 1) - 1;
  s.Ho = hspan < 0 ? 0 : hspan / s.sh + 1;
  s.Wo = wspan < 0 ? 0 : wspan / s.sw + 1;
  TORCH_CHECK(s.Ho >= 1 && s.Wo >= 1, "lut_conv2d: output would be empty (", I(s.Ho), "x",
              I(s.Wo), ") for input ", D(a.sizes().slice(2)), ", kernel ",
              D(w.sizes().slice(2)));
  s.K = s.Cg * s.kh * s.kw;
  return s;
}

}  // namespace approx_checks
