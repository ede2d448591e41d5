// CPU backend: stands in for pinned memory, a copy stream and events where no
// GPU exists. The "slab" is aligned host memory, one worker thread performs
// copies in order (like a CUDA stream), and per-slot tickets guarded by a
// condition variable play the role of copy events. The compute side is the
// calling thread, which reads slots synchronously, so read events are
// implicit: Store never issues a copy into a slot that is still held.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#endif

#include "../alloc_error.h"
#include "../store.h"

namespace psr {
namespace {

constexpr size_t kAlign = 4096;

void* aligned(size_t bytes, const char* what) {
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = rounded >= bytes ? std::aligned_alloc(kAlign, rounded) : nullptr;
  if (!p)
    throw AllocError(std::string("cannot allocate ") + std::to_string(bytes) + " bytes of " + what +
                     " memory");
  return p;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(uint32_t max_delay_us, uint64_t seed) { set_copy_delay(max_delay_us, seed); }

  ~CpuBackend() override { shutdown(); }

  std::string name() const override { return "cpu"; }
  int dlpack_device_type() const override { return 1; }
  int device_index() const override { return 0; }
  void* alloc_host(size_t bytes) override { return aligned(bytes, "host"); }
  void free_host(void* p) noexcept override { std::free(p); }
  void* alloc_slab(size_t bytes) override { return aligned(bytes, "slab"); }
  void free_slab(void* p) noexcept override { std::free(p); }

  void init_slots(size_t n) override {
    std::lock_guard<std::mutex> g(mu_);
    slots_.assign(n, SlotState{});
    if (!worker_.joinable()) {
      worker_ = std::thread([this] { run(); });
#if defined(__linux__)
      // Named before init returns, so tools (and tests) tell the copy worker from torch's
      // lazily started pool threads without racing the thread's own start.
      pthread_setname_np(worker_.native_handle(), "psr-copy");
#endif
    }
  }

  void copy_async(size_t g, void* dst, const void* src, size_t bytes,
                  const std::string& what) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      Job j{g, dst, src, bytes, ++slots_[g].issued, what, false};
      if (fail_next_ > 0) {
        --fail_next_;
        j.fail = true;
      }
      queue_.push_back(std::move(j));
    }
    cv_.notify_all();
  }

  // The worker reads the row from the file straight into the slot (no staging: the
  // "device" is host memory here), so the whole pageable path runs without a GPU.
  void copy_pageable(size_t g, void* dst, const PageableRow& row, const FileSet& files,
                     TierBytes& t, int64_t cached, size_t bytes, const std::string& what) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      Job j{g, dst, nullptr, bytes, ++slots_[g].issued, what, false};
      if (fail_next_ > 0) {
        --fail_next_;
        j.fail = true;
      }
      j.row = &row;
      j.files = &files;
      j.tiers = &t;
      j.cached = cached;
      queue_.push_back(std::move(j));
    }
    cv_.notify_all();
  }

  bool gathers_pageable() const override { return true; }

  std::vector<std::string> wait_copies(const std::vector<size_t>& gs, uintptr_t,
                                       Counters& c) override {
    std::vector<std::string> errs(gs.size());
    std::unique_lock<std::mutex> lk(mu_);
    for (size_t i = 0; i < gs.size(); ++i) {
      SlotState& s = slots_[gs[i]];
      c.waits += 1;
      if (s.done < s.issued) {
        c.stalled_waits += 1;
        const auto t0 = std::chrono::steady_clock::now();
        cv_.wait(lk, [&] { return s.done >= s.issued; });
        c.stall_ns += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::steady_clock::now() - t0)
                                                .count());
      }
      errs[i] = s.error;
    }
    return errs;
  }

  void record_read(const std::vector<size_t>&, uintptr_t) override {}

  // side=false runs now in the calling thread (the compute side); side=true is a
  // job for the worker, after the copies queued before it, with the seeded delay.
  void gather(const GatherArgs& a, uintptr_t, bool side, size_t tag) override {
    if (!side) {
      bool read_error = false;
      const std::string err = run_gather(a, nullptr, &read_error);
      if (!err.empty()) {
        if (read_error) throw CopyError(err);
        throw StoreError(err);
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (tags_.size() <= tag) tags_.resize(tag + 1);
      Job j{};
      j.gather = true;
      j.args = a;
      j.g = tag;
      j.ticket = ++tags_[tag].issued;
      queue_.push_back(std::move(j));
    }
    cv_.notify_all();
  }

  void join(size_t tag, uintptr_t, Counters& c) override {
    std::unique_lock<std::mutex> lk(mu_);
    if (tags_.size() <= tag) return;
    TagState& t = tags_[tag];
    if (t.done < t.issued) {
      const auto t0 = std::chrono::steady_clock::now();
      cv_.wait(lk, [&] { return t.done >= t.issued; });
      const uint64_t ns =
          static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now() - t0)
                                    .count());
      c.stall_ns += ns;
      if (t.pageable) c.stall_pageable_ns += ns;  // the gathers waited for read the file
    }
    t.pageable = false;
    if (!t.error.empty()) {
      std::string err;
      err.swap(t.error);
      const bool read = t.read_error;
      t.read_error = false;
      if (read) throw CopyError(err);
      throw StoreError(err);
    }
  }

  void fence(uintptr_t) override {}  // the compute side is synchronous

  // The compute side is the calling thread: the task runs now, between its transfers.
  void host_task(const std::vector<Transfer>& in, HostFn fn, void* ctx,
                 const std::vector<Transfer>& out, uintptr_t, size_t) override {
    for (const Transfer& t : in) std::memcpy(t.dst, t.src, t.bytes);
    fn(ctx);
    for (const Transfer& t : out) std::memcpy(t.dst, t.src, t.bytes);
  }
  void host_join(size_t, uintptr_t) override {}

  bool copy_done(size_t g) override {
    std::lock_guard<std::mutex> lk(mu_);
    return slots_[g].done >= slots_[g].issued;
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  }

  bool equal(const void* slot, const void* host, size_t bytes) override {
    return std::memcmp(slot, host, bytes) == 0;
  }

  // The worker drains the queue, then exits; memory stays with its owners.
  void shutdown() noexcept override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  void set_copy_delay(uint32_t max_delay_us, uint64_t seed) override {
    std::lock_guard<std::mutex> g(mu_);
    max_delay_us_ = max_delay_us;
    rng_.seed(seed);
  }

  void fail_next_copies(int64_t n) override {
    if (n < 0) throw std::invalid_argument("fail_next_copies: n must be >= 0");
    std::lock_guard<std::mutex> g(mu_);
    fail_next_ = n;
  }

 private:
  struct SlotState {
    uint64_t issued = 0;  // tickets of copies into this slot
    uint64_t done = 0;
    std::string error;  // of the last finished copy
  };
  struct TagState {
    uint64_t issued = 0;  // tickets of side gathers with this tag
    uint64_t done = 0;
    std::string error;        // of a failed gather, raised by the next join
    bool read_error = false;  // `error` is a pageable read's (CopyError), not a bad list
    bool pageable = false;    // a gather since the last join read pageable rows
  };
  struct Job {
    size_t g;  // the slot (a copy) or the tag (a gather)
    void* dst;
    const void* src;
    size_t bytes;
    uint64_t ticket;
    std::string what;
    bool fail;
    bool gather = false;
    GatherArgs args{};
    const PageableRow* row = nullptr;  // a pageable copy: read from `files`
    const FileSet* files = nullptr;
    TierBytes* tiers = nullptr;
    int64_t cached = -1;
  };

  // One copy list: rows and count read now (the kernels that wrote them ran before).
  // Held rows are copied from host memory, pageable ones read from their file. A read
  // that fails poisons its slot and every later slot of the list (they are not
  // written), so adopt_slots leaves them empty: nothing half-written is ever adopted.
  std::string run_gather(const GatherArgs& a, bool* pageable, bool* read_error) {
    const int64_t n = std::min<int64_t>(*a.count, a.max_rows);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t slot = a.rows[3 * r], e = a.rows[3 * r + 1];
      if (slot < 0 || slot >= a.num_slots || e < 0 || e >= a.num_experts)
        return "gather: copy-list row " + std::to_string(r) + " (slot " + std::to_string(slot) +
               ", expert " + std::to_string(e) + ") is out of range";
      char* dst = static_cast<char*>(a.slab) + static_cast<size_t>(slot) * a.row_bytes;
      const int64_t h = a.host_row ? a.host_row[e] : e;
      if (h >= 0) {
        std::memcpy(dst, static_cast<const char*>(a.host) + static_cast<size_t>(h) * a.row_bytes,
                    a.row_bytes);
        if (a.tiers) a.tiers->pinned += a.row_bytes;
        continue;
      }
      if (pageable) *pageable = true;
      const std::string err = a.files->read(a.pageable[e], dst, *a.tiers);
      if (!err.empty()) {
        for (int64_t q = r; q < n; ++q) {
          const int64_t s = a.rows[3 * q];
          if (s >= 0 && s < a.num_slots) a.poisoned[s] = 1;
        }
        *read_error = true;
        return "gather: layer " + std::to_string(a.layer) + " expert " + std::to_string(e) +
               " -> slot " + std::to_string(slot) + ": " + err;
      }
    }
    return "";
  }

  uint32_t next_delay() {  // mu_ held
    return max_delay_us_ ? static_cast<uint32_t>(rng_() % (uint64_t(max_delay_us_) + 1)) : 0;
  }

  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      Job j = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      const uint32_t delay = next_delay();
      if (j.gather) {
        lk.unlock();
        if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
        bool pageable = false, read_error = false;
        std::string err = run_gather(j.args, &pageable, &read_error);
        lk.lock();
        TagState& t = tags_[j.g];
        t.done = j.ticket;
        t.pageable = t.pageable || pageable;
        if (!err.empty() && t.error.empty()) {
          t.error = std::move(err);
          t.read_error = read_error;
        }
        busy_ = false;
        cv_.notify_all();
        continue;
      }
      lk.unlock();
      if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      std::string err;
      if (j.fail)
        err = "injected copy failure (" + j.what + ")";
      else if (j.row)
        err = j.files->read(*j.row, j.dst, *j.tiers, j.cached);
      else
        std::memcpy(j.dst, j.src, j.bytes);
      if (!err.empty() && j.row && !j.fail) err = j.what + ": " + err;
      lk.lock();
      SlotState& s = slots_[j.g];
      s.done = j.ticket;
      s.error = std::move(err);
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<SlotState> slots_;
  std::vector<TagState> tags_;
  std::thread worker_;
  bool stop_ = false;
  bool busy_ = false;
  uint32_t max_delay_us_ = 0;
  int64_t fail_next_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(uint32_t max_delay_us, uint64_t seed) {
  return std::make_unique<CpuBackend>(max_delay_us, seed);
}

}  // namespace psr
