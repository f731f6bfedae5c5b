// Launch parameters and constants every CUDA LUT kernel shares (host and device code).
//
// Both ops are one implicit GEMM: a row is one output pixel of one group (linear: one row of a),
// a tap k is one of the K codes that row reads. Conv rows gather their codes straight from the
// input through a per-tap table {offset, dy, dx, valid}; padding taps read code 0, which then
// goes through the LUT like any other code. No im2col buffer exists.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace approx_cuda {

constexpr int kThreads = 256;
constexpr int kPrepBlocks = 8;   // each handles 32 LUT rows and writes one fit flag
constexpr int kKAlign = 8;       // taps of T padded to a multiple of this (every chunk divides it)
constexpr int kMaxNGB = 32;      // 8-channel groups per block at most (grid.z covers the rest)
constexpr int64_t kTableBudget = 1ll << 30;  // bytes of T (int32 layout) beyond which only direct runs

// Division by a launch constant as a multiply-high and shift (n < 2^31): 64-bit and plain 32-bit
// divisions per row were a sizeable share of conv1's instructions.
struct FastDiv {
  unsigned d, mul, shift;
};

inline FastDiv make_fastdiv(unsigned d) {
  unsigned s = 0;
  while ((1ull << s) < d) ++s;
  const unsigned long long m = ((1ull << 32) * ((1ull << s) - d)) / d + 1;
  return FastDiv{d, static_cast<unsigned>(m), s};
}

// Conv geometry the kernels need only on the host (prep's tap table, variant checks).
struct ConvGeo {
  int kh = 1, kw = 1, dh = 1, dw = 1;
};

// expanded_window (dilation 1): a task = (image, output row, segment of rx columns).
struct WindowGeo {
  long long B, tasks;
  int Ho, kh, Hp, Wp, seg, imgs;  // Hp x Wp: a padded input plane as staged in shared memory
  int rx;                         // outputs a thread computes (8, 7 or 5)
};

// A layer's end applied in a LUT kernel's own stores (lut_ops.cpp's lut_conv2d_dequantize /
// lut_conv2d_requantize_codes, where the variant is expanded_window or an unsplit expanded_gemm): kind 0 none,
// the int32 sums into `out`;
// 1 dequantize into outf (with residual, relu and codes as approx::dequantize); 2 requantize_codes into codes.
// Per-channel arrays have Ntot entries. vec: outf and residual 16-byte aligned, codes 4-byte aligned.
struct Epi {
  int kind;
  int relu, vec;
  const float* act_scale;
  const float* wscale;
  const float* bias;
  const float* residual;
  float* outf;
  uint8_t* codes;
  const float* codes_scale;  // dequantize's codes: quantize's arithmetic at this scale, [cqmin, cqmax]
  float cqmin, cqmax;
  const int32_t* qbias;      // requantize_codes
  const int32_t* mult;
  const int32_t* shift;
  long long qmin, qmax;
};

struct Params {
  // the call
  const uint8_t* a;
  const int8_t* w;
  int32_t* out;
  long long M;         // rows per group
  long long HoWo;
  int K, N, G, NG, NGB, Kpad, Ntot;
  unsigned xmask;      // code ^ xmask = LUT row (0x80 for int8 codes)
  int conv, vec;       // vec: linear, K % 8 == 0 and a 8-byte aligned
  int vec4;            // linear: K % 4 == 0 and a 4-byte aligned (aligned 4-byte code words)
  // conv geometry
  int C, H, W, Cg, Wo, sh, sw, ph, pw;
  FastDiv fHoWo, fWo;
  // prepared tables (tables.cu)
  const int32_t* E32;  // [256][256] effective products: row = LUT row of the code, col = w + 128
  const int16_t* E16;
  const int16_t* Et16; // E16 transposed, [w + 128][LUT row]: a weight's 256 products contiguous (expanded_gemm)
  const int* flags;    // kPrepBlocks words, 1 where that block's products all fit int16
  const int4* kinfo;   // conv: per tap {input offset, dy, dx, valid}; Kpad entries
  const void* T;       // expanded table [G][NG][Kpad][256][8 channels]
  const void* Tpairs;  // T's channel pairs, pair-major [NP][Kpad][256] words (expanded_pairs)
  const uint8_t* Tdw;  // depthwise_planes' channel tables [G][4608 bytes]; null where it does not take the shape
  // code staging of the gathering kernels (gather.cuh)
  int stage;           // 0: codes from global per chunk; 1: conv images staged in shared memory;
                       // 2: linear rows [Mb][Kpad] staged in shared memory
  int stage_bytes;     // shared memory reserved for the staged codes (multiple of 16)
  // per variant
  WindowGeo win;       // expanded_window
  int rows_mb;         // expanded_rows / expanded_pairs: rows per block
  Epi epi;             // kind 0 but under the fused entry points (lut_ops.cpp's applies_end)
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifdef __CUDACC__
__device__ __forceinline__ unsigned fdiv(unsigned n, const FastDiv& f) {
  return (__umulhi(n, f.mul) + n) >> f.shift;
}

__device__ __forceinline__ bool read_fits16(const int* flags) {
  int f = 1;
#pragma unroll
  for (int i = 0; i < kPrepBlocks; ++i) f &= flags[i];
  return f != 0;
}
#endif

}  // namespace approx_cuda
