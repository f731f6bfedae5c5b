// auto: a timed trial of the candidates on the first call of each shape, the pick cached per shape.
#include <array>
#include <map>
#include <mutex>

#include "algos.h"

namespace approx_cuda {
namespace {

using ShapeKey = std::array<long long, 16>;

ShapeKey shape_key(const Params& p) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return ShapeKey{p.conv, dev, (long long)p.xmask, p.M, p.K, p.N, p.G, p.C, p.H, p.W, p.Wo,
                  p.HoWo, p.sh, p.sw, p.ph, p.pw};
}

std::mutex g_auto_mu;
std::map<ShapeKey, Choice> g_auto_cache;

}  // namespace

bool cached_pick(const Params& p, Choice& out) {
  std::lock_guard<std::mutex> lock(g_auto_mu);
  auto it = g_auto_cache.find(shape_key(p));
  if (it == g_auto_cache.end()) return false;
  out = it->second;
  return true;
}

Choice auto_pick(const std::vector<Choice>& cands, const Params& p, const Prepared& pr,
                 const ConvGeo& cg, cudaStream_t stream) {
  Choice best;
  if (cached_pick(p, best)) return best;
  if (cands.size() == 1 || capturing())
    // No timing inside a graph capture: the table pays off once rows outnumber codes by far.
    return (cands.size() > 1 && p.M >= 4096) ? cands[1] : cands[0];
  // Timed trial: each candidate once to warm up, then the best of kTrialRuns timings with CUDA
  // events of two back-to-back runs (the second launch queues behind the first, so the time is
  // mostly the GPU's). Host-clock timing of single runs was noisy enough to pick a variant
  // ~2-10 % slower. The caller runs the pick once more, so the output comes from it.
  constexpr int kTrialRuns = 3;
  cudaEvent_t ev[2];
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
  best = cands[0];
  float best_ms = 1e30f;
  for (const Choice& c : cands) {
    run_choice(c, p, pr, cg, stream);
    for (int r = 0; r < kTrialRuns; ++r) {
      C10_CUDA_CHECK(cudaEventRecord(ev[0], stream));
      run_choice(c, p, pr, cg, stream);
      run_choice(c, p, pr, cg, stream);
      C10_CUDA_CHECK(cudaEventRecord(ev[1], stream));
      C10_CUDA_CHECK(cudaEventSynchronize(ev[1]));
      float ms = 0;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
      if (ms < best_ms) {
        best_ms = ms;
        best = c;
      }
    }
  }
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventDestroy(e));
  std::lock_guard<std::mutex> lock(g_auto_mu);
  g_auto_cache[shape_key(p)] = best;
  return best;
}

}  // namespace approx_cuda
