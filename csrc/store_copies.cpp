// The copy engine: copies into slots (held rows or pageable ones), deferral behind readers,
// acquire / release with retries, the device step's gathers and slot adoption.
#include "store.h"

#include "alloc_error.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace psr {

namespace {
std::string where(int64_t layer, int64_t slot) {
  std::ostringstream s;
  s << "layer " << layer << " slot " << slot;
  return s.str();
}
}  // namespace

// Issues the copy of the expert slot `slot` is assigned; mu_ held.
void Store::issue_copy(Layer& L, int64_t layer, int64_t slot) {
  Slot& s = L.slots[static_cast<size_t>(slot)];
  const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
  void* dst = static_cast<char*>(L.slab.get()) + static_cast<size_t>(slot) * eb;
  const size_t ei = static_cast<size_t>(s.expert);
  const std::string what = "layer " + std::to_string(layer) + " expert " +
                           std::to_string(s.expert) + " -> slot " + std::to_string(slot);
  const bool pageable = L.host_row[ei] < 0;
  try {
    if (pageable) {
      // Residency before the readahead (which lets the kernel read ahead of the copy thread).
      const int64_t cached = static_cast<int64_t>(files_.resident(L.pageable[ei]));
      files_.readahead(L.pageable[ei]);
      backend_->copy_pageable(L.first_slot + static_cast<size_t>(slot), dst, L.pageable[ei], files_,
                              tiers_, cached, eb, what);
    } else {
      const void* src =
          static_cast<const char*>(L.host.get()) + static_cast<size_t>(L.host_row[ei]) * eb;
      backend_->copy_async(L.first_slot + static_cast<size_t>(slot), dst, src, eb, what);
      tiers_.pinned += eb;
    }
  } catch (...) {
    const int64_t readers = s.readers;
    empty_slot(s);  // nothing was issued: the slot holds nothing usable
    s.readers = readers;
    throw;
  }
  s.loaded = true;
  s.deferred = false;
  s.pageable = pageable;
  s.gen += 1;
  counters_.copies += 1;
  counters_.bytes_copied += eb;
}

void Store::enqueue_copies(int64_t layer, const std::vector<int64_t>& slots,
                           const std::vector<int64_t>& experts) {
  auto live = hold_open("enqueue_copies");
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  if (slots.size() != experts.size())
    throw std::invalid_argument("enqueue_copies: " + std::to_string(slots.size()) + " slots but " +
                                std::to_string(experts.size()) + " experts");
  // Validate the whole batch before touching anything.
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(L, layer, slots[i]);
    const int64_t e = experts[i];
    check_expert(L, layer, e);
    if (!L.registered[static_cast<size_t>(e)])
      throw std::invalid_argument("expert " + std::to_string(e) + " of layer " +
                                  std::to_string(layer) + " is not registered");
    for (size_t j = 0; j < i; ++j)
      if (slots[j] == slots[i])
        throw std::invalid_argument("enqueue_copies: slot " + std::to_string(slots[i]) +
                                    " appears twice in one batch");
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = L.slots[static_cast<size_t>(slots[i])];
    s.expert = experts[i];
    if (s.readers > 0) {
      s.loaded = true;
      s.deferred = true;  // issued by the last release()
      s.gen += 1;
    } else {
      issue_copy(L, layer, slots[i]);
    }
  }
}

void Store::gather(int64_t layer, uintptr_t rows, uintptr_t count, int64_t max_rows, bool side,
                   uintptr_t stream) {
  auto live = hold_open("gather");
  Layer& L = layer_at(layer);
  if (!rows || !count) throw std::invalid_argument("gather: null copy list");
  if (max_rows < 0) throw std::invalid_argument("gather: max_rows must be >= 0");
  if (L.num_pageable > 0 && !backend_->gathers_pageable())
    throw StoreError("gather: layer " + std::to_string(layer) + " has " +
                     std::to_string(L.num_pageable) + " pageable experts; the " + backend_name_ +
                     " device step reads only held rows (decode='host' reads pageable ones)");
  GatherArgs a;
  a.host_row = L.host_row.data();
  a.pageable = L.pageable.data();
  a.files = &files_;
  a.tiers = &tiers_;
  a.poisoned = L.poisoned.get();
  a.any_pageable = L.num_pageable > 0;
  a.layer = layer;
  a.slab = L.slab.get();
  a.host = L.host_device;
  a.row_bytes = static_cast<size_t>(L.spec.expert_bytes);
  a.num_slots = L.spec.num_slots;
  a.num_experts = L.spec.num_experts;
  a.rows = reinterpret_cast<const int32_t*>(rows);
  a.count = reinterpret_cast<const int32_t*>(count);
  a.max_rows = max_rows;
  backend_->gather(a, stream, side, static_cast<size_t>(layer));
}

void Store::join(int64_t layer, uintptr_t stream) {
  auto live = hold_open("join");
  layer_at(layer);
  Counters c;
  try {
    backend_->join(static_cast<size_t>(layer), stream, c);
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    counters_.stall_ns += c.stall_ns;
    counters_.stall_pageable_ns += c.stall_pageable_ns;
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  counters_.stall_ns += c.stall_ns;
  counters_.stall_pageable_ns += c.stall_pageable_ns;
}

void Store::adopt_slots(int64_t layer, const std::vector<int64_t>& experts, uintptr_t stream) {
  auto live = hold_open("adopt_slots");
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  if (static_cast<int64_t>(experts.size()) != L.spec.num_slots)
    throw std::invalid_argument("adopt_slots: " + std::to_string(experts.size()) +
                                " experts for the " + std::to_string(L.spec.num_slots) +
                                " slots of layer " + std::to_string(layer));
  for (size_t i = 0; i < experts.size(); ++i) {
    const int64_t e = experts[i];
    const Slot& s = L.slots[i];
    if (s.readers > 0 || s.deferred)
      throw StoreError("adopt_slots: " + where(layer, static_cast<int64_t>(i)) +
                       " is held by a reader or has a queued copy");
    if (e < -1 || e >= L.spec.num_experts) {
      std::ostringstream m;
      m << "adopt_slots: expert " << e << " out of range [-1, " << L.spec.num_experts
        << ") in layer " << layer;
      throw std::out_of_range(m.str());
    }
    if (e >= 0 && !L.registered[static_cast<size_t>(e)])
      throw std::invalid_argument("adopt_slots: expert " + std::to_string(e) + " of layer " +
                                  std::to_string(layer) + " is not registered");
  }
  backend_->fence(stream);
  for (size_t i = 0; i < experts.size(); ++i) {
    Slot& s = L.slots[i];
    // A gather whose read failed left this slot half-written: it holds nothing.
    const int64_t e = L.poisoned[i].exchange(0) ? -1 : experts[i];
    if (s.expert == e && s.loaded == (e >= 0)) continue;
    s.expert = e;
    s.loaded = e >= 0;
    s.pageable = e >= 0 && L.host_row[static_cast<size_t>(e)] < 0;
    s.gen += 1;
  }
}

void Store::acquire(int64_t layer, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& experts, uintptr_t stream) {
  auto live = hold_open("acquire");
  std::unique_lock<std::mutex> lk(mu_);
  Layer& L = layer_at(layer);
  if (!experts.empty() && experts.size() != slots.size())
    throw std::invalid_argument("acquire: " + std::to_string(slots.size()) + " slots but " +
                                std::to_string(experts.size()) + " experts");
  // Distinct slots to wait for (a slot may be listed twice: held twice), with
  // the expert and copy generation seen now.
  std::vector<int64_t> uniq, want;
  std::vector<uint64_t> gen;
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(L, layer, slots[i]);
    const Slot& s = L.slots[static_cast<size_t>(slots[i])];
    if (!s.loaded)
      throw StoreError("waiting on " + where(layer, slots[i]) + ", which was never loaded");
    if (s.deferred)
      throw StoreError("waiting on " + where(layer, slots[i]) +
                       ", whose load is queued behind its own readers: release it first");
    if (!experts.empty() && s.expert != experts[i])
      throw StoreError(where(layer, slots[i]) + " holds expert " + std::to_string(s.expert) +
                       ", expected " + std::to_string(experts[i]));
    bool dup = false;
    for (int64_t u : uniq) dup = dup || u == slots[i];
    if (dup) continue;
    uniq.push_back(slots[i]);
    want.push_back(s.expert);
    gen.push_back(s.gen);
  }
  std::vector<int> tries(uniq.size(), 0);
  std::vector<size_t> pending(uniq.size());
  for (size_t k = 0; k < pending.size(); ++k) pending[k] = k;
  while (!pending.empty()) {
    // Held rows' copies first, then pageable ones: each wait's stall counts by tier.
    std::vector<size_t> gs[2], at[2];
    for (size_t j = 0; j < pending.size(); ++j) {
      const int t = L.slots[static_cast<size_t>(uniq[pending[j]])].pageable ? 1 : 0;
      gs[t].push_back(L.first_slot + static_cast<size_t>(uniq[pending[j]]));
      at[t].push_back(j);
    }
    // Wait without the lock so other threads may keep issuing copies.
    lk.unlock();
    std::vector<std::string> errs(pending.size());
    Counters c[2];
    for (int t = 0; t < 2; ++t) {
      if (gs[t].empty()) continue;
      const std::vector<std::string> e = backend_->wait_copies(gs[t], stream, c[t]);
      for (size_t i = 0; i < e.size(); ++i) errs[at[t][i]] = e[i];
    }
    lk.lock();
    for (const Counters& ct : c) {
      counters_.waits += ct.waits;
      counters_.stalled_waits += ct.stalled_waits;
      counters_.stall_ns += ct.stall_ns;
    }
    counters_.stall_pageable_ns += c[1].stall_ns;
    std::vector<size_t> again;
    std::string failed;
    for (size_t j = 0; j < pending.size(); ++j) {
      const size_t k = pending[j];
      Slot& s = L.slots[static_cast<size_t>(uniq[k])];
      if (s.gen != gen[k]) {
        // Another thread changed the slot while we waited: wait for its new
        // copy if it still holds our expert.
        if (!s.loaded || s.deferred || s.expert != want[k])
          throw StoreError(where(layer, uniq[k]) +
                           " was changed by another thread while acquire waited for it");
        gen[k] = s.gen;
        again.push_back(k);
        continue;
      }
      if (errs[j].empty()) continue;
      counters_.failed_copies += 1;
      if (tries[k] < copy_retries_ && s.readers == 0) {
        tries[k] += 1;
        issue_copy(L, layer, uniq[k]);  // same slot, same expert
        counters_.retried_copies += 1;
        gen[k] = s.gen;
        again.push_back(k);
      } else {
        const int64_t readers = s.readers;
        empty_slot(s);  // its contents are undefined: leave it empty and loadable
        s.readers = readers;
        failed += (failed.empty() ? "" : "; ") + errs[j];
        if (tries[k] > 0) failed += " (after " + std::to_string(tries[k]) + " retries)";
      }
    }
    if (!failed.empty()) throw CopyError("copy failed: " + failed);
    pending.swap(again);
  }
  for (int64_t slot : slots) L.slots[static_cast<size_t>(slot)].readers += 1;
}

void Store::release(int64_t layer, const std::vector<int64_t>& slots, uintptr_t stream) {
  auto live = hold_open("release");
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  std::vector<int64_t> held(static_cast<size_t>(L.spec.num_slots), 0);
  for (int64_t slot : slots) {
    check_slot(L, layer, slot);
    if (++held[static_cast<size_t>(slot)] > L.slots[static_cast<size_t>(slot)].readers)
      throw StoreError("release of " + where(layer, slot) + ", which is not held");
  }
  std::vector<size_t> gs;
  for (int64_t slot : slots) gs.push_back(L.first_slot + static_cast<size_t>(slot));
  backend_->record_read(gs, stream);
  for (int64_t slot : slots) {
    Slot& s = L.slots[static_cast<size_t>(slot)];
    s.readers -= 1;
    if (s.readers == 0 && s.deferred) issue_copy(L, layer, slot);
  }
}

std::vector<int64_t> Store::slot_experts(int64_t layer) const {
  auto live = hold_open("slot_experts");
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (const Slot& s : layer_at(layer).slots) out.push_back(s.expert);
  return out;
}

std::vector<int64_t> Store::readers(int64_t layer) const {
  auto live = hold_open("readers");
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (const Slot& s : layer_at(layer).slots) out.push_back(s.readers);
  return out;
}

std::vector<bool> Store::ready(int64_t layer) {
  auto live = hold_open("ready");
  std::lock_guard<std::mutex> g(mu_);
  const Layer& L = layer_at(layer);
  std::vector<bool> out;
  for (size_t i = 0; i < L.slots.size(); ++i) {
    const Slot& s = L.slots[i];
    out.push_back(s.loaded && !s.deferred && backend_->copy_done(L.first_slot + i));
  }
  return out;
}

bool Store::verify(int64_t layer, int64_t slot) {
  auto live = hold_open("verify");
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  check_slot(L, layer, slot);
  const Slot& s = L.slots[static_cast<size_t>(slot)];
  if (!s.loaded || s.deferred) return false;
  backend_->synchronize();
  const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
  void* slab = static_cast<char*>(L.slab.get()) + static_cast<size_t>(slot) * eb;
  const int64_t row = L.host_row[static_cast<size_t>(s.expert)];
  if (row >= 0)
    return backend_->equal(slab, static_cast<char*>(L.host.get()) + static_cast<size_t>(row) * eb,
                           eb);
  // A pageable row: compared with a fresh read of the file (into backend host memory).
  const std::shared_ptr<Backend> b = backend_;
  std::shared_ptr<void> tmp(b->alloc_host(eb), [b](void* p) { b->free_host(p); });
  TierBytes scratch;
  if (!files_.read(L.pageable[static_cast<size_t>(s.expert)], tmp.get(), scratch).empty())
    return false;
  return backend_->equal(slab, tmp.get(), eb);
}

void Store::synchronize() {
  auto live = hold_open("synchronize");
  backend_->synchronize();
}

}  // namespace psr
