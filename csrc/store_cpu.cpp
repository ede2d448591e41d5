// The CPU hand-off: a layer's experts computed on the CPU in stream order (the device
// step's split), on the CPU expert kernels' pool.
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

void Store::cpu_experts_setup(int64_t layer, const cpu::Layout& lay, int threads, cpu::Act act,
                              float alpha, float limit, int x_dtype, int w_dtype, int id_bytes,
                              int64_t top_k) {
  auto live = hold_open("cpu_experts_setup");
  std::unique_lock<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  const std::string at = "cpu_experts_setup: layer " + std::to_string(layer) + ": ";
  if (L.num_pageable > 0 || L.spec.num_held != L.spec.num_experts)
    throw StoreError(at + "CPU experts read host rows in place: every expert must be held");
  for (int64_t e = 0; e < L.spec.num_experts; ++e)
    if (!L.registered[static_cast<size_t>(e)])
      throw StoreError(at + "expert " + std::to_string(e) + " is not registered");
  if (lay.row_bytes != L.spec.expert_bytes)
    throw std::invalid_argument(at + "the layout's rows hold " + std::to_string(lay.row_bytes) +
                                " bytes, the store's " + std::to_string(L.spec.expert_bytes));
  if (lay.hidden <= 0) throw std::invalid_argument(at + "hidden size must be positive");
  if (top_k <= 0 || top_k > L.spec.num_experts)
    throw std::invalid_argument(at + "top_k must be in [1, " + std::to_string(L.spec.num_experts) +
                                "], got " + std::to_string(top_k));
  if (x_dtype < 0 || x_dtype > 2 || w_dtype < 0 || w_dtype > 2)
    throw std::invalid_argument(at + "x and weights must be fp32 (0), bf16 (1) or fp16 (2)");
  if (id_bytes != 4 && id_bytes != 8) throw std::invalid_argument(at + "ids must be int32/int64");
  if (threads < 1 || threads > cpu::max_threads())
    throw std::invalid_argument(at + "threads must be in [1, " +
                                std::to_string(cpu::max_threads()) + "], got " +
                                std::to_string(threads));
  auto t = std::make_unique<CpuTask>();
  t->lay = lay;
  t->threads = threads;
  t->act = act;
  t->alpha = alpha;
  t->limit = limit;
  t->x_dtype = x_dtype;
  t->w_dtype = w_dtype;
  t->id_bytes = id_bytes;
  t->H = lay.hidden;
  t->K = top_k;
  t->E = L.spec.num_experts;
  t->layer = layer;
  t->host = L.host;
  t->rows = static_cast<const uint8_t*>(L.host.get());
  // Validate the layout with a call of no tokens (the kernels' own checks).
  {
    float dummy = 0.f;
    cpu::Call c;
    c.x = &dummy;
    c.y = &dummy;
    c.rows = t->rows;
    c.num_rows = t->E;
    c.row_stride = lay.row_bytes;
    cpu::expert_ffn(lay, c, threads, cpu::best_isa());
  }
  const size_t H = static_cast<size_t>(t->H), K = static_cast<size_t>(top_k);
  t->x_bytes = H * (x_dtype == 0 ? 4 : 2);
  t->ids_bytes = K * static_cast<size_t>(id_bytes);
  t->w_bytes = K * (w_dtype == 0 ? 4 : 2);
  // 64-byte aligned parts of one stage allocation.
  auto up = [](size_t n) { return (n + 63) / 64 * 64; };
  const size_t o_ids = up(t->x_bytes), o_w = o_ids + up(t->ids_bytes),
               o_list = o_w + up(t->w_bytes), o_y = o_list + up(4 * K), total = o_y + up(4 * H);
  const std::shared_ptr<Backend> b = backend_;
  t->stage = std::shared_ptr<void>(b->alloc_host(total), [b](void* p) { b->free_host(p); });
  auto* base = static_cast<uint8_t*>(t->stage.get());
  std::memset(base, 0, total);
  t->x_h = base;
  t->ids_h = base + o_ids;
  t->w_h = base + o_w;
  t->list_h = reinterpret_cast<int32_t*>(base + o_list);
  t->y_h = reinterpret_cast<float*>(base + o_y);
  t->xf.assign(H, 0.f);
  t->sel.reserve(K);
  t->wsel.reserve(K);
  if (L.cpu_task) {  // one in flight may still read the old task: let it finish first
    g.unlock();
    backend_->synchronize();
    g.lock();
    counters_.cpu_tasks += L.cpu_task->tasks;
    counters_.cpu_task_experts += L.cpu_task->experts;
    counters_.cpu_task_ns += L.cpu_task->ns;
  }
  L.cpu_task = std::move(t);
}

void Store::cpu_experts(int64_t layer, uintptr_t x, uintptr_t ids, uintptr_t weights,
                        uintptr_t list, uintptr_t y, uintptr_t stream) {
  auto live = hold_open("cpu_experts");
  CpuTask* t = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    t = layer_at(layer).cpu_task.get();
  }
  if (!t)
    throw StoreError("cpu_experts: layer " + std::to_string(layer) +
                     " has no CPU experts set up (cpu_experts_setup)");
  if (!x || !ids || !weights || !list || !y)
    throw std::invalid_argument("cpu_experts: null device address");
  t->raise();
  const std::vector<Transfer> in{
      {reinterpret_cast<const void*>(x), t->x_h, t->x_bytes},
      {reinterpret_cast<const void*>(ids), t->ids_h, t->ids_bytes},
      {reinterpret_cast<const void*>(weights), t->w_h, t->w_bytes},
      {reinterpret_cast<const void*>(list), t->list_h, 4 * static_cast<size_t>(t->K)}};
  const std::vector<Transfer> out{
      {t->y_h, reinterpret_cast<void*>(y), 4 * static_cast<size_t>(t->H)}};
  backend_->host_task(in, &CpuTask::run, t, out, stream, static_cast<size_t>(layer));
  t->raise();  // CPU backend: it ran now
}

void Store::cpu_join(int64_t layer, uintptr_t stream) {
  auto live = hold_open("cpu_join");
  CpuTask* t = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    t = layer_at(layer).cpu_task.get();
  }
  if (!t) return;
  backend_->host_join(static_cast<size_t>(layer), stream);
  t->raise();
}

void Store::cpu_check() {
  auto live = hold_open("cpu_check");
  std::lock_guard<std::mutex> g(mu_);
  for (Layer& L : layers_)
    if (L.cpu_task) L.cpu_task->raise();
}

}  // namespace psr
