// Backend-independent bookkeeping and validation of the expert store: construction,
// registration of held rows, lifetime and counters. The other rooms of the same `Store`:
// store_copies.cpp (the copy engine: copies into slots, acquire / release, gathers),
// pageable.cpp (the pageable reader: FileSet and pageable rows), store_cpu.cpp (the CPU
// hand-off: experts computed on the CPU in stream order).
#include "store.h"

#include "alloc_error.h"
#include "cpu_task.h"

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
    else if (s.num_slots < 0 || s.num_slots > s.num_experts)
      err << "layer " << i << ": num_slots must be in [0, num_experts=" << s.num_experts
          << "], got " << s.num_slots;
    else if (s.expert_bytes <= 0 || s.expert_bytes % itemsize_ != 0)
      err << "layer " << i << ": expert_bytes must be a positive multiple of the itemsize "
          << itemsize_ << ", got " << s.expert_bytes;
    else if (s.num_held < -1 || s.num_held > s.num_experts)
      err << "layer " << i << ": num_held must be in [0, num_experts=" << s.num_experts
          << "] (or -1: all), got " << s.num_held;
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
    if (L.spec.num_held < 0) L.spec.num_held = L.spec.num_experts;
    size_t host_bytes = 0, slab_bytes = 0;
    if (__builtin_mul_overflow(eb, static_cast<size_t>(L.spec.num_held), &host_bytes) ||
        __builtin_mul_overflow(eb, static_cast<size_t>(L.spec.num_slots), &slab_bytes))
      throw AllocError("layer " + std::to_string(i) + ": " + std::to_string(L.spec.num_experts) +
                       " experts of " + std::to_string(eb) + " bytes overflow the address space");
    // A layer with no held rows still gets a (tiny) buffer: its view is [0, expert_bytes].
    L.host = std::shared_ptr<void>(b->alloc_host(std::max<size_t>(host_bytes, 64)),
                                   [b](void* p) { b->free_host(p); });
    // No slots (experts_on cpu: every expert computed from the host rows) still gets a
    // (tiny) buffer, so the [0, expert_bytes] view has an address.
    L.slab = std::shared_ptr<void>(b->alloc_slab(std::max<size_t>(slab_bytes, 64)),
                                   [b](void* p) { b->free_slab(p); });
    L.host_device = b->device_address(L.host.get());
    L.registered.assign(static_cast<size_t>(L.spec.num_experts), false);
    L.slots.assign(static_cast<size_t>(L.spec.num_slots), Slot{});
    // All held: row e is expert e (the CUDA gather kernel indexes rows by expert).
    const bool all = L.spec.num_held == L.spec.num_experts;
    L.host_row.resize(static_cast<size_t>(L.spec.num_experts));
    for (int64_t e = 0; e < L.spec.num_experts; ++e)
      L.host_row[static_cast<size_t>(e)] = all ? e : -1;
    L.pageable.resize(static_cast<size_t>(L.spec.num_experts));
    L.poisoned.reset(new std::atomic<uint8_t>[static_cast<size_t>(L.spec.num_slots)]);
    for (int64_t k = 0; k < L.spec.num_slots; ++k) L.poisoned[static_cast<size_t>(k)] = 0;
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
  backend_->shutdown();  // after the host tasks queued, too
  for (Layer& L : layers_) {
    L.host.reset();
    L.slab.reset();
    if (L.cpu_task) {
      L.cpu_task->host.reset();
      L.cpu_task->stage.reset();
    }
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

void Store::check_expert(const Layer& L, int64_t layer, int64_t expert) const {
  if (expert < 0 || expert >= L.spec.num_experts) {
    std::ostringstream s;
    s << "expert " << expert << " out of range [0, " << L.spec.num_experts << ") in layer "
      << layer;
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
  check_expert(L, layer, expert);
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
  const size_t ei = static_cast<size_t>(expert);
  if (L.host_row[ei] < 0) {
    if (L.next_held >= L.spec.num_held)
      throw StoreError("layer " + std::to_string(layer) + ": all " +
                       std::to_string(L.spec.num_held) + " held rows are taken; expert " +
                       std::to_string(expert) + " must be registered as pageable");
    if (!L.pageable[ei].empty()) {  // a pageable expert becomes held
      L.pageable[ei].clear();
      L.num_pageable -= 1;
    }
    L.host_row[ei] = L.next_held++;
  }
  // Copies already issued from this buffer must finish before it is rewritten.
  for (const Slot& s : L.slots)
    if (s.loaded && s.expert == expert) {
      backend_->synchronize();
      break;
    }
  char* dst = static_cast<char*>(L.host.get()) + static_cast<size_t>(L.host_row[ei]) * total;
  for (const auto& p : parts) {
    std::memcpy(dst, reinterpret_cast<const void*>(p.first), p.second);
    dst += p.second;
  }
  L.registered[static_cast<size_t>(expert)] = true;
}

std::vector<int64_t> Store::host_rows(int64_t layer) const {
  auto live = hold_open("host_rows");
  std::lock_guard<std::mutex> g(mu_);
  return layer_at(layer).host_row;
}

bool Store::is_registered(int64_t layer, int64_t expert) const {
  auto live = hold_open("is_registered");
  std::lock_guard<std::mutex> g(mu_);
  const Layer& L = layer_at(layer);
  if (expert < 0 || expert >= L.spec.num_experts) return false;
  return L.registered[static_cast<size_t>(expert)];
}

Counters Store::counters() {
  auto live = hold_open("counters");
  const uint64_t extra = backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_.stall_ns += extra;
  Counters c = counters_;
  c.bytes_pinned = tiers_.pinned;
  c.bytes_pageable = tiers_.pageable;
  c.bytes_page_cache = tiers_.page_cache;
  c.bytes_disk = tiers_.disk;
  c.read_errors = tiers_.read_errors;
  for (const Layer& L : layers_)
    if (L.cpu_task) {
      c.cpu_tasks += L.cpu_task->tasks;
      c.cpu_task_experts += L.cpu_task->experts;
      c.cpu_task_ns += L.cpu_task->ns;
    }
  return c;
}

void Store::reset_counters() {
  auto live = hold_open("reset_counters");
  backend_->drain_stall_ns();
  std::lock_guard<std::mutex> g(mu_);
  counters_ = Counters{};
  for (Layer& L : layers_)
    if (L.cpu_task)
      for (auto* a : {&L.cpu_task->tasks, &L.cpu_task->experts, &L.cpu_task->ns}) a->store(0);
  for (auto* a :
       {&tiers_.pinned, &tiers_.pageable, &tiers_.page_cache, &tiers_.disk, &tiers_.read_errors})
    a->store(0);
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
