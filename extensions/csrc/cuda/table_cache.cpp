// Prepared-table cache (see the comment below) and the detection of weights that change in place.
// c10 headers only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers, which some CUDA
// installs (the toolkit-only ones CI builds with) do not ship. Same current-stream function.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <string>

#include "kernels.h"

namespace approx_cuda {

// Prepared-table cache. At inference a layer's weight codes and LUT never change, so prep and the
// table build (a large share of a small layer's time, and two launches) are paid once. Entries
// are matched by tensor identity: the same storage (held weakly, so a freed and reallocated
// tensor can never match), data pointer and version counter, which every in-place write through
// PyTorch bumps. Writes that bypass the counter (through `.data`, or another library's kernel)
// are not seen: clone the tensor, or set APPROX_RUN_TABLE_CACHE=0. A CUDA graph captured after a
// layer's first call keeps using the table of that call (the entry is then never freed): capture
// again after changing the weights or the LUT. A graph captured before any call prepares the
// tables inside the graph, on every replay. auto's first call of a layer builds T where it fits
// kTableBudget (its trial times the T variants too); when the pick reads no T the entry drops it
// (drop_table). The cache holds up to an eighth of the device's memory (at least 1 GiB), or
// APPROX_RUN_TABLE_CACHE_MB. A T that does not fit is not cached: its layer's entry keeps E and
// t_refused, and auto picks among the variants without T for it. Evicting other layers' tables
// instead (an LRU) missed on every layer of every forward once a model's tables passed the budget
// (a forward visits its layers in a cycle): ResNet-50's at 1 GiB, ViT-B/16's 48 attention
// projections (604 MiB each) at 17.6 GiB; each forward, and each graph replay, rebuilt them.
constexpr size_t kCacheEntries = 256;  // ViT-B/16: 72 Linear layers and 24 attention products

static int64_t cache_bytes() {
  static const int64_t bytes = [] {
    if (const char* e = std::getenv("APPROX_RUN_TABLE_CACHE_MB")) {
      // a typo must not silently become a tiny cache (every T refused); a throw here leaves the
      // static unset, so every call reports it
      char* end = nullptr;
      const double mb = std::strtod(e, &end);
      TORCH_CHECK(end != e && *end == 0 && mb >= 1 && mb <= (1ll << 40),
                  "APPROX_RUN_TABLE_CACHE_MB='", e, "': expected the table cache's size in MiB, a number from 1");
      return static_cast<int64_t>(mb) << 20;
    }
    size_t free_b = 0, total_b = 0;
    const bool ok = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
    return std::max<int64_t>(1ll << 30, ok ? static_cast<int64_t>(total_b / 8) : 0);
  }();
  return bytes;
}

using CacheKey = std::array<int64_t, 20>;

struct CacheEntry {  // one layer's tables
  CacheKey key;
  c10::weak_intrusive_ptr<c10::StorageImpl> w_st, lut_st;
  std::shared_ptr<Prepared> prep;
};

// Never destroyed: at process exit the CUDA runtime may be gone before static destructors run,
// and freeing device memory then aborts.
static std::mutex& g_cache_mu = *new std::mutex;
static std::list<CacheEntry>& g_cache = *new std::list<CacheEntry>;  // most recently used first
static std::vector<std::shared_ptr<Prepared>>& g_graph_held = *new std::vector<std::shared_ptr<Prepared>>;

bool cache_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("APPROX_RUN_TABLE_CACHE");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

static int64_t version_of(const at::Tensor& t) {
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}
static int64_t addr(const void* ptr) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)); }

static CacheKey cache_key(const Params& p, const ConvGeo& cg, const at::Tensor& w, const at::Tensor& lut) {
  return CacheKey{(int64_t)w.device().index(), p.conv, (int64_t)p.xmask, p.K, p.N, p.G, p.NG,
                  cg.kh, cg.kw, cg.dh, cg.dw, p.H, p.W, addr(w.data_ptr()), version_of(w),
                  addr(w.storage().unsafeGetStorageImpl()), addr(lut.data_ptr()), version_of(lut),
                  addr(lut.storage().unsafeGetStorageImpl()), (int64_t)w.numel()};
}

// Weights in training: a weight tensor whose version counter moved since its previous call here is
// being updated in place (an optimizer step, runner.layers' requantization), so any table built for
// this version serves one call. Caching it would cost a host wait per layer and step (the format
// read-back below) and evict the inference entries; such calls build uncached (format read on the
// device) and auto's pick charges the build (see run() in lut_ops.cpp). The second call with
// unchanged weights caches again, so evaluation after training is as fast as before.
struct SeenWeights {
  c10::weak_intrusive_ptr<c10::StorageImpl> st;
  int64_t version;
};
static std::map<std::pair<int64_t, int64_t>, SeenWeights>& g_seen = *new std::map<std::pair<int64_t, int64_t>, SeenWeights>;

bool weights_changing(const at::Tensor& w) {
  if (w.is_inference()) return false;
  const int64_t v = version_of(w);
  const auto id = std::make_pair(addr(w.storage().unsafeGetStorageImpl()), addr(w.data_ptr()));
  std::lock_guard<std::mutex> lock(g_cache_mu);
  for (auto it = g_seen.begin(); it != g_seen.end();)  // forget freed tensors
    it = it->second.st.expired() ? g_seen.erase(it) : std::next(it);
  auto it = g_seen.find(id);
  if (it == g_seen.end()) {
    if (g_seen.size() < 4096) g_seen.emplace(id, SeenWeights{w.storage().getWeakStorageImpl(), v});
    return false;
  }
  const bool changed = it->second.version != v;
  it->second.version = v;
  return changed;
}

int cached_format(const Params& p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg,
                  bool* t_refused) {
  const CacheKey key = cache_key(p, cg, w, lut);
  std::lock_guard<std::mutex> lock(g_cache_mu);
  for (const CacheEntry& e : g_cache)
    if (e.key == key && !e.w_st.expired() && !e.lut_st.expired()) {
      if (t_refused) *t_refused = e.prep->t_refused;
      return e.prep->fmt;
    }
  return -1;
}

int lut_format(const at::Tensor& lut, bool is_unsigned) {
  const at::Tensor h = lut.to(at::kCPU).contiguous();
  const int32_t* t = h.data_ptr<int32_t>();
  for (int r = 0; r < 256; ++r)
    for (int wi = 0; wi < 256; ++wi) {  // E[r][wi] as prep_kernel (tables.cu) computes it
      const int wv = wi - 128;
      uint32_t v = static_cast<uint32_t>(t[r * 256 + wi]);
      if (is_unsigned)
        v = wv > 0 ? static_cast<uint32_t>(t[r * 256 + wv])
                   : wv < 0 ? 0u - static_cast<uint32_t>(t[r * 256 - wv]) : 0u;
      const int sv = static_cast<int>(v);
      if (sv < -32768 || sv > 32767) return 2;
    }
  return 1;
}

// pr's E tables again without T (a few hundred KiB), with pr's format: what the cache keeps of a layer
// whose pick reads no T (drop_table) or whose T it has no room for (get_prepared).
static std::shared_ptr<Prepared> without_table(const Prepared& pr, const Params& p, const at::Tensor& lut,
                                               const ConvGeo& cg, cudaStream_t stream) {
  std::shared_ptr<Prepared> e = prepare(p, lut, cg, false, stream);
  e->fmt = pr.fmt;
  return e;
}

// The prepared tables for this call: cached, or built now (and cached where allowed).
std::shared_ptr<Prepared> get_prepared(const Params& p, const at::Tensor& w, const at::Tensor& lut,
                                       const ConvGeo& cg, bool need_table, cudaStream_t stream,
                                       bool changing) {
  if (!cache_enabled() || w.is_inference() || lut.is_inference() || changing)
    return prepare(p, lut, cg, need_table, stream);
  const bool cap = capturing();
  const CacheKey key = cache_key(p, cg, w, lut);
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    for (auto it = g_cache.begin(); it != g_cache.end();) {
      if (it->w_st.expired() || it->lut_st.expired()) {  // tensors gone: can never match again
        it = g_cache.erase(it);
        continue;
      }
      if (it->key == key && (it->prep->has_table || !need_table)) {
        g_cache.splice(g_cache.begin(), g_cache, it);
        std::shared_ptr<Prepared> pr = it->prep;
        // The build finished before the entry was cached (its flags were read back), so other
        // streams need no wait; they only must keep its memory from being reused under them.
        if (cap) {
          if (std::find(g_graph_held.begin(), g_graph_held.end(), pr) == g_graph_held.end())
            g_graph_held.push_back(pr);
        } else if (stream != pr->stream &&
                   std::find(pr->users.begin(), pr->users.end(), stream) == pr->users.end()) {
          c10::cuda::CUDACachingAllocator::recordStream(pr->buf.storage().data_ptr(),
                                                        c10::cuda::getCurrentCUDAStream());
          pr->users.push_back(stream);
        }
        return pr;
      }
      ++it;
    }
  }
  std::shared_ptr<Prepared> pr = prepare(p, lut, cg, need_table, stream);
  if (cap) return pr;  // built inside the graph: the graph owns it
  // One wait per layer: with the format known on the host, kernels get shared memory sized for it.
  int flags[kPrepBlocks];
  C10_CUDA_CHECK(cudaMemcpyAsync(flags, pr->p.flags, sizeof(flags), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  bool f16 = true;
  for (int f : flags) f16 = f16 && f != 0;
  pr->fmt = f16 ? 1 : 2;
  std::lock_guard<std::mutex> lock(g_cache_mu);
  int64_t others = 0;
  for (auto it = g_cache.begin(); it != g_cache.end();) {
    if (it->key == key) {
      it = g_cache.erase(it);
      continue;
    }
    others += it->prep->buf.numel();
    ++it;
  }
  std::shared_ptr<Prepared> kept = pr;
  if (need_table && others + pr->buf.numel() > cache_bytes()) {  // no room for T: E only (above)
    kept = without_table(*pr, p, lut, cg, stream);
    kept->t_refused = pr->t_refused = true;
  }
  g_cache.push_front(CacheEntry{key, w.storage().getWeakStorageImpl(),
                                lut.storage().getWeakStorageImpl(), kept});
  int64_t bytes = 0;
  size_t n = 0;
  for (auto it = g_cache.begin(); it != g_cache.end();) {  // E alone past the budget or the count: LRU
    bytes += it->prep->buf.numel();
    if (++n > 1 && (bytes > cache_bytes() || n > kCacheEntries)) {
      it = g_cache.erase(it);
      continue;
    }
    ++it;
  }
  return pr;
}

void drop_table(const Params& p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg,
                cudaStream_t stream) {
  if (!cache_enabled() || capturing()) return;
  const CacheKey key = cache_key(p, cg, w, lut);
  std::lock_guard<std::mutex> lock(g_cache_mu);
  for (CacheEntry& e : g_cache)
    if (e.key == key && e.prep->has_table) {
      // the old buffer goes back to the caching allocator in stream order, after this call's kernel
      // (other streams were recorded on it)
      e.prep = without_table(*e.prep, p, lut, cg, stream);
      return;
    }
}

}  // namespace approx_cuda
