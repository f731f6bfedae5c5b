// The quant ops' arithmetic for one value (../ops.cpp), shared by their kernels (quant_cuda.cu) and by the LUT
// kernels that apply a layer's end in their own stores (expanded_window, expanded_gemm): the same intrinsics, so the
// same bits.
// The _rn intrinsics fix each float operation to one IEEE round-to-nearest step.
#pragma once
#include <cstdint>

namespace approx_cuda {

// quantize's arithmetic for one value, the code as a float (every kernel that writes activation codes uses it)
__device__ __forceinline__ float quantized(float v, float inv, float qmin, float qmax) {
  return fminf(fmaxf(rintf(__fmul_rn(v, inv)), qmin), qmax);
}

// Where dequantize also writes the next layer's codes: their scale and range, and quantized's low byte of a value.
struct CodesOut {
  const float* scale = nullptr;  // null: no codes
  float qmin = 0.f, qmax = 0.f;
  __device__ __forceinline__ float inv() const { return scale ? __fdiv_rn(1.0f, *scale) : 0.f; }
  __device__ __forceinline__ uint32_t byte(float v, float inv) const {
    return static_cast<uint32_t>(static_cast<int>(quantized(v, inv, qmin, qmax))) & 0xFFu;
  }
};

// add (a residual r) and relu: the residual block's add and ReLU (../ops.cpp), the add one more rounding.
__device__ __forceinline__ float dequant_one(int32_t acc, float scale, float b, bool add, float r, bool relu) {
  float v = __fadd_rn(__fmul_rn(__int2float_rn(acc), scale), b);
  if (add) v = __fadd_rn(v, r);
  return relu && v < 0.0f ? 0.0f : v;  // not fmaxf: NaN and -0.0 stay, as torch.relu keeps them
}

__device__ __forceinline__ int requant_code(int32_t acc, int32_t bias, int32_t multiplier, int32_t shift, int64_t qmin,
                                            int64_t qmax) {
  const int s = min(max(shift, 1), 63);  // the documented range; a shift outside it is UB
  const int64_t p = (static_cast<int64_t>(acc) + bias) * static_cast<int64_t>(multiplier);
  const int64_t code = ((p >> (s - 1)) + 1) >> 1;
  return static_cast<int>(code < qmin ? qmin : (code > qmax ? qmax : code));
}

}  // namespace approx_cuda
