// CUDA kernels for approx::quantize, approx::dequantize (with a residual block's add and ReLU), approx::requantize
// and requantize_codes (arithmetic: see ../ops.cpp).
// The _rn intrinsics fix each float operation to one IEEE round-to-nearest step, whatever
// --use_fast_math or FMA contraction would otherwise do, so results equal the CPU kernels.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "../checks.h"
#include "common.cuh"

namespace {

using approx_checks::check_nonfinite_flag;
using approx_checks::check_scale;

template <typename T>
__global__ void quantize_kernel(const float* __restrict__ x, const float* __restrict__ scale, T* __restrict__ out,
                                int64_t n, float qmin, float qmax, bool* __restrict__ nonfinite) {
  const float inv = __fdiv_rn(1.0f, *scale);
  bool bad = false;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    // all exponent bits set: Inf or NaN. A bit test, as --use_fast_math may fold isfinite() to true.
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    const float q = rintf(__fmul_rn(v, inv));
    out[i] = static_cast<T>(fminf(fmaxf(q, qmin), qmax));
  }
  if (bad && nonfinite != nullptr) *nonfinite = true;  // every writer stores the same value: no atomic needed
}

// Four elements a thread, as 16-byte loads and stores, where the rows are whole vectors (inner % 4 == 0) and
// there are fewer than 2^31 vectors: the channel comes from 32-bit multiply-high divisions, where the per-element
// 64-bit division of the kernels below cost about half their time (ResNet-20's dequantize at batch 1,000 ran at
// half the memory bandwidth). The arithmetic per element is theirs.
// add (a residual r) and relu: the residual block's add and ReLU (../ops.cpp), the add one more rounding.
__device__ __forceinline__ float dequant_one(int32_t acc, float scale, float b, bool add, float r, bool relu) {
  float v = __fadd_rn(__fmul_rn(__int2float_rn(acc), scale), b);
  if (add) v = __fadd_rn(v, r);
  return relu && v < 0.0f ? 0.0f : v;  // not fmaxf: NaN and -0.0 stay, as torch.relu keeps them
}

__global__ void dequantize_vec4_kernel(const int4* __restrict__ acc, const float* __restrict__ sa,
                                       const float* __restrict__ sw, const float* __restrict__ bias,
                                       const float4* __restrict__ residual, bool relu, float4* __restrict__ out,
                                       unsigned nvec, approx_cuda::FastDiv per_row, approx_cuda::FastDiv channels) {
  const float a = *sa;
  const bool add = residual != nullptr;
  for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += gridDim.x * blockDim.x) {
    const unsigned row = approx_cuda::fdiv(v, per_row);
    const unsigned c = row - approx_cuda::fdiv(row, channels) * channels.d;
    const float scale = __fmul_rn(a, sw[c]), b = bias[c];
    const int4 q = acc[v];
    const float4 r = add ? residual[v] : make_float4(0.f, 0.f, 0.f, 0.f);
    out[v] = make_float4(dequant_one(q.x, scale, b, add, r.x, relu), dequant_one(q.y, scale, b, add, r.y, relu),
                         dequant_one(q.z, scale, b, add, r.z, relu), dequant_one(q.w, scale, b, add, r.w, relu));
  }
}

__device__ __forceinline__ int requant_code(int32_t acc, int32_t bias, int32_t multiplier, int32_t shift, int64_t qmin,
                                            int64_t qmax) {
  const int s = min(max(shift, 1), 63);  // the documented range; a shift outside it is UB
  const int64_t p = (static_cast<int64_t>(acc) + bias) * static_cast<int64_t>(multiplier);
  const int64_t code = ((p >> (s - 1)) + 1) >> 1;
  return static_cast<int>(code < qmin ? qmin : (code > qmax ? qmax : code));
}

__device__ __forceinline__ float requant_one(int32_t acc, int32_t bias, int32_t multiplier, int32_t shift, float os,
                                             int64_t qmin, int64_t qmax) {
  return __fmul_rn(__int2float_rn(requant_code(acc, bias, multiplier, shift, qmin, qmax)), os);
}

// requantize_codes: a thread's 4 codes as one 4-byte store (the low byte of each code, int8 or uint8 alike)
__global__ void requantize_codes_vec4_kernel(const int4* __restrict__ acc, const int32_t* __restrict__ bias,
                                             const int32_t* __restrict__ multiplier,
                                             const int32_t* __restrict__ shift, uint32_t* __restrict__ out,
                                             unsigned nvec, approx_cuda::FastDiv per_row,
                                             approx_cuda::FastDiv channels, int64_t qmin, int64_t qmax) {
  for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += gridDim.x * blockDim.x) {
    const unsigned row = approx_cuda::fdiv(v, per_row);
    const unsigned c = row - approx_cuda::fdiv(row, channels) * channels.d;
    const int32_t b = bias[c], m = multiplier[c], sh = shift[c];
    const int4 q = acc[v];
    auto byte = [&](int32_t a) { return static_cast<uint32_t>(requant_code(a, b, m, sh, qmin, qmax)) & 0xFFu; };
    out[v] = byte(q.x) | byte(q.y) << 8 | byte(q.z) << 16 | byte(q.w) << 24;
  }
}

template <typename T>
__global__ void requantize_codes_kernel(const int32_t* __restrict__ acc, const int32_t* __restrict__ bias,
                                        const int32_t* __restrict__ multiplier, const int32_t* __restrict__ shift,
                                        T* __restrict__ out, int64_t total, int64_t n, int64_t inner, int64_t qmin,
                                        int64_t qmax) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / inner) % n;
    out[i] = static_cast<T>(requant_code(acc[i], bias[c], multiplier[c], shift[c], qmin, qmax));
  }
}

__global__ void requantize_vec4_kernel(const int4* __restrict__ acc, const int32_t* __restrict__ bias,
                                       const int32_t* __restrict__ multiplier, const int32_t* __restrict__ shift,
                                       const float* __restrict__ out_scale, float4* __restrict__ out, unsigned nvec,
                                       approx_cuda::FastDiv per_row, approx_cuda::FastDiv channels, int64_t qmin,
                                       int64_t qmax) {
  const float os = *out_scale;
  for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += gridDim.x * blockDim.x) {
    const unsigned row = approx_cuda::fdiv(v, per_row);
    const unsigned c = row - approx_cuda::fdiv(row, channels) * channels.d;
    const int32_t b = bias[c], m = multiplier[c], sh = shift[c];
    const int4 q = acc[v];
    out[v] = make_float4(requant_one(q.x, b, m, sh, os, qmin, qmax), requant_one(q.y, b, m, sh, os, qmin, qmax),
                         requant_one(q.z, b, m, sh, os, qmin, qmax), requant_one(q.w, b, m, sh, os, qmin, qmax));
  }
}

// Whether the vec4 kernels take a [B, N, inner] tensor of `total` elements.
bool vec4_rows(const at::Tensor& acc, int64_t total, int64_t inner, const at::Tensor& out) {
  return inner % 4 == 0 && total / 4 < (1ll << 31) && acc.size(1) < (1ll << 31) &&
         reinterpret_cast<uintptr_t>(acc.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
}

// quantize_kernel four elements a thread: a 16-byte load, a 4-byte store of the codes (n % 4 == 0, aligned).
template <typename T>
__global__ void quantize_vec4_kernel(const float4* __restrict__ x, const float* __restrict__ scale,
                                     uint32_t* __restrict__ out, int64_t nvec, float qmin, float qmax,
                                     bool* __restrict__ nonfinite) {
  const float inv = __fdiv_rn(1.0f, *scale);
  bool bad = false;
  auto one = [&](float v) {
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    const float q = rintf(__fmul_rn(v, inv));
    return static_cast<uint32_t>(static_cast<uint8_t>(static_cast<T>(fminf(fmaxf(q, qmin), qmax))));
  };
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nvec; i += (int64_t)gridDim.x * blockDim.x) {
    const float4 v = x[i];
    out[i] = one(v.x) | (one(v.y) << 8) | (one(v.z) << 16) | (one(v.w) << 24);
  }
  if (bad && nonfinite != nullptr) *nonfinite = true;
}

__global__ void dequantize_kernel(const int32_t* __restrict__ acc, const float* __restrict__ sa,
                                  const float* __restrict__ sw, const float* __restrict__ bias,
                                  const float* __restrict__ residual, bool relu, float* __restrict__ out,
                                  int64_t total, int64_t n, int64_t inner) {
  const float a = *sa;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / inner) % n;
    const bool add = residual != nullptr;
    out[i] = dequant_one(acc[i], __fmul_rn(a, sw[c]), bias[c], add, add ? residual[i] : 0.f, relu);
  }
}

// Integer only up to the last step, so nothing for nvcc to contract; the code (|code| <= 255, exact as a
// float) times the scale is one round-to-nearest multiply, as on the CPU.
__global__ void requantize_kernel(const int32_t* __restrict__ acc, const int32_t* __restrict__ bias,
                                  const int32_t* __restrict__ multiplier, const int32_t* __restrict__ shift,
                                  const float* __restrict__ out_scale, float* __restrict__ out, int64_t total,
                                  int64_t n, int64_t inner, int64_t qmin, int64_t qmax) {
  const float os = *out_scale;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / inner) % n;
    out[i] = requant_one(acc[i], bias[c], multiplier[c], shift[c], os, qmin, qmax);
  }
}

// Messages are built from std::string pieces only (approx_checks::T, I): streaming integers or ATen
// types into TORCH_CHECK from nvcc-compiled code crashed under torch 2.11 (see ../checks.h).
dim3 grid_for(int64_t n) {
  return dim3(static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535 * 4)));
}

at::Tensor quantize_cuda(const at::Tensor& x, const at::Tensor& scale, bool is_signed,
                         const std::optional<at::Tensor>& nonfinite) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, std::string("quantize: `x` must be float32, got ") + approx_checks::T(x));
  TORCH_CHECK(x.is_contiguous(), "quantize: `x` must be contiguous");
  check_scale("quantize", scale, x, 1, "scale");
  check_nonfinite_flag(nonfinite, x);
  bool* flag = nonfinite ? nonfinite->data_ptr<bool>() : nullptr;
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty(x.sizes(), x.options().dtype(is_signed ? at::kChar : at::kByte));
  const int64_t n = x.numel();
  if (n == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0) {
    const int64_t nvec = n / 4;
    auto* xv = reinterpret_cast<const float4*>(x.data_ptr<float>());
    auto* ov = reinterpret_cast<uint32_t*>(out.data_ptr());
    if (is_signed)
      quantize_vec4_kernel<int8_t><<<grid_for(nvec), 256, 0, stream>>>(xv, scale.data_ptr<float>(), ov, nvec, -128.f,
                                                                       127.f, flag);
    else
      quantize_vec4_kernel<uint8_t><<<grid_for(nvec), 256, 0, stream>>>(xv, scale.data_ptr<float>(), ov, nvec, 0.f,
                                                                        255.f, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  if (is_signed)
    quantize_kernel<int8_t><<<grid_for(n), 256, 0, stream>>>(x.data_ptr<float>(), scale.data_ptr<float>(),
                                                             out.data_ptr<int8_t>(), n, -128.f, 127.f, flag);
  else
    quantize_kernel<uint8_t><<<grid_for(n), 256, 0, stream>>>(x.data_ptr<float>(), scale.data_ptr<float>(),
                                                              out.data_ptr<uint8_t>(), n, 0.f, 255.f, flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor dequantize_cuda(const at::Tensor& acc, const at::Tensor& act_scale, const at::Tensor& weight_scale,
                           const at::Tensor& bias, const std::optional<at::Tensor>& residual, bool relu) {
  const int64_t n = approx_checks::check_dequantize(acc, act_scale, weight_scale, bias);
  approx_checks::check_residual(residual, acc);
  const c10::cuda::CUDAGuard guard(acc.device());
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  const int64_t total = acc.numel();
  if (total == 0) return out;
  const int64_t inner = approx_checks::plane_size(acc);
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  if (vec4_rows(acc, total, inner, out) && reinterpret_cast<uintptr_t>(res) % 16 == 0) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    dequantize_vec4_kernel<<<grid_for(nvec), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), act_scale.data_ptr<float>(),
        weight_scale.data_ptr<float>(), bias.data_ptr<float>(), reinterpret_cast<const float4*>(res), relu,
        reinterpret_cast<float4*>(out.data_ptr<float>()), nvec,
        approx_cuda::make_fastdiv(static_cast<unsigned>(inner / 4)),
        approx_cuda::make_fastdiv(static_cast<unsigned>(n)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  dequantize_kernel<<<grid_for(total), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      acc.data_ptr<int32_t>(), act_scale.data_ptr<float>(), weight_scale.data_ptr<float>(),
      bias.data_ptr<float>(), res, relu, out.data_ptr<float>(), total, n, inner);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor requantize_cuda(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                           const at::Tensor& shift, const at::Tensor& out_scale, int64_t qmin, int64_t qmax) {
  const int64_t n = approx_checks::check_requantize(acc, bias, multiplier, shift, out_scale, qmin, qmax);
  const c10::cuda::CUDAGuard guard(acc.device());
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  const int64_t total = acc.numel();
  if (total == 0) return out;
  const int64_t inner = approx_checks::plane_size(acc);
  if (vec4_rows(acc, total, inner, out)) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    requantize_vec4_kernel<<<grid_for(nvec), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), bias.data_ptr<int32_t>(),
        multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(), out_scale.data_ptr<float>(),
        reinterpret_cast<float4*>(out.data_ptr<float>()), nvec,
        approx_cuda::make_fastdiv(static_cast<unsigned>(inner / 4)),
        approx_cuda::make_fastdiv(static_cast<unsigned>(n)), qmin, qmax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  requantize_kernel<<<grid_for(total), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      acc.data_ptr<int32_t>(), bias.data_ptr<int32_t>(), multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(),
      out_scale.data_ptr<float>(), out.data_ptr<float>(), total, n, inner, qmin, qmax);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor requantize_codes_cuda(const at::Tensor& acc, const at::Tensor& bias, const at::Tensor& multiplier,
                                 const at::Tensor& shift, int64_t qmin, int64_t qmax, bool is_signed) {
  const int64_t n = approx_checks::check_requantize_codes(acc, bias, multiplier, shift, qmin, qmax, is_signed);
  const c10::cuda::CUDAGuard guard(acc.device());
  auto out = at::empty(acc.sizes(), acc.options().dtype(is_signed ? at::kChar : at::kByte));
  const int64_t total = acc.numel();
  if (total == 0) return out;
  const int64_t inner = approx_checks::plane_size(acc);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (vec4_rows(acc, total, inner, out)) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    requantize_codes_vec4_kernel<<<grid_for(nvec), 256, 0, stream>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), bias.data_ptr<int32_t>(),
        multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(), reinterpret_cast<uint32_t*>(out.data_ptr()), nvec,
        approx_cuda::make_fastdiv(static_cast<unsigned>(inner / 4)),
        approx_cuda::make_fastdiv(static_cast<unsigned>(n)), qmin, qmax);
  } else if (is_signed) {
    requantize_codes_kernel<int8_t><<<grid_for(total), 256, 0, stream>>>(
        acc.data_ptr<int32_t>(), bias.data_ptr<int32_t>(), multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(),
        out.data_ptr<int8_t>(), total, n, inner, qmin, qmax);
  } else {
    requantize_codes_kernel<uint8_t><<<grid_for(total), 256, 0, stream>>>(
        acc.data_ptr<int32_t>(), bias.data_ptr<int32_t>(), multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(),
        out.data_ptr<uint8_t>(), total, n, inner, qmin, qmax);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("requantize", &requantize_cuda);
  m.impl("requantize_codes", &requantize_codes_cuda);
}
