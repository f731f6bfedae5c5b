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
#include "kernels.h"
#include "quant_math.cuh"

namespace {

using approx_cuda::CodesOut;
using approx_cuda::dequant_one;
using approx_cuda::quantized;
using approx_cuda::requant_code;
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
    out[i] = static_cast<T>(quantized(v, inv, qmin, qmax));
  }
  if (bad && nonfinite != nullptr) *nonfinite = true;  // every writer stores the same value: no atomic needed
}

// The vector kernels below take four consecutive elements a step (16-byte loads of floats or int32 sums). Those that
// read one stream (quantize, requantize, requantize_codes) take two steps a loop iteration, both steps' loads issued
// before either's stores, over a grid of at most 8 blocks an SM (stream_grid) whose threads loop, so a thread's set-up
// (quantize's reciprocal) serves many steps: on an H200 quantize went from 3.3 to 4.0 TB/s. dequantize, which reads
// two (the sums and a residual), ran 5 % slower so and keeps one step a thread over as many threads as steps.
template <int kSteps, class Load, class Store>
__device__ __forceinline__ void grid_loop(unsigned nvec, Load load, Store store) {
  const unsigned stride = gridDim.x * blockDim.x;  // nvec < 2^31 and kSteps * stride < 2^31: no sum below wraps
  for (unsigned v = blockIdx.x * blockDim.x + threadIdx.x; v < nvec; v += kSteps * stride) {
    if (kSteps == 1) {
      store(v, load(v));
      continue;
    }
    const bool two = v + stride < nvec;
    const auto a = load(v);
    const auto b = load(two ? v + stride : v);
    store(v, a);
    if (two) store(v + stride, b);
  }
}

// The channels of step v's four elements, of rows of `per` elements (kPlane: rows of `per` steps, inner % 4 == 0, one
// channel for all four) cycling through `channels`: 32-bit multiply-high divisions, where the per-element 64-bit
// division of the scalar kernels cost about half their time (ResNet-20's dequantize ran at half the bandwidth).
template <bool kPlane>
__device__ __forceinline__ uint4 channels4(unsigned v, const approx_cuda::FastDiv& per,
                                           const approx_cuda::FastDiv& channels) {
  auto of = [&](unsigned i) {
    const unsigned row = approx_cuda::fdiv(i, per);
    return row - approx_cuda::fdiv(row, channels) * channels.d;
  };
  if (kPlane) {
    const unsigned c = of(v);
    return make_uint4(c, c, c, c);
  }
  return make_uint4(of(4 * v), of(4 * v + 1), of(4 * v + 2), of(4 * v + 3));
}


template <bool kPlane>
__global__ void dequantize_vec4_kernel(const int4* __restrict__ acc, const float* __restrict__ sa,
                                       const float* __restrict__ sw, const float* __restrict__ bias,
                                       const float4* __restrict__ residual, bool relu, float4* __restrict__ out,
                                       uint32_t* __restrict__ codes, CodesOut co, unsigned nvec,
                                       approx_cuda::FastDiv per, approx_cuda::FastDiv channels) {
  const float a = *sa, inv = co.inv();
  const bool add = residual != nullptr;
  struct In {
    int4 q;
    float4 r;
  };
  grid_loop<1>(
      nvec, [&](unsigned v) { return In{acc[v], add ? residual[v] : make_float4(0.f, 0.f, 0.f, 0.f)}; },
      [&](unsigned v, const In& in) {
        const uint4 c = channels4<kPlane>(v, per, channels);
        auto one = [&](int32_t q, unsigned ch, float r) {
          return dequant_one(q, __fmul_rn(a, sw[ch]), bias[ch], add, r, relu);
        };
        const float4 f = make_float4(one(in.q.x, c.x, in.r.x), one(in.q.y, c.y, in.r.y), one(in.q.z, c.z, in.r.z),
                                     one(in.q.w, c.w, in.r.w));
        out[v] = f;
        if (codes != nullptr)
          codes[v] = co.byte(f.x, inv) | co.byte(f.y, inv) << 8 | co.byte(f.z, inv) << 16 | co.byte(f.w, inv) << 24;
      });
}


__device__ __forceinline__ float requant_one(int32_t acc, int32_t bias, int32_t multiplier, int32_t shift, float os,
                                             int64_t qmin, int64_t qmax) {
  return __fmul_rn(__int2float_rn(requant_code(acc, bias, multiplier, shift, qmin, qmax)), os);
}

// requantize_codes: a step's 4 codes as one 4-byte store (the low byte of each code, int8 or uint8 alike)
template <bool kPlane>
__global__ void __launch_bounds__(256, 8)
    requantize_codes_vec4_kernel(const int4* __restrict__ acc, const int32_t* __restrict__ bias,
                                 const int32_t* __restrict__ multiplier, const int32_t* __restrict__ shift,
                                 uint32_t* __restrict__ out, unsigned nvec, approx_cuda::FastDiv per,
                                 approx_cuda::FastDiv channels, int64_t qmin, int64_t qmax) {
  grid_loop<2>(
      nvec, [&](unsigned v) { return acc[v]; },
      [&](unsigned v, const int4& q) {
        const uint4 c = channels4<kPlane>(v, per, channels);
        auto byte = [&](int32_t a, unsigned ch) {
          return static_cast<uint32_t>(requant_code(a, bias[ch], multiplier[ch], shift[ch], qmin, qmax)) & 0xFFu;
        };
        out[v] = byte(q.x, c.x) | byte(q.y, c.y) << 8 | byte(q.z, c.z) << 16 | byte(q.w, c.w) << 24;
      });
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

template <bool kPlane>
__global__ void __launch_bounds__(256, 8)
    requantize_vec4_kernel(const int4* __restrict__ acc, const int32_t* __restrict__ bias,
                           const int32_t* __restrict__ multiplier, const int32_t* __restrict__ shift,
                           const float* __restrict__ out_scale, float4* __restrict__ out, unsigned nvec,
                           approx_cuda::FastDiv per, approx_cuda::FastDiv channels, int64_t qmin, int64_t qmax) {
  const float os = *out_scale;
  grid_loop<2>(
      nvec, [&](unsigned v) { return acc[v]; },
      [&](unsigned v, const int4& q) {
        const uint4 c = channels4<kPlane>(v, per, channels);
        auto one = [&](int32_t a, unsigned ch) {
          return requant_one(a, bias[ch], multiplier[ch], shift[ch], os, qmin, qmax);
        };
        out[v] = make_float4(one(q.x, c.x), one(q.y, c.y), one(q.z, c.z), one(q.w, c.w));
      });
}

// How the vector kernels take a [B, N, inner] tensor of `total` elements: not at all (the scalar kernels), by planes
// (inner % 4 == 0: a step's elements share a channel), or element by element (total % 4 == 0: a Linear layer's
// [M, N], a 7x7 plane). Element indices are 32-bit there.
enum class Vec4 { kNo, kPlane, kElement };
Vec4 vec4_plan(const at::Tensor& acc, int64_t total, int64_t inner, const at::Tensor& out) {
  const bool aligned = reinterpret_cast<uintptr_t>(acc.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && acc.size(1) < (1ll << 31);
  if (!aligned || total % 4 || total / 4 >= (1ll << 31)) return Vec4::kNo;
  if (inner % 4 == 0) return Vec4::kPlane;
  return total < (1ll << 32) ? Vec4::kElement : Vec4::kNo;
}

// The FastDivs of vec4_plan's kernels: rows of inner / 4 steps, or of inner elements.
std::pair<approx_cuda::FastDiv, approx_cuda::FastDiv> vec4_divs(Vec4 plan, int64_t inner, int64_t n) {
  return {approx_cuda::make_fastdiv(static_cast<unsigned>(plan == Vec4::kPlane ? inner / 4 : inner)),
          approx_cuda::make_fastdiv(static_cast<unsigned>(n))};
}

// Blocks of 256 threads for grid_loop<2> over nvec steps: one step a thread, at most 8 blocks an SM (the vector
// kernels' __launch_bounds__ keep them within 32 registers, so all 8 are resident at once: no second wave).
dim3 stream_grid(int64_t nvec) {
  const int64_t sms = approx_cuda::sm_count();
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((nvec + 255) / 256, sms * 8))));
}

// quantize_kernel four elements a step: a 16-byte load, a 4-byte store of the codes (n % 4 == 0, aligned).
template <typename T>
__global__ void __launch_bounds__(256, 8)
    quantize_vec4_kernel(const float4* __restrict__ x, const float* __restrict__ scale, uint32_t* __restrict__ out,
                         unsigned nvec, float qmin, float qmax, bool* __restrict__ nonfinite) {
  const float inv = __fdiv_rn(1.0f, *scale);
  bool bad = false;
  auto one = [&](float v) {
    bad |= (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
    return static_cast<uint32_t>(static_cast<uint8_t>(static_cast<T>(quantized(v, inv, qmin, qmax))));
  };
  grid_loop<2>(
      nvec, [&](unsigned v) { return x[v]; },
      [&](unsigned v, const float4& f) { out[v] = one(f.x) | (one(f.y) << 8) | (one(f.z) << 16) | (one(f.w) << 24); });
  if (bad && nonfinite != nullptr) *nonfinite = true;
}

__global__ void dequantize_kernel(const int32_t* __restrict__ acc, const float* __restrict__ sa,
                                  const float* __restrict__ sw, const float* __restrict__ bias,
                                  const float* __restrict__ residual, bool relu, float* __restrict__ out,
                                  uint8_t* __restrict__ codes, CodesOut co, int64_t total, int64_t n, int64_t inner) {
  const float a = *sa, inv = co.inv();
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t c = (i / inner) % n;
    const bool add = residual != nullptr;
    const float f = dequant_one(acc[i], __fmul_rn(a, sw[c]), bias[c], add, add ? residual[i] : 0.f, relu);
    out[i] = f;
    if (codes != nullptr) codes[i] = static_cast<uint8_t>(co.byte(f, inv));
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
  if (n % 4 == 0 && n / 4 < (1ll << 31) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0) {
    const unsigned nvec = static_cast<unsigned>(n / 4);
    auto* xv = reinterpret_cast<const float4*>(x.data_ptr<float>());
    auto* ov = reinterpret_cast<uint32_t*>(out.data_ptr());
    if (is_signed)
      quantize_vec4_kernel<int8_t><<<stream_grid(nvec), 256, 0, stream>>>(xv, scale.data_ptr<float>(), ov, nvec,
                                                                          -128.f, 127.f, flag);
    else
      quantize_vec4_kernel<uint8_t><<<stream_grid(nvec), 256, 0, stream>>>(xv, scale.data_ptr<float>(), ov, nvec,
                                                                           0.f, 255.f, flag);
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
                           const at::Tensor& bias, const std::optional<at::Tensor>& residual, bool relu,
                           const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& codes_scale) {
  const int64_t n = approx_checks::check_dequantize(acc, act_scale, weight_scale, bias);
  approx_checks::check_residual(residual, acc);
  approx_checks::check_dequantize_codes(codes, codes_scale, acc);
  const c10::cuda::CUDAGuard guard(acc.device());
  auto out = at::empty(acc.sizes(), acc.options().dtype(at::kFloat));
  const int64_t total = acc.numel();
  if (total == 0) return out;
  const int64_t inner = approx_checks::plane_size(acc);
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  CodesOut co;
  uint8_t* cp = nullptr;
  if (codes) {
    const bool is_signed = codes->scalar_type() == at::kChar;
    co = CodesOut{codes_scale->data_ptr<float>(), is_signed ? -128.f : 0.f, is_signed ? 127.f : 255.f};
    cp = reinterpret_cast<uint8_t*>(codes->data_ptr());
  }
  const bool aligned = reinterpret_cast<uintptr_t>(res) % 16 == 0 && reinterpret_cast<uintptr_t>(cp) % 4 == 0;
  const Vec4 plan = aligned ? vec4_plan(acc, total, inner, out) : Vec4::kNo;
  if (plan != Vec4::kNo) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    const auto [per, channels] = vec4_divs(plan, inner, n);
    auto kern = plan == Vec4::kPlane ? dequantize_vec4_kernel<true> : dequantize_vec4_kernel<false>;
    kern<<<grid_for(nvec), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), act_scale.data_ptr<float>(),
        weight_scale.data_ptr<float>(), bias.data_ptr<float>(), reinterpret_cast<const float4*>(res), relu,
        reinterpret_cast<float4*>(out.data_ptr<float>()), reinterpret_cast<uint32_t*>(cp), co, nvec, per, channels);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  dequantize_kernel<<<grid_for(total), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      acc.data_ptr<int32_t>(), act_scale.data_ptr<float>(), weight_scale.data_ptr<float>(),
      bias.data_ptr<float>(), res, relu, out.data_ptr<float>(), cp, co, total, n, inner);
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
  const Vec4 plan = vec4_plan(acc, total, inner, out);
  if (plan != Vec4::kNo) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    const auto [per, channels] = vec4_divs(plan, inner, n);
    auto kern = plan == Vec4::kPlane ? requantize_vec4_kernel<true> : requantize_vec4_kernel<false>;
    kern<<<stream_grid(nvec), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), bias.data_ptr<int32_t>(),
        multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(), out_scale.data_ptr<float>(),
        reinterpret_cast<float4*>(out.data_ptr<float>()), nvec, per, channels, qmin, qmax);
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
  const Vec4 plan = vec4_plan(acc, total, inner, out);
  if (plan != Vec4::kNo) {
    const unsigned nvec = static_cast<unsigned>(total / 4);
    const auto [per, channels] = vec4_divs(plan, inner, n);
    auto kern = plan == Vec4::kPlane ? requantize_codes_vec4_kernel<true> : requantize_codes_vec4_kernel<false>;
    kern<<<stream_grid(nvec), 256, 0, stream>>>(
        reinterpret_cast<const int4*>(acc.data_ptr<int32_t>()), bias.data_ptr<int32_t>(),
        multiplier.data_ptr<int32_t>(), shift.data_ptr<int32_t>(), reinterpret_cast<uint32_t*>(out.data_ptr()), nvec,
        per, channels, qmin, qmax);
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
