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
  throw StoreError("copy-delay fault injection is only available on the CPU backend (backend: " +
                   name() + ")");
}
void Backend::fail_next_copies(int64_t) {
  throw StoreError("copy-failure fault injection is only available on the CPU backend (backend: " +
                   name() + ")");
}

Store::Store(std::vector<LayerSpec> layers, std::string dtype, int64_t itemsize,
             std::unique_ptr<Backend> backend)
    : dtype_(std::move(dtype)), itemsize_(itemsize), backend_(std::move(backend)) {
  if (layers.empty()) throw std::invalid_argument("store needs at least one layer");
  if (itemsize_ <= 0) throw std::invalid_argument("itemsize must be positive");
  size_t total_slots = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerSpec& s = layers[i];
    std::ostringstream err;
    if (s.num_experts <= 0) err << "layer " << i << ": num_experts must be positive, got " << s.num_experts;
    else if (s.num_slots <= 0 || s.num_slots > s.num_experts)
      err << "layer " << i << ": num_slots must be in [1, num_experts=" << s.num_experts << "], got "
          << s.num_slots;
    else if (s.expert_bytes <= 0 || s.expert_bytes % itemsize_ != 0)
      err << "layer " << i << ": expert_bytes must be a positive multiple of the itemsize "
          << itemsize_ << ", got " << s.expert_bytes;
    if (!err.str().empty()) throw std::invalid_argument(err.str());
  }
  layers_.resize(layers.size());
  try {
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
      L.host = backend_->alloc_host(host_bytes);
      L.slab = backend_->alloc_slab(slab_bytes);
      L.registered.assign(static_cast<size_t>(L.spec.num_experts), false);
      L.slots.assign(static_cast<size_t>(L.spec.num_slots), Slot{});
    }
    backend_->init_slots(total_slots);
  } catch (...) {
    for (Layer& L : layers_) {
      if (L.host) backend_->free_host(L.host);
      if (L.slab) backend_->free_slab(L.slab);
    }
    throw;
  }
}

Store::~Store() {
  try {
    backend_->synchronize();
  } catch (...) {
  }
  for (Layer& L : layers_) {
    backend_->free_host(L.host);
    backend_->free_slab(L.slab);
  }
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

const LayerSpec& Store::spec(int64_t layer) const { return layer_at(layer).spec; }
void* Store::slab_ptr(int64_t layer) const { return layer_at(layer).slab; }
void* Store::host_ptr(int64_t layer) const { return layer_at(layer).host; }

void Store::check_slot(const Layer& L, int64_t layer, int64_t slot) const {
  if (slot < 0 || slot >= L.spec.num_slots) {
    std::ostringstream s;
    s << "slot " << slot << " out of range [0, " << L.spec.num_slots << ") in layer " << layer;
    throw std::out_of_range(s.str());
  }
}

void Store::register_expert(int64_t layer, int64_t expert, const std::string& dtype,
                            const std::vector<std::pair<uintptr_t, size_t>>& parts) {
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  if (expert < 0 || expert >= L.spec.num_experts) {
    std::ostringstream s;
    s << "expert " << expert << " out of range [0, " << L.spec.num_experts << ") in layer " << layer;
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
  char* dst = static_cast<char*>(L.host) + static_cast<size_t>(expert) * total;
  for (const auto& p : parts) {
    std::memcpy(dst, reinterpret_cast<const void*>(p.first), p.second);
    dst += p.second;
  }
  L.registered[static_cast<size_t>(expert)] = true;
}

bool Store::is_registered(int64_t layer, int64_t expert) const {
  std::lock_guard<std::mutex> g(mu_);
  const Layer& L = layer_at(layer);
  if (expert < 0 || expert >= L.spec.num_experts) return false;
  return L.registered[static_cast<size_t>(expert)];
}

void Store::issue_copy(Layer& L, int64_t layer, int64_t slot) {
  Slot& s = L.slots[static_cast<size_t>(slot)];
  const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
  void* dst = static_cast<char*>(L.slab) + static_cast<size_t>(slot) * eb;
  const void* src = static_cast<const char*>(L.host) + static_cast<size_t>(s.expert) * eb;
  backend_->copy_async(L.first_slot + static_cast<size_t>(slot), dst, src, eb,
                       "layer " + std::to_string(layer) + " expert " + std::to_string(s.expert) +
                           " -> slot " + std::to_string(slot));
  s.deferred = false;
  counters_.copies += 1;
  counters_.bytes_copied += eb;
}

void Store::load(int64_t layer, const std::vector<int64_t>& slots,
                 const std::vector<int64_t>& experts) {
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  if (slots.size() != experts.size())
    throw std::invalid_argument("load: " + std::to_string(slots.size()) + " slots but " +
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
        throw std::invalid_argument("load: slot " + std::to_string(slots[i]) +
                                    " appears twice in one batch");
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    Slot& s = L.slots[static_cast<size_t>(slots[i])];
    s.expert = experts[i];
    s.loaded = true;
    if (s.readers > 0)
      s.deferred = true;  // issued by the last release()
    else
      issue_copy(L, layer, slots[i]);
  }
}

void Store::acquire(int64_t layer, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& experts, uintptr_t stream) {
  std::vector<size_t> gs;
  {
    std::lock_guard<std::mutex> g(mu_);
    Layer& L = layer_at(layer);
    if (!experts.empty() && experts.size() != slots.size())
      throw std::invalid_argument("acquire: " + std::to_string(slots.size()) + " slots but " +
                                  std::to_string(experts.size()) + " experts");
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
      gs.push_back(L.first_slot + static_cast<size_t>(slots[i]));
    }
  }
  // Wait without the lock so other threads may keep issuing loads.
  Counters c;
  std::vector<std::string> errs = backend_->wait_copies(gs, stream, c);
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  counters_.waits += c.waits;
  counters_.stalled_waits += c.stalled_waits;
  counters_.stall_ns += c.stall_ns;
  std::string failed;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (errs[i].empty()) continue;
    Slot& s = L.slots[static_cast<size_t>(slots[i])];
    s = Slot{};  // its contents are undefined: leave it empty and loadable
    counters_.failed_copies += 1;
    failed += (failed.empty() ? "" : "; ") + errs[i];
  }
  if (!failed.empty()) throw CopyError("copy failed: " + failed);
  for (int64_t slot : slots) L.slots[static_cast<size_t>(slot)].readers += 1;
}

void Store::release(int64_t layer, const std::vector<int64_t>& slots, uintptr_t stream) {
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
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (const Slot& s : layer_at(layer).slots) out.push_back(s.expert);
  return out;
}

std::vector<int64_t> Store::readers(int64_t layer) const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (const Slot& s : layer_at(layer).slots) out.push_back(s.readers);
  return out;
}

std::vector<bool> Store::ready(int64_t layer) {
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
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  check_slot(L, layer, slot);
  const Slot& s = L.slots[static_cast<size_t>(slot)];
  if (!s.loaded || s.deferred) return false;
  backend_->synchronize();
  const size_t eb = static_cast<size_t>(L.spec.expert_bytes);
  return backend_->equal(static_cast<char*>(L.slab) + static_cast<size_t>(slot) * eb,
                         static_cast<char*>(L.host) + static_cast<size_t>(s.expert) * eb, eb);
}

void Store::synchronize() { backend_->synchronize(); }

Counters Store::counters() {
  const uint64_t extra = backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_.stall_ns += extra;
  return counters_;
}

void Store::reset_counters() {
  backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_ = Counters{};
}

}  // namespace psr
