// auto: a timed trial of the candidates on the first call of each AutoInputs (shape, geometry,
// table format, device), the pick cached per AutoInputs.
#include <map>
#include <mutex>
#include <vector>

#include "algos.h"

namespace approx_cuda {

// The key lists every field of Params but its pointers (the tables and the call's tensors), every
// field of ConvGeo, and the rest of AutoInputs. A field added to either struct changes its size
// and stops the build here until the key takes it in too.
static_assert(sizeof(ConvGeo) == 16, "ConvGeo changed: add its new fields to pick_key, then update this size");
static_assert(sizeof(WindowGeo) == 48, "WindowGeo changed: add its new fields to pick_key, then update this size");
// Params::epi (120 bytes) is left out on purpose: the end a fused call applies in its stores does not change which
// variant is fastest, and a pick serves the call with an end and the one without alike.
static_assert(sizeof(Epi) == 120, "Epi changed: update this size (it is not part of the key)");
static_assert(sizeof(Params) == 272 + sizeof(Epi),
              "Params changed: add its new fields to pick_key, then update this size");

PickKey pick_key(const AutoInputs& in) {
  const Params& p = in.p;
  const ConvGeo& cg = in.cg;
  const WindowGeo& w = p.win;
  return PickKey{in.device, in.fmt, in.table,
                 // Params: the call (pointers left out), conv geometry, staging, per variant
                 p.M, p.HoWo, p.K, p.N, p.G, p.NG, p.NGB, p.Kpad, p.Ntot, p.xmask, p.conv, p.vec,
                 p.vec4, p.C, p.H, p.W, p.Cg, p.Wo, p.sh, p.sw, p.ph, p.pw, p.fHoWo.d, p.fHoWo.mul,
                 p.fHoWo.shift, p.fWo.d, p.fWo.mul, p.fWo.shift, p.stage, p.stage_bytes, w.B,
                 w.tasks, w.Ho, w.kh, w.Hp, w.Wp, w.seg, w.imgs, w.rx, p.rows_mb,
                 // ConvGeo
                 cg.kh, cg.kw, cg.dh, cg.dw};
}

namespace {

std::mutex g_auto_mu;
std::map<PickKey, Choice> g_auto_cache;

}  // namespace

bool cached_pick(const AutoInputs& in, Choice& out) {
  std::lock_guard<std::mutex> lock(g_auto_mu);
  auto it = g_auto_cache.find(pick_key(in));
  if (it == g_auto_cache.end()) return false;
  out = it->second;
  return true;
}

Choice auto_pick(const AutoInputs& in, const Prepared& pr, cudaStream_t stream) {
  const Params& p = in.p;
  const ConvGeo& cg = in.cg;
  Choice best;
  if (cached_pick(in, best)) return best;
  const std::vector<Choice> cands = auto_candidates(in);
  if (cands.size() == 1 || capturing())
    // No timing inside a graph capture: the table pays off once rows outnumber codes by far.
    return (cands.size() > 1 && p.M >= 4096) ? cands[1] : cands[0];
  // Timed trial (best_ms): the fastest candidate, the first on a tie. The caller runs the pick once
  // more, so the output comes from it.
  best = cands[0];
  float fastest = 1e30f;
  for (const Choice& c : cands) {
    const float ms = best_ms([&] { run_choice(c, p, pr, cg, stream); }, stream);
    if (ms < fastest) fastest = ms, best = c;
  }
  std::lock_guard<std::mutex> lock(g_auto_mu);
  g_auto_cache[pick_key(in)] = best;
  return best;
}

}  // namespace approx_cuda
