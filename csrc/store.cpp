// Backend-independent bookkeeping and validation of the expert store.
#include "store.h"

#include "alloc_error.h"

#include <cstring>
#include <new>
#include <sstream>

namespace psr {

namespace {
std::string where(int64_t layer, int64_t slot) {
  std::ostringstream s;
  s << "layer " << layer << " slot " << slot;
  return s.str();
}
}  // namespace

void Backend::set_copy_delay(uint32_t, uint64_t) {
  throw StoreError(
      "copy-delay fault injection is only available on the CPU backend (backend: " + name() + ")");
}
void Backend::fail_next_copies(int64_t) {
  throw StoreError("copy-failure fault injection is not available on the " + name() + " backend");
}

Store::Store(std::vector<LayerSpec> layers, std::string dtype, int64_t itemsize,
             std::unique_ptr<Backend> backend, int copy_retries)
    : dtype_(std::move(dtype)),
      itemsize_(itemsize),
      copy_retries_(copy_retries),
      backend_(std::move(backend)) {
  if (layers.empty()) throw std::invalid_argument("store needs at least one layer");
  if (itemsize_ <= 0) throw std::invalid_argument("itemsize must be positive");
  if (copy_retries_ < 0 || copy_retries_ > kMaxCopyRetries)
    throw std::invalid_argument("copy_retries must be in [0, " + std::to_string(kMaxCopyRetries) +
                                "], got " + std::to_string(copy_retries_));
  backend_name_ = backend_->name();
  dlpack_device_type_ = backend_->dlpack_device_type();
  device_index_ = backend_->device_index();
  size_t total_slots = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& s = layers[i];
    std::ostringstream err;
    if (s.num_experts <= 0)
      err << "layer " << i << ": num_experts must be positive, got " << s.num_experts;
    else if (s.num_slots <= 0 || s.num_slots > s.num_experts)
      err << "layer " << i << ": num_slots must be in [1, num_experts=" << s.num_experts
          << "], got " << s.num_slots;
    else if (s.expert_bytes <= 0 || s.expert_bytes % itemsize_ != 0)
      err << "layer " << i << ": expert_bytes must be a positive multiple of the itemsize "
          << itemsize_ << ", got " << s.expert_bytes;
    if (!err.str().empty()) throw std::invalid_argument(err.str());
  }
  // Each buffer frees itself through the backend when its last holder (the
  // store, or a DLPack view) lets go; on a throw below the members do it.
  const std::shared_ptr<Backend> b = backend_;
  layers_.resize(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    Layer& L = layers_[i];
    L.spec = layers[i];
    L.first_slot = total_slots;
    total_slots += static_cast<size_t>(L.spec.num_slots);
    const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
    size_t host_bytes = 0, slab_bytes = 0;
    if (__builtin_mul_overflow(eb, static_cast<size_t>(L.spec.num_experts), &host_bytes) ||
        __builtin_mul_overflow(eb, static_cast<size_t>(L.spec.num_slots), &slab_bytes))
      throw AllocError("layer " + std::to_string(i) + ": " + std::to_string(L.spec.num_experts) +
                       " experts of " + std::to_string(eb) + " bytes overflow the address space");
    L.host = std::shared_ptr<void>(b->alloc_host(host_bytes), [b](void* p) { b->free_host(p); });
    L.slab = std::shared_ptr<void>(b->alloc_slab(slab_bytes), [b](void* p) { b->free_slab(p); });
    L.host_device = b->device_address(L.host.get());
    L.registered.assign(static_cast<size_t>(L.spec.num_experts), false);
    L.slots.assign(static_cast<size_t>(L.spec.num_slots), Slot{});
  }
  backend_->init_slots(total_slots);
}

Store::~Store() {
  try {
    close();
  } catch (...) {
  }
}

void Store::close() {
  std::unique_lock<std::shared_mutex> life(life_);  // waits for calls in flight
  if (closed_) return;
  closed_ = true;
  backend_->shutdown();
  for (Layer& L : layers_) {
    L.host.reset();
    L.slab.reset();
  }
}

bool Store::closed() const {
  std::shared_lock<std::shared_mutex> life(life_);
  return closed_;
}

std::shared_lock<std::shared_mutex> Store::hold_open(const char* what) const {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) throw StoreError(std::string(what) + ": the store is closed");
  return life;
}

Store::Layer& Store::layer_at(int64_t layer) {
  return const_cast<Layer&>(static_cast<const Store*>(this)->layer_at(layer));
}

const Store::Layer& Store::layer_at(int64_t layer) const {
  if (layer < 0 || layer >= num_layers()) {
    std::ostringstream s;
    s << "layer " << layer << " out of range [0, " << num_layers() << ")";
    throw std::out_of_range(s.str());
  }
  return layers_[static_cast<size_t>(layer)];
}

LayerSpec Store::spec(int64_t layer) const {
  auto live = hold_open("spec");
  return layer_at(layer).spec;
}

std::shared_ptr<void> Store::slab_buffer(int64_t layer) const {
  auto live = hold_open("slab");
  return layer_at(layer).slab;
}

std::shared_ptr<void> Store::host_buffer(int64_t layer) const {
  auto live = hold_open("host");
  return layer_at(layer).host;
}

void Store::check_slot(const Layer& L, int64_t layer, int64_t slot) const {
  if (slot < 0 || slot >= L.spec.num_slots) {
    std::ostringstream s;
    s << "slot " << slot << " out of range [0, " << L.spec.num_slots << ") in layer " << layer;
    throw std::out_of_range(s.str());
  }
}

void Store::empty_slot(Slot& s) {
  const uint64_t gen = s.gen + 1;
  s = Slot{};
  s.gen = gen;
}

void Store::register_expert(int64_t layer, int64_t expert, const std::string& dtype,
                            const std::vector<std::pair<uintptr_t, size_t>>& parts) {
  auto live = hold_open("register_expert");
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  if (expert < 0 || expert >= L.spec.num_experts) {
    std::ostringstream s;
    s << "expert " << expert << " out of range [0, " << L.spec.num_experts << ") in layer "
      << layer;
    throw std::out_of_range(s.str());
  }
  if (dtype != dtype_)
    throw std::invalid_argument("dtype mismatch registering layer " + std::to_string(layer) +
                                " expert " + std::to_string(expert) + ": store holds " + dtype_ +
                                ", got " + dtype);
  size_t total = 0;
  for (const auto& p : parts) {
    if (p.second > 0 && p.first == 0) throw std::invalid_argument("null source pointer");
    total += p.second;
  }
  if (total != static_cast<size_t>(L.spec.expert_bytes))
    throw std::invalid_argument("size mismatch registering layer " + std::to_string(layer) +
                                " expert " + std::to_string(expert) + ": expected " +
                                std::to_string(L.spec.expert_bytes) + " bytes, got " +
                                std::to_string(total));
  // Copies already issued from this buffer must finish before it is rewritten.
  for (const Slot& s : L.slots)
    if (s.loaded && s.expert == expert) {
      backend_->synchronize();
      break;
    }
  char* dst = static_cast<char*>(L.host.get()) + static_cast<size_t>(expert) * total;
  for (const auto& p : parts) {
    std::memcpy(dst, reinterpret_cast<const void*>(p.first), p.second);
    dst += p.second;
  }
  L.registered[static_cast<size_t>(expert)] = true;
}

bool Store::is_registered(int64_t layer, int64_t expert) const {
  auto live = hold_open("is_registered");
  std::lock_guard<std::mutex> g(mu_);
  const Layer& L = layer_at(layer);
  if (expert < 0 || expert >= L.spec.num_experts) return false;
  return L.registered[static_cast<size_t>(expert)];
}

// Issues the copy of the expert slot `slot` is assigned; mu_ held.
void Store::issue_copy(Layer& L, int64_t layer, int64_t slot) {
  Slot& s = L.slots[static_cast<size_t>(slot)];
  const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
  void* dst = static_cast<char*>(L.slab.get()) + static_cast<size_t>(slot) * eb;
  const void* src = static_cast<const char*>(L.host.get()) + static_cast<size_t>(s.expert) * eb;
  try {
    backend_->copy_async(L.first_slot + static_cast<size_t>(slot), dst, src, eb,
                         "layer " + std::to_string(layer) + " expert " + std::to_string(s.expert) +
                             " -> slot " + std::to_string(slot));
  } catch (...) {
    const int64_t readers = s.readers;
    empty_slot(s);  // nothing was issued: the slot holds nothing usable
    s.readers = readers;
    throw;
  }
  s.loaded = true;
  s.deferred = false;
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
    if (e < 0 || e >= L.spec.num_experts) {
      std::ostringstream s;
      s << "expert " << e << " out of range [0, " << L.spec.num_experts << ") in layer " << layer;
      throw std::out_of_range(s.str());
    }
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
  GatherArgs a;
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
  backend_->join(static_cast<size_t>(layer), stream, c);
  std::lock_guard<std::mutex> g(mu_);
  counters_.stall_ns += c.stall_ns;
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
    if (s.expert == experts[i] && s.loaded == (experts[i] >= 0)) continue;
    s.expert = experts[i];
    s.loaded = experts[i] >= 0;
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
    std::vector<size_t> gs;
    for (size_t k : pending) gs.push_back(L.first_slot + static_cast<size_t>(uniq[k]));
    // Wait without the lock so other threads may keep issuing copies.
    lk.unlock();
    Counters c;
    const std::vector<std::string> errs = backend_->wait_copies(gs, stream, c);
    lk.lock();
    counters_.waits += c.waits;
    counters_.stalled_waits += c.stalled_waits;
    counters_.stall_ns += c.stall_ns;
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
  return backend_->equal(static_cast<char*>(L.slab.get()) + static_cast<size_t>(slot) * eb,
                         static_cast<char*>(L.host.get()) + static_cast<size_t>(s.expert) * eb, eb);
}

void Store::synchronize() {
  auto live = hold_open("synchronize");
  backend_->synchronize();
}

Counters Store::counters() {
  auto live = hold_open("counters");
  const uint64_t extra = backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_.stall_ns += extra;
  return counters_;
}

void Store::reset_counters() {
  auto live = hold_open("reset_counters");
  backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_ = Counters{};
}

void Store::set_copy_delay(uint32_t max_delay_us, uint64_t seed) {
  auto live = hold_open("set_copy_delay");
  backend_->set_copy_delay(max_delay_us, seed);
}

void Store::fail_next_copies(int64_t n) {
  auto live = hold_open("fail_next_copies");
  backend_->fail_next_copies(n);
}

}  // namespace psr
