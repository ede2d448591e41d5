// The CPU hand-off's per-layer task (store_cpu.cpp sets it up and runs it; store.cpp
// closes it and reads its counters): private to the store's sources.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/expert_gemv.h"
#include "store.h"

namespace psr {

// --- the device step's CPU experts -------------------------------------------------

// One layer's CPU experts for the device step: the host stage the transfers fill and
// drain (pinned on CUDA), and run(), the host function. Persistent: a captured graph
// calls run with the same ctx on every replay.
struct CpuTask {
  cpu::Layout lay;
  int threads = 1;
  cpu::Act act = cpu::Act::swiglu;
  float alpha = 1.702f, limit = 7.0f;
  int x_dtype = 0, w_dtype = 0, id_bytes = 8;
  int64_t H = 0, K = 0, E = 0;
  int64_t layer = 0;
  std::shared_ptr<void> host;  // the layer's rows (kept alive), all held: row e = expert e
  const uint8_t* rows = nullptr;
  // The stage: x [H] (its dtype), ids [K], weights [K], the CPU list [K] int32, y [H] fp32.
  std::shared_ptr<void> stage;
  uint8_t* x_h = nullptr;
  uint8_t* ids_h = nullptr;
  uint8_t* w_h = nullptr;
  int32_t* list_h = nullptr;
  float* y_h = nullptr;
  size_t x_bytes = 0, ids_bytes = 0, w_bytes = 0;
  // Scratch of run(): x widened, the listed experts' rows and weights in routed order.
  std::vector<float> xf, wsel;
  std::vector<int64_t> sel;
  std::atomic<uint64_t> tasks{0}, experts{0}, ns{0};
  std::mutex err_mu;
  std::string error;  // the first since the last check

  static float widen(const uint8_t* p, int dtype, int64_t i) {
    if (dtype == 1) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return cpu::bf16_to_f32(b);
    }
    if (dtype == 2) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return cpu::f16_to_f32(b);
    }
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }

  void fail(const std::string& what) {
    std::fill(y_h, y_h + H, 0.f);
    std::lock_guard<std::mutex> g(err_mu);
    if (error.empty()) error = "layer " + std::to_string(layer) + " CPU experts: " + what;
  }

  // The listed experts of the staged token; never throws (it runs as a CUDA host function).
  void compute() noexcept {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      sel.clear();
      wsel.clear();
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = id_bytes == 4 ? reinterpret_cast<const int32_t*>(ids_h)[j]
                                        : reinterpret_cast<const int64_t*>(ids_h)[j];
        if (e < 0 || e >= E) return fail("routed expert id " + std::to_string(e) + " out of range");
        bool listed = false;
        for (int64_t c = 0; c < K && list_h[c] >= 0; ++c) listed |= list_h[c] == e;
        if (!listed) continue;
        sel.push_back(e);
        wsel.push_back(widen(w_h, w_dtype, j));
      }
      if (sel.empty()) {
        std::fill(y_h, y_h + H, 0.f);
      } else {
        for (int64_t i = 0; i < H; ++i) xf[static_cast<size_t>(i)] = widen(x_h, x_dtype, i);
        cpu::Call c;
        c.x = xf.data();
        c.tokens = 1;
        c.rows = rows;
        c.num_rows = E;
        c.row_stride = lay.row_bytes;
        c.ids = sel.data();
        c.id_bytes = 8;
        c.k = static_cast<int64_t>(sel.size());
        c.weights = wsel.data();
        c.y = y_h;
        c.act = act;
        c.alpha = alpha;
        c.limit = limit;
        cpu::expert_ffn(lay, c, threads, cpu::best_isa());
      }
      tasks += 1;
      experts += sel.size();
    } catch (const std::exception& e) {
      fail(e.what());
    } catch (...) {
      fail("unknown error");
    }
    ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }

  static void run(void* ctx) { static_cast<CpuTask*>(ctx)->compute(); }

  // StoreError with the first error since the last call, if any.
  void raise() {
    std::string e;
    {
      std::lock_guard<std::mutex> g(err_mu);
      e.swap(error);
    }
    if (!e.empty()) throw StoreError(e);
  }
};

}  // namespace psr
