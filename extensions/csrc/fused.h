// A conv layer and its end in one op (ops.cpp: approx::lut_conv2d_dequantize, approx::lut_conv2d_requantize_codes):
// the composite that runs lut_conv2d and then the end's own op, which every backend registers, and which the CUDA
// kernel falls back to where the variant it runs cannot apply the end in its stores.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace approx_fused {

inline auto lut_conv2d_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("approx::lut_conv2d", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef,
                        c10::IntArrayRef, int64_t, c10::string_view)>();
}

at::Tensor lut_conv2d_dequantize(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                 c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                 int64_t groups, c10::string_view algo, const at::Tensor& act_scale,
                                 const at::Tensor& weight_scale, const at::Tensor& bias,
                                 const std::optional<at::Tensor>& residual, bool relu,
                                 const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& codes_scale);

at::Tensor lut_conv2d_requantize_codes(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                       int64_t groups, c10::string_view algo, const at::Tensor& bias,
                                       const at::Tensor& multiplier, const at::Tensor& shift, int64_t qmin,
                                       int64_t qmax, bool is_signed);

}  // namespace approx_fused
