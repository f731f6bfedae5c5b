// CUDA kernels for approx::lut_grad_a and approx::lut_grad_w (arithmetic: see ../ops.cpp), in rows
// form: a [M, K] codes, w [N, K] codes, grad [M, N] float32, slope [256, 256] float32 indexed
// [row(a)][w + 128] (row(a) = a + 128 for int8, a for uint8).
//   lut_grad_a: out[m, k] = sum_n grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   [M, K]
//   lut_grad_w: out[n, k] = sum_m grad[m, n] * slope[row(a[m, k])][w[n, k] + 128]   [N, K]
//
// Simple kernels, meant to be right rather than fast:
//   lut_grad_a  one thread per (m, k), looping over n in float32. Neighbouring threads share m, so
//               the grad row is a broadcast and the codes / weight columns are coalesced; slope
//               (256 KiB) is read through __ldg and stays in L1/L2.
//   lut_grad_w  one thread per (n, k) and chunk of rows: blockIdx.y is the chunk, each thread sums
//               its chunk's rows in float32 and writes partial[chunk][n][k]; a second kernel adds
//               the partials in chunk order in double. No float atomics, so the result is
//               bit-for-bit the same on every run (atomicAdd order would vary with scheduling).
//               With one chunk the first kernel writes the output directly.
#include <ATen/ATen.h>
// c10 headers only (see table_cache.cpp: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers
// that toolkit-only installs lack).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerChunk = 256;          // lut_grad_w: rows one thread sums (at least)
constexpr int64_t kMaxPartials = 1ll << 24;     // lut_grad_w: partial sums kept (64 MiB)
constexpr int64_t kMaxBlocks = 1ll << 20;       // grid-stride beyond this many blocks

__global__ void grad_a_kernel(const uint8_t* __restrict__ a, const int8_t* __restrict__ w,
                              const float* __restrict__ g, const float* __restrict__ slope,
                              float* __restrict__ out, int64_t M, int64_t K, int64_t N,
                              unsigned xmask) {
  const int64_t total = M * K;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t m = i / K, k = i - m * K;
    const float* srow = slope + ((unsigned)(a[i] ^ xmask) << 8);
    const float* gm = g + m * N;
    const int8_t* wk = w + k;
    float acc = 0.f;
    for (int64_t n = 0; n < N; ++n) acc = fmaf(__ldg(gm + n), __ldg(srow + ((int)wk[n * K] + 128)), acc);
    out[i] = acc;
  }
}

// dst[c][n][k] = sum over rows m of chunk c (rows [c * rows, min(M, (c + 1) * rows))) of
// g[m, n] * slope[row(a[m, k])][w[n, k] + 128]; thread x = n * K + k, chunk c = blockIdx.y.
__global__ void grad_w_partial_kernel(const uint8_t* __restrict__ a, const int8_t* __restrict__ w,
                                      const float* __restrict__ g, const float* __restrict__ slope,
                                      float* __restrict__ dst, int64_t M, int64_t K, int64_t N,
                                      int64_t rows, unsigned xmask) {
  const int64_t NK = N * K;
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= NK) return;
  const int64_t n = i / K, k = i - n * K;
  const int64_t m0 = blockIdx.y * rows, m1 = m0 + rows < M ? m0 + rows : M;
  const float* scol = slope + ((int)w[i] + 128);  // w is [N, K]: w[n, k] = w[i]
  float acc = 0.f;
  for (int64_t m = m0; m < m1; ++m)
    acc = fmaf(__ldg(g + m * N + n), __ldg(scol + ((unsigned)(a[m * K + k] ^ xmask) << 8)), acc);
  dst[blockIdx.y * NK + i] = acc;
}

// out[i] = sum_c partial[c][i] over chunks in order, in double.
__global__ void grad_w_reduce_kernel(const float* __restrict__ partial, float* __restrict__ out,
                                     int64_t NK, int64_t chunks) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < NK;
       i += (int64_t)gridDim.x * blockDim.x) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += (double)partial[c * NK + i];
    out[i] = (float)s;
  }
}

// Error messages are built from strings only: streaming integers or ATen types into TORCH_CHECK
// from nvcc-compiled code crashed under torch 2.11 (see ../checks.h).
std::string I(int64_t v) { return std::to_string(v); }
std::string D(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
std::string T(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

void check_grad(const char* op, const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                const at::Tensor& slope) {
  const std::string o(op);
  TORCH_CHECK(a.scalar_type() == at::kChar || a.scalar_type() == at::kByte,
              o + ": activation codes `a` must be int8 (signed multiplier) or uint8 (unsigned "
                  "multiplier), got " + T(a));
  TORCH_CHECK(w.scalar_type() == at::kChar, o + ": weight codes `w` must be int8, got " + T(w));
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2,
              o + ": expected a [M, K] and w [N, K], got a " + D(a.sizes()) + ", w " + D(w.sizes()));
  TORCH_CHECK(a.size(1) == w.size(1),
              o + ": a has K=" + I(a.size(1)) + " columns but w has K=" + I(w.size(1)));
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.size(0) == a.size(0) &&
                  grad.size(1) == w.size(0),
              o + ": `grad` must be a float32 tensor of shape [M, N] = [" + I(a.size(0)) + ", " +
                  I(w.size(0)) + "], got " + T(grad) + " " + D(grad.sizes()));
  TORCH_CHECK(slope.scalar_type() == at::kFloat && slope.dim() == 2 && slope.size(0) == 256 &&
                  slope.size(1) == 256,
              o + ": `slope` must be a float32 tensor of shape [256, 256], got " + T(slope) + " " +
                  D(slope.sizes()));
  TORCH_CHECK(a.is_contiguous(), o + ": `a` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(w.is_contiguous(), o + ": `w` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(grad.is_contiguous(), o + ": `grad` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(slope.is_contiguous(), o + ": `slope` must be contiguous (call .contiguous() first)");
  TORCH_CHECK(a.device() == w.device() && a.device() == grad.device() && a.device() == slope.device(),
              o + ": a, w, grad and slope must be on the same device, got " + a.device().str() + ", " +
                  w.device().str() + ", " + grad.device().str() + ", " + slope.device().str());
  TORCH_CHECK(a.is_cuda(), o + ": the CUDA kernel got tensors on " + a.device().str());
}

unsigned xmask_of(const at::Tensor& a) { return a.scalar_type() == at::kChar ? 0x80u : 0u; }

at::Tensor lut_grad_a_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                           const at::Tensor& slope) {
  check_grad("lut_grad_a", a, w, grad, slope);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (M == 0 || K == 0 || N == 0) return at::zeros({M, K}, grad.options());
  at::Tensor out = at::empty({M, K}, grad.options());
  const int64_t blocks = std::min<int64_t>((M * K + kThreads - 1) / kThreads, kMaxBlocks);
  grad_a_kernel<<<(unsigned)blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint8_t*>(a.data_ptr()), w.data_ptr<int8_t>(), grad.data_ptr<float>(),
      slope.data_ptr<float>(), out.data_ptr<float>(), M, K, N, xmask_of(a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor lut_grad_w_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& grad,
                           const at::Tensor& slope) {
  check_grad("lut_grad_w", a, w, grad, slope);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  if (M == 0 || K == 0 || N == 0) return at::zeros({N, K}, grad.options());
  at::Tensor out = at::empty({N, K}, grad.options());
  const int64_t NK = N * K;
  const int64_t bx = (NK + kThreads - 1) / kThreads;
  TORCH_CHECK(bx <= 0x7fffffff, "lut_grad_w: too many weights (N * K = " + I(NK) + ")");
  // Chunks of at least kRowsPerChunk rows; at most 65535 (grid.y) and kMaxPartials partial sums.
  int64_t chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  chunks = std::min<int64_t>({chunks, 65535, std::max<int64_t>(1, kMaxPartials / NK)});
  const int64_t rows = (M + chunks - 1) / chunks;
  chunks = (M + rows - 1) / rows;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint8_t* ap = reinterpret_cast<const uint8_t*>(a.data_ptr());
  const dim3 grid((unsigned)bx, (unsigned)chunks);
  if (chunks == 1) {
    grad_w_partial_kernel<<<grid, kThreads, 0, stream>>>(ap, w.data_ptr<int8_t>(), grad.data_ptr<float>(),
                                                         slope.data_ptr<float>(), out.data_ptr<float>(), M,
                                                         K, N, rows, xmask_of(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  at::Tensor partial = at::empty({chunks, N, K}, grad.options());
  grad_w_partial_kernel<<<grid, kThreads, 0, stream>>>(ap, w.data_ptr<int8_t>(), grad.data_ptr<float>(),
                                                       slope.data_ptr<float>(), partial.data_ptr<float>(),
                                                       M, K, N, rows, xmask_of(a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grad_w_reduce_kernel<<<(unsigned)std::min<int64_t>(bx, kMaxBlocks), kThreads, 0, stream>>>(
      partial.data_ptr<float>(), out.data_ptr<float>(), NK, chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CUDA, m) {
  m.impl("lut_grad_a", &lut_grad_a_cuda);
  m.impl("lut_grad_w", &lut_grad_w_cuda);
}
