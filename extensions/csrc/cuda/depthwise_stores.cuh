// depthwise_rows' stores (depthwise_rows.cu): a task's R sums of one output row, as int32 sums (EPI 0) or with the
// conv's end in their place (EPI 1: dequantize's floats and the next layer's codes, with a residual and ReLU;
// EPI 2: requantize_codes' codes of a hand-off), so that the int32 sums are neither written nor read back.
#pragma once
#include <cstdint>
#include <type_traits>

#include "quant_math.cuh"

namespace approx_cuda {

// Seven consecutive 4-byte (T uint32_t) or 1-byte (uint8_t) values at o: three 8-byte stores and one 4-byte store,
// or for bytes three 2-byte stores and one byte, where seven single stores sent a warp's 7 x 32 values to L2 as 49
// line requests (4-byte values): 28 now. A run starts on an even value (offset 7 (2k) = 14 k) or one past it.
template <class T>
__device__ __forceinline__ void store7(T* o, const uint32_t (&v)[7]) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 1, "4-byte values or bytes");
  using T2 = std::conditional_t<sizeof(T) == 4, uint2, uint16_t>;
  const auto two = [](uint32_t a, uint32_t b) {
    if constexpr (sizeof(T) == 4) return make_uint2(a, b);
    else return static_cast<uint16_t>((a & 0xffu) | (b & 0xffu) << 8);
  };
  const bool odd = (reinterpret_cast<uintptr_t>(o) & sizeof(T)) != 0;
  *(odd ? o : o + 6) = static_cast<T>(odd ? v[0] : v[6]);
  T2* o2 = reinterpret_cast<T2*>(odd ? o + 1 : o);
#pragma unroll
  for (int k = 0; k < 3; ++k) o2[k] = odd ? two(v[2 * k + 1], v[2 * k + 2]) : two(v[2 * k], v[2 * k + 1]);
}

// R values at o, n of them inside the row: the widest aligned stores for whole runs (8: two 16-byte stores of 4-byte
// values or one 8-byte store of bytes; 7: store7), one value a store otherwise.
template <int R, class T>
__device__ __forceinline__ void store_run(T* o, int n, const uint32_t (&v)[R]) {
  if (n == R) {
    if constexpr (R == 7) {
      store7(o, v);
    } else {
      if constexpr (R == 8) {
        if (reinterpret_cast<uintptr_t>(o) % (sizeof(T) == 4 ? 16 : 8) == 0) {
          if constexpr (sizeof(T) == 4) {
            reinterpret_cast<uint4*>(o)[0] = make_uint4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<uint4*>(o)[1] = make_uint4(v[4], v[5], v[6], v[7]);
          } else {
            uint32_t lo = 0, hi = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) lo |= (v[j] & 0xffu) << 8 * j, hi |= (v[4 + j] & 0xffu) << 8 * j;
            *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
          }
          return;
        }
      }
#pragma unroll
      for (int j = 0; j < R; ++j) o[j] = static_cast<T>(v[j]);  // no test a store where the row holds the run
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < R; ++j)
    if (j < n) o[j] = static_cast<T>(v[j]);
}

// A channel's end: what every task of a block (one channel) applies, read once a block.
struct DrEnd {
  float scale, bias, inv;  // EPI 1: act_scale * wscale[ch], bias[ch]; 1 / the codes' scale
  int32_t qb, mult, shift;  // EPI 2
  CodesOut co;
};

template <int EPI>
__device__ __forceinline__ DrEnd dr_end(const Epi& e, int ch) {
  DrEnd d{};
  if constexpr (EPI == 1) {
    d.scale = __fmul_rn(*e.act_scale, e.wscale[ch]);
    d.bias = e.bias[ch];
    d.co = CodesOut{e.codes_scale, e.cqmin, e.cqmax};
    d.inv = d.co.inv();
  } else if constexpr (EPI == 2) {
    d.qb = e.qbias[ch], d.mult = e.mult[ch], d.shift = e.shift[ch];
  }
  return d;
}

// The task's R sums for outputs at .. at + n - 1 (element offsets in the [B, C, Ho, Wo] output), with the end EPI.
template <int R, int EPI>
__device__ __forceinline__ void dr_store(const Params& p, const DrEnd& d, long long at, int n, uint32_t (&acc)[R]) {
  const Epi& e = p.epi;
  if constexpr (EPI == 0) {
    store_run<R>(p.out + at, n, acc);
  } else if constexpr (EPI == 2) {
#pragma unroll
    for (int j = 0; j < R; ++j)
      acc[j] = static_cast<uint32_t>(requant_code(static_cast<int32_t>(acc[j]), d.qb, d.mult, d.shift, e.qmin, e.qmax));
    store_run<R>(e.codes + at, n, acc);
  } else {
    const bool add = e.residual != nullptr;
    uint32_t f[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {  // the residual a value a load: 7- and 8-wide loads measured slower
      const float r = add && j < n ? e.residual[at + j] : 0.f;
      f[j] = __float_as_uint(dequant_one(static_cast<int32_t>(acc[j]), d.scale, d.bias, add, r, e.relu));
    }
    store_run<R>(reinterpret_cast<uint32_t*>(e.outf) + at, n, f);
    if (e.codes) {
#pragma unroll
      for (int j = 0; j < R; ++j) f[j] = d.co.byte(__uint_as_float(f[j]), d.inv);
      store_run<R>(e.codes + at, n, f);
    }
  }
}

}  // namespace approx_cuda
