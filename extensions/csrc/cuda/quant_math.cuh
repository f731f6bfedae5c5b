// The quant ops' arithmetic for one value (../ops.cpp), shared by their kernels (quant_cuda.cu) and by the LUT
// kernels that apply a layer's end in their own stores (expanded_window, expanded_gemm): the same intrinsics, so the
// same bits.
// The _rn intrinsics fix each float operation to one IEEE round-to-nearest step.
#pragma once
#include <cstdint>

#include "common.cuh"  // Epi

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

// A conv's end (Epi) in place of the sum acc at `at`: dequantize's arithmetic (KIND 1: residual, ReLU, the next
// layer's codes) or requantize_codes' (KIND 2), one value a store; the LUT kernels' stores where no wider store fits.
template <int KIND>
__device__ __forceinline__ void end_one(const Epi& e, long long at, int32_t acc, float scale, float bias,
                                        const CodesOut& co, float inv, int32_t qb, int32_t mult, int32_t shift) {
  if constexpr (KIND == 1) {
    const bool add = e.residual != nullptr;
    const float f = dequant_one(acc, scale, bias, add, add ? e.residual[at] : 0.f, e.relu);
    e.outf[at] = f;
    if (e.codes) e.codes[at] = static_cast<uint8_t>(co.byte(f, inv));
  } else {
    e.codes[at] = static_cast<uint8_t>(requant_code(acc, qb, mult, shift, e.qmin, e.qmax));
  }
}

}  // namespace approx_cuda
