// Schemas of every approx-run operator. Kernels register per dispatch key in cpu/ and cuda/;
// Python wrappers (fake/meta kernels, autograd) live in runner/ops.py.
//
// Arithmetic shared by every kernel (the python reference in runner/ops.py defines it):
//   a   activation codes: int8 (signed multiplier) or uint8 (unsigned multiplier)
//   w   weight codes: int8, symmetric
//   lut int32 [256, 256], row = operand A (activation), column = operand B (weight):
//         signed   (a int8):  product = lut[a + 128][w + 128]
//         unsigned (a uint8): product = sign(w) * lut[a][|w|]   (sign-magnitude weights)
//   out int32 accumulators: out = sum_k product(a_k, w_k), exact (no saturation; wraps like int32).
//   Conv padding feeds activation code 0 through the multiplier, as a zero-padded input would be
//   in hardware: with an approximate LUT, lut(0, w) may be non-zero.
//   algo: "auto" lets the kernel choose, "expanded" takes the backend's weight-expanded variant for
//   the shape; other names select a variant: each backend lists its own through lut_algos.
#include <Python.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "fused.h"

// `import runner._C` only loads the library: the ops register through the static initialisers
// of TORCH_LIBRARY / TORCH_LIBRARY_IMPL, so the module itself is empty (no pybind).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(approx, m) {
  m.def("lut_linear(Tensor a, Tensor w, Tensor lut, str algo=\"auto\") -> Tensor");
  m.def(
      "lut_conv2d(Tensor a, Tensor w, Tensor lut, int[2] stride=1, int[2] padding=0, "
      "int[2] dilation=1, int groups=1, str algo=\"auto\") -> Tensor");
  // Batched matmul of two dynamic operands (attention's Q.K^T, P.V): a [B, M, K] codes as lut_linear's a,
  // b [B, N, K] int8 codes as its w (so b's sign is applied after an unsigned multiplier, like a weight's):
  //   out[i, m, n] = sum_k product(a[i, m, k], b[i, n, k])   int32 [B, M, N], wrapping like lut_linear.
  // One kernel per backend, no algo: no operand is constant, so there is no table to expand ahead.
  m.def("lut_bmm(Tensor a, Tensor b, Tensor lut) -> Tensor");
  // Internal (benchmarks/cuda_attention.py, tests): lut_bmm through one of the CUDA kernel's layouts, by index
  // into lut_bmm_variants() (checks.h kBmmVariants; lut_bmm times 0-3 and keeps the fastest per shape, 0 in a
  // CUDA graph capture). Same result for every variant;
  // the CPU kernel runs every valid index. An unknown index is an error on every backend.
  m.def("lut_bmm_variant(Tensor a, Tensor b, Tensor lut, int variant) -> Tensor");
  m.def("lut_bmm_variants() -> str[]", []() {
    return std::vector<std::string>(std::begin(approx_checks::kBmmVariants), std::end(approx_checks::kBmmVariants));
  });
  // The variants of the backend of `a`'s device for these shapes (a [M, K] and w [N, K]: linear;
  // a and w 4-d: conv with the given stride, padding, dilation, groups): their names, the device
  // memory each one's prepared tables take (-1 where the variant does not run the shape), why not
  // ("" where it does), and the variant `auto` picked for these shapes ("" where it has not
  // picked yet: CUDA times its candidates on the first call of a shape).
  m.def(
      "lut_algos(Tensor a, Tensor w, Tensor lut, int[2] stride=1, int[2] padding=0, "
      "int[2] dilation=1, int groups=1) -> (str[], int[], str[], str)");
  // CUDA: the configurations auto's first call of these shapes times, in its order, by the exact names a named call
  // runs (lut_algos' auto_pick is one of them once picked). A test and debugging aid; the CPU's auto decides by a
  // cost model (lut_algos), so there is no CPU kernel.
  m.def(
      "lut_auto_candidates(Tensor a, Tensor w, Tensor lut, int[2] stride=1, int[2] padding=0, "
      "int[2] dilation=1, int groups=1) -> str[]");
  // Per variant of the backend of `a`'s device (lut_algos' order): in how many lut_linear /
  // lut_conv2d calls of this process it computed output rows (auto's first call of a shape times
  // both, so both count). A test and debugging aid: what auto ran, beside what lut_algos reports.
  // CPU only; `a` only selects the backend.
  m.def("lut_runs(Tensor a) -> int[]");
  // The lookup limit of the backend of `a`'s device: table reads per second of a pure gather loop
  // (random codes into an L1-resident 1 KiB int32 table row, nothing else per read; vector gathers of
  // the ISA the CPU kernels run, on every thread for about `seconds` of CPU time each, each thread timed by its own CPU time, summed). The yardstick of benchmarks' "fraction
  // of the lookup limit". CPU only; `a` only selects the backend.
  m.def("lookup_rate(Tensor a, float seconds=0.2) -> float");
  // The layer's two elementwise ends, fused (see runner/quant.py for the arithmetic):
  //   quantize:   codes = clamp(nearbyint(x * (1.0f / scale)), qmin, qmax), int8 [-128, 127] when
  //               signed else uint8 [0, 255]: the integers torch.fake_quantize_per_tensor_affine
  //               rounds to (same float ops, same order).
  //   dequantize: out[:, n, ...] = float(acc) * (act_scale * weight_scale[n]) + bias[n] in fp32,
  //               the multiply and the add rounded separately (no FMA), like the eager expression.
  // Scales are 0-d / [N] float32 tensors on the data's device, so GPU code never waits for the host.
  //   nonfinite:  optional 1-element bool on x's device, set true when x holds a NaN or Inf (never
  //               cleared): a layer learns of a bad input from the pass that reads x anyway, instead of
  //               a check of its own (extra launches on the GPU, a host wait on the result).
  m.def("quantize(Tensor x, Tensor scale, bool signed, Tensor(a!)? nonfinite=None) -> Tensor");
  // dequantize with a residual (a residual block's last conv and its sum): out + residual, one more rounding, then
  // with relu max(., 0) as torch.relu (NaN and -0.0 kept): the block's add and ReLU in the same pass. With codes
  // (int8 or uint8 of acc's shape) and codes_scale (0-d float32), the pass also writes quantize(out, codes_scale)'s
  // codes into codes: the next layer's input codes, beside the float output its other readers take.
  m.def(
      "dequantize(Tensor acc, Tensor act_scale, Tensor weight_scale, Tensor bias, Tensor? residual=None, "
      "bool relu=False, Tensor(a!)? codes=None, Tensor? codes_scale=None) -> Tensor");
  // quant.requant=integer: the accumulators requantized to the next layer's codes in integer arithmetic
  // (runner/quant.py reference_requantize; gemmlowp / TFLite style fixed-point multiplier):
  //   v = int64(acc) + bias[n];  p = v * multiplier[n];  code = ((p >> (shift[n] - 1)) + 1) >> 1
  //   out = float(clamp(code, qmin, qmax)) * out_scale   (one IEEE rounding; the next layer's quantize at
  //   out_scale gives `code` back exactly)
  // acc int32 [B, N, ...]; bias, multiplier, shift int32 [N] on acc's device, multiplier in [0, 2^31) and
  // shift in [1, 63] (so p fits int64 and the shifts are defined); out_scale 0-d float32; qmin < qmax within
  // [-128, 255]. Rounds half up; arithmetic shifts of int64.
  m.def(
      "requantize(Tensor acc, Tensor bias, Tensor multiplier, Tensor shift, Tensor out_scale, int qmin, "
      "int qmax) -> Tensor");
  // The same codes, clamp(code, qmin, qmax), as int8 (signed) or uint8 codes: what the next layer's quantize of
  // requantize's output would give, without the float tensor between (a hand-off read by that layer alone).
  m.def(
      "requantize_codes(Tensor acc, Tensor bias, Tensor multiplier, Tensor shift, int qmin, int qmax, "
      "bool signed) -> Tensor");
  // Backward of the `lut` gradient (runner/ops.py slope_tables, reference_lut_grad_*), in rows form
  // (a conv is unfolded first): a [M, K] codes, w [N, K] codes, grad [M, N] float32, slope [256, 256]
  // float32 indexed [row(a)][w + 128] (row(a) = a + 128 for int8, a for uint8):
  //   lut_grad_a: out[m, k] = sum_n grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   float32 [M, K]
  //   lut_grad_w: out[n, k] = sum_m grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   float32 [N, K]
  m.def("lut_grad_a(Tensor a, Tensor w, Tensor grad, Tensor slope) -> Tensor");
  m.def("lut_grad_w(Tensor a, Tensor w, Tensor grad, Tensor slope) -> Tensor");
  // A conv layer and its end in one op: lut_conv2d's sums, then dequantize (with its residual, relu and codes) or
  // requantize_codes of them, the same values bit for bit: the two ops run one after the other (the composite
  // below, the CPU kernel), except where CUDA's variant applies the end in its own stores (Algo::applies_end in
  // cuda/algos.cpp: expanded_window, expanded_gemm's tiles, the depthwise variants), so the int32 sums are neither
  // written nor read back.
  m.def(
      "lut_conv2d_dequantize(Tensor a, Tensor w, Tensor lut, int[2] stride, int[2] padding, int[2] dilation, "
      "int groups, str algo, Tensor act_scale, Tensor weight_scale, Tensor bias, Tensor? residual=None, "
      "bool relu=False, Tensor(a!)? codes=None, Tensor? codes_scale=None) -> Tensor");
  m.def(
      "lut_conv2d_requantize_codes(Tensor a, Tensor w, Tensor lut, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, str algo, Tensor bias, Tensor multiplier, Tensor shift, int qmin, int qmax, "
      "bool signed) -> Tensor");
}

namespace approx_fused {

at::Tensor lut_conv2d_dequantize(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                 c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                 int64_t groups, c10::string_view algo, const at::Tensor& act_scale,
                                 const at::Tensor& weight_scale, const at::Tensor& bias,
                                 const std::optional<at::Tensor>& residual, bool relu,
                                 const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& codes_scale) {
  static const auto conv = lut_conv2d_op();
  static const auto deq = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("approx::dequantize", "")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const std::optional<at::Tensor>&, bool,
                                                const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  return deq.call(conv.call(a, w, lut, stride, padding, dilation, groups, algo), act_scale, weight_scale, bias,
                  residual, relu, codes, codes_scale);
}

at::Tensor lut_conv2d_requantize_codes(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                       int64_t groups, c10::string_view algo, const at::Tensor& bias,
                                       const at::Tensor& multiplier, const at::Tensor& shift, int64_t qmin,
                                       int64_t qmax, bool is_signed) {
  static const auto conv = lut_conv2d_op();
  static const auto req = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("approx::requantize_codes", "")
                              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, int64_t, int64_t, bool)>();
  return req.call(conv.call(a, w, lut, stride, padding, dilation, groups, algo), bias, multiplier, shift, qmin, qmax,
                  is_signed);
}

}  // namespace approx_fused

// The CPU kernels are the composite itself: the CPU LUT kernels have no store to put the end in.
TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("lut_conv2d_dequantize", &approx_fused::lut_conv2d_dequantize);
  m.impl("lut_conv2d_requantize_codes", &approx_fused::lut_conv2d_requantize_codes);
}
