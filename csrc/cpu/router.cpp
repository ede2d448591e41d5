// The CPU decode step's logical-cache `use` and `prefetch`, each in one call (issue 39: the
// router and cache bookkeeping of a decode token on the CPU were ~45 torch ops per MoE
// layer, and the prefetch's loop ~10 ops per predicted id).
//
// cache_use(row, layout, ids, k, capped, logits, n) does on one layer's int32 row of the
// packed state (psr_kernels.cache_state) exactly what psr_kernels.cache_state_ref's
// `cache_use_ref` does, then what decode.py's `_flag` does for the router logits:
//   - the routed ids ascending; hits, prefetches used, misses;
//   - the place key of every slot (free: below zero, lowest slot first; a member's slot:
//     its stamp; a routed member's, and any slot at or past the capacity: not a place);
//   - the j-th inserted miss (ascending) takes the j-th place, evicting that place's member;
//     the miss copy list (slot, expert, kind) with its count, -1 rows past it;
//   - capped: at most min(the row's cap, capacity - hits) misses inserted, the others listed
//     ascending in the CPU list with its count (-1 past it) and counted as cpu experts;
//   - the routed ids most recent (stamp = clock + # routed ids above it), not pending;
//     the counters;
//   - the non-finite flag |= any logit not finite (an exponent test: fast-math safe).
// Integer work only (the flag is a bit test), so the row is bit-identical to the reference's
// (tests/runtime/test_cpu_router.py checks it over random steps). The layout's offsets and
// header fields come from Python (`psr.store.cpu_router`: one definition, cache_state.py).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace psr::cpu {
namespace {

// The offsets vector's entries (psr.store.cpu_router._offsets builds it in this order).
enum Off : int {
  kE,
  kS,
  kK,
  kMember,
  kPending,
  kSlotOf,
  kSlotExpert,
  kHeader,
  kMissList,
  kCpuList,
  kClock,
  kCapacity,
  kRouted,
  kHits,
  kMisses,
  kPrefetchUsed,
  kCpuExperts,
  kFlag,
  kMissN,
  kCpuN,
  kInserts,
  kKindMiss,
  kPfList,
  kPfRows,
  kPrefetches,
  kPfN,
  kKindPf,
  kNumOffsets
};

constexpr int64_t kBig = 2147483647;  // above any stamp: not a place (cache_state_ref._BIG)

// One layer's row through the layout's offsets: its per-expert fields, slot map and header.
struct RowView {
  int32_t *stamp, *member, *pending, *slot_of, *slot_expert, *hdr;
  RowView(int32_t* row, const int64_t* o)
      : stamp(row),
        member(row + o[kMember]),
        pending(row + o[kPending]),
        slot_of(row + o[kSlotOf]),
        slot_expert(row + o[kSlotExpert]),
        hdr(row + o[kHeader]) {}
};

// The place key of every slot: free (below the capacity, unused) below zero, lowest slot
// first; a member's slot its stamp; at or past the capacity kBig (not a place).
std::vector<int64_t> place_keys(const RowView& r, const int64_t* o) {
  const int64_t E = o[kE], S = o[kS], capacity = r.hdr[o[kCapacity]];
  std::vector<int64_t> key(S);
  for (int64_t s = 0; s < S; ++s) key[s] = s < capacity ? s - (S + 1) : kBig;
  for (int64_t e = 0; e < E; ++e)
    if (r.slot_of[e] >= 0 && r.slot_of[e] < S) key[r.slot_of[e]] = r.stamp[e];
  return key;
}

// Copy-list rows [j0, j1) of `list` (slot, expert, kind) empty: -1, -1, kind.
void empty_rows(int32_t* list, int64_t j0, int64_t j1, int64_t kind) {
  for (int64_t j = j0; j < j1; ++j) {
    list[3 * j] = -1;
    list[3 * j + 1] = -1;
    list[3 * j + 2] = static_cast<int32_t>(kind);
  }
}

bool any_non_finite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) return true;
  }
  return false;
}

void cache_use(int32_t* row, const int64_t* o, const int64_t* ids, int64_t k, bool capped,
               const float* logits, int64_t n_logits) {
  const int64_t E = o[kE], S = o[kS], K = o[kK];
  if (k < 1 || k > K) throw std::invalid_argument("cpu_cache_use: need 1 <= k <= top_k");
  const RowView r(row, o);
  const auto [stamp, member, pending, slot_of, slot_expert, hdr] = r;
  int32_t* miss_list = row + o[kMissList];
  int32_t* cpu_list = row + o[kCpuList];

  if (logits != nullptr && any_non_finite(logits, n_logits)) hdr[o[kFlag]] |= 1;

  std::vector<int64_t> routed(ids, ids + k);
  std::sort(routed.begin(), routed.end());
  for (int64_t i = 0; i < k; ++i) {
    if (routed[i] < 0 || routed[i] >= E)
      throw std::invalid_argument("cpu_cache_use: routed id " + std::to_string(routed[i]) +
                                  " outside [0, " + std::to_string(E) + ")");
    if (i && routed[i] == routed[i - 1])
      throw std::invalid_argument("cpu_cache_use: routed ids must be distinct");
  }
  int64_t hits = 0, used = 0;
  for (int64_t e : routed) {
    hits += member[e];
    used += pending[e];
  }
  const int64_t n_miss = k - hits;
  // The misses ascending, then the routed members ascending (a stable sort of the member
  // flags), then -1 up to K.
  std::vector<int64_t> miss;
  miss.reserve(K);
  for (int64_t e : routed)
    if (!member[e]) miss.push_back(e);
  for (int64_t e : routed)
    if (member[e]) miss.push_back(e);
  miss.resize(K, -1);

  int64_t n_ins = n_miss, n_cpu = 0;
  const int64_t capacity = hdr[o[kCapacity]];
  if (capped) {
    const int64_t room = capacity - hits;
    n_ins = std::min(n_miss, std::min<int64_t>(hdr[o[kInserts]], room));
    n_cpu = n_miss - n_ins;
  }
  // Place keys of the slots, a routed member's not a place; the n_ins smallest (distinct)
  // are the places, ascending.
  std::vector<int64_t> key = place_keys(r, o);
  for (int64_t e : routed)
    if (slot_of[e] >= 0 && slot_of[e] < S) key[slot_of[e]] = kBig;
  std::vector<std::pair<int64_t, int64_t>> places;  // (key, slot)
  places.reserve(S);
  for (int64_t s = 0; s < S; ++s)
    if (key[s] < kBig) places.emplace_back(key[s], s);
  if (static_cast<int64_t>(places.size()) < n_ins)
    throw std::logic_error("cpu_cache_use: fewer places than misses to insert (state invariant)");
  std::partial_sort(places.begin(), places.begin() + n_ins, places.end());

  empty_rows(miss_list, 0, K, o[kKindMiss]);
  for (int64_t j = 0; j < n_ins; ++j) {
    const auto [pkey, place] = places[j];
    const int64_t m = miss[j];
    if (pkey >= 0) {  // a member's place: evict it
      const int64_t v = slot_expert[place];
      if (v < 0 || v >= E) throw std::logic_error("cpu_cache_use: a member's slot names no expert");
      member[v] = 0;
      pending[v] = 0;
      slot_of[v] = -1;
    }
    member[m] = 1;
    slot_of[m] = static_cast<int32_t>(place);
    slot_expert[place] = static_cast<int32_t>(m);
    miss_list[3 * j] = static_cast<int32_t>(place);
    miss_list[3 * j + 1] = static_cast<int32_t>(m);
  }
  if (capped)
    for (int64_t j = 0; j < K; ++j)
      cpu_list[j] = j < n_cpu ? static_cast<int32_t>(miss[std::min(j + n_ins, K - 1)]) : -1;
  const int64_t clock = hdr[o[kClock]];
  for (int64_t i = 0; i < k; ++i) {
    stamp[routed[i]] = static_cast<int32_t>(clock + (k - 1 - i));
    pending[routed[i]] = 0;
  }
  auto add = [&](int at, int64_t v) { hdr[o[at]] = static_cast<int32_t>(hdr[o[at]] + v); };
  add(kClock, k);
  add(kRouted, k);
  add(kHits, hits);
  add(kPrefetchUsed, used);
  add(kMisses, n_miss);
  hdr[o[kMissN]] = static_cast<int32_t>(n_ins);
  if (capped) {
    add(kCpuExperts, n_cpu);
    hdr[o[kCpuN]] = static_cast<int32_t>(n_cpu);
  }
}

// cache_prefetch_ref's `prefetch` of pred[0..n) into one layer's row, in order: a member
// becomes most recent (no copy); another id is inserted as most recent in the best place
// (a free slot, lowest first, else the least recent member's, evicted), listed in the
// prefetch copy list (compacted, its count, -1 rows past it); the clock and counter.
void cache_prefetch(int32_t* row, const int64_t* o, const int64_t* pred, int64_t n) {
  const int64_t E = o[kE], S = o[kS], R = o[kPfRows];
  if (n < 0 || n > R) throw std::invalid_argument("cpu_cache_prefetch: n outside the layout");
  const RowView r(row, o);
  const auto [stamp, member, pending, slot_of, slot_expert, hdr] = r;
  int32_t* pf_list = row + o[kPfList];
  for (int64_t i = 0; i < n; ++i)
    if (pred[i] < 0 || pred[i] >= E)
      throw std::invalid_argument("cpu_cache_prefetch: predicted id " + std::to_string(pred[i]) +
                                  " outside [0, " + std::to_string(E) + ")");
  std::vector<int64_t> key = place_keys(r, o);  // kept current below
  const int64_t clock = hdr[o[kClock]];
  int64_t pos = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pred[i];
    const int64_t now = clock + i;
    const int64_t own = slot_of[p];
    const int32_t pend = pending[p];
    const bool is_member = member[p] != 0;
    int64_t place = -1, best = 0;
    if (is_member && own >= 0 && own < S) {
      place = own;  // a member's own slot is its place
      best = -kBig;
    } else {  // the least key, the lowest slot among equals
      for (int64_t s = 0; s < S; ++s)
        if (place < 0 || key[s] < best) best = key[s], place = s;
    }
    if (place < 0 || best >= kBig)
      throw std::logic_error("cpu_cache_prefetch: no place for an insertion (state invariant)");
    const int64_t fresh = is_member ? 0 : 1;
    if (best >= 0) {  // a member's place: evict it
      const int64_t v = slot_expert[place];
      if (v < 0 || v >= E)
        throw std::logic_error("cpu_cache_prefetch: a member's slot names no expert");
      member[v] = 0;
      pending[v] = 0;
      slot_of[v] = -1;
    }
    stamp[p] = static_cast<int32_t>(now);
    member[p] = 1;
    pending[p] = static_cast<int32_t>(pend + fresh);
    slot_of[p] = static_cast<int32_t>(place);
    slot_expert[place] = static_cast<int32_t>(p);
    key[place] = now;
    pf_list[3 * pos] = static_cast<int32_t>(place);
    pf_list[3 * pos + 1] = static_cast<int32_t>(p);
    pf_list[3 * pos + 2] = static_cast<int32_t>(o[kKindPf]);
    pos += fresh;
  }
  hdr[o[kClock]] = static_cast<int32_t>(clock + n);
  hdr[o[kPrefetches]] = static_cast<int32_t>(hdr[o[kPrefetches]] + pos);
  hdr[o[kPfN]] = static_cast<int32_t>(pos);
  empty_rows(pf_list, pos, R, o[kKindPf]);
}

// The bindings' shared checks of the addresses and the offsets vector.
void check_args(const char* op, bool null_address, int64_t n_offsets) {
  if (null_address) throw std::invalid_argument(std::string(op) + ": null address");
  if (n_offsets != kNumOffsets)
    throw std::invalid_argument(std::string(op) + ": offsets must hold " +
                                std::to_string(kNumOffsets) + " integers");
}

}  // namespace

void bind_router(py::module_& m) {
  m.def(
      "cpu_cache_use",
      [](uintptr_t row, uintptr_t offsets, int64_t n_offsets, uintptr_t ids, int64_t k, bool capped,
         uintptr_t logits, int64_t n_logits) {
        check_args("cpu_cache_use", !row || !offsets || !ids, n_offsets);
        cache_use(reinterpret_cast<int32_t*>(row), reinterpret_cast<const int64_t*>(offsets),
                  reinterpret_cast<const int64_t*>(ids), k, capped,
                  reinterpret_cast<const float*>(logits), n_logits);
      },
      py::arg("row"), py::arg("offsets"), py::arg("n_offsets"), py::arg("ids"), py::arg("k"),
      py::arg("capped"), py::arg("logits"), py::arg("n_logits"),
      "The logical cache's `use` of one token's routed ids on one layer's int32 state row, "
      "and the non-finite flag of its float32 router logits (addresses of live, checked "
      "tensors; psr.store.cpu_router)");
  m.def(
      "cpu_cache_prefetch",
      [](uintptr_t row, uintptr_t offsets, int64_t n_offsets, uintptr_t pred, int64_t n) {
        check_args("cpu_cache_prefetch", !row || !offsets || (n && !pred), n_offsets);
        cache_prefetch(reinterpret_cast<int32_t*>(row), reinterpret_cast<const int64_t*>(offsets),
                       reinterpret_cast<const int64_t*>(pred), n);
      },
      py::arg("row"), py::arg("offsets"), py::arg("n_offsets"), py::arg("pred"), py::arg("n"),
      "The logical cache's `prefetch` of a token's first n predicted ids into one layer's int32 "
      "state row (addresses of live, checked tensors; psr.store.cpu_router)");
}

}  // namespace psr::cpu
