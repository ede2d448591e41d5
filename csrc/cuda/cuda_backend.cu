// CUDA backend: pinned host memory (cudaHostAlloc), one cudaMalloc slab per
// layer, cudaMemcpyAsync on a dedicated non-blocking copy stream, and per-slot
// events: `copy` (recorded after the last copy into the slot; the compute
// stream waits on it) and `read` (recorded on the compute stream after the
// last kernel that read the slot; the copy stream waits on it before
// overwriting: write-after-read). A copy that cannot be enqueued (or an
// injected failure) is remembered per slot and reported by wait_copies, where
// the store re-issues it. One mutex makes the backend safe across threads.
//
// Pageable rows (experts beyond host_memory, left in the checkpoint file) cannot be
// DMA'd from: a reader thread preads each into one of two pinned staging buffers
// (double-buffered: the read of the next row overlaps the copy of the last) and
// issues the cudaMemcpyAsync from there on the copy stream. While the reader has
// jobs queued, copies of held rows queue behind them, so copies stay in issue order.
//
// Host tasks (the device step's CPU experts, experts_on cpu / hybrid) run on a third
// stream forked from the compute stream: inputs copied into pinned memory, the task as
// a host function, outputs copied back, a join event; the compute stream's kernels in
// between overlap it, and a CUDA graph captures all of it (no host sync).
#include <cuda_runtime.h>

#include <chrono>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../alloc_error.h"
#include "../store.h"

namespace psr {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error
    throw StoreError(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

// Counts bytes that differ between a slot (device) and its host copy (pinned,
// read through unified addressing).
__global__ void count_mismatch(const unsigned char* a, const unsigned char* b, size_t n,
                               unsigned long long* out) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    local += a[i] != b[i];
  if (local) atomicAdd(out, local);
}

// Copies the rows of a device-written copy list, host (mapped pinned memory,
// read over the bus) -> slab: grid.y indexes rows, grid.x splits each row.
// Rows past `*count` or out of range are skipped.
__global__ void gather_rows(const int32_t* rows, const int32_t* count, unsigned char* slab,
                            const unsigned char* host, size_t row_bytes, int64_t num_slots,
                            int64_t num_experts) {
  const int64_t r = blockIdx.y;
  if (r >= *count) return;
  const int64_t slot = rows[3 * r], e = rows[3 * r + 1];
  if (slot < 0 || slot >= num_slots || e < 0 || e >= num_experts) return;
  unsigned char* dst = slab + static_cast<size_t>(slot) * row_bytes;
  const unsigned char* src = host + static_cast<size_t>(e) * row_bytes;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    for (size_t i = first; i < row_bytes / 16; i += stride) d4[i] = s4[i];
  } else {
    for (size_t i = first; i < row_bytes; i += stride) dst[i] = src[i];
  }
}

// CTAs per copied row: enough loads in flight to cover the bus latency
// ($PSR_GATHER_CTAS overrides: the GPU script measures the choice).
unsigned gather_ctas(size_t row_bytes) {
  if (const char* env = std::getenv("PSR_GATHER_CTAS")) {
    const long v = std::strtol(env, nullptr, 10);
    if (v >= 1 && v <= 65535) return static_cast<unsigned>(v);
  }
  const size_t per_cta = 256 * 16 * 4;  // 256 threads x 4 uint4 each
  return static_cast<unsigned>(
      std::max<size_t>(1, std::min<size_t>(1024, (row_bytes + per_cta - 1) / per_cta)));
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    const int n = cuda_device_count();
    if (device < 0 || device >= n) {
      std::ostringstream s;
      s << "CUDA device " << device << " not available (" << n << " device(s) visible)";
      throw StoreError(s.str());
    }
    DeviceGuard g(device_);
    check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&fork_ev_, cudaEventDisableTiming), "cudaEventCreate");
    check(cudaStreamCreateWithFlags(&host_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&host_fork_ev_, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~CudaBackend() override { shutdown(); }

  // Memory (freed by free_host/free_slab) may outlive this.
  void shutdown() noexcept override {
    {
      std::lock_guard<std::mutex> r(rmu_);
      rstop_ = true;
    }
    rcv_.notify_all();
    if (reader_.joinable()) reader_.join();  // drains its queue first (it takes mu_)
    std::lock_guard<std::mutex> lk(mu_);
    if (!copy_stream_) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    cudaStreamSynchronize(copy_stream_);
    cudaStreamSynchronize(host_stream_);  // the host tasks queued: their ctx outlives them
    for (auto* v : {&copy_ev_, &read_ev_, &pool_, &join_ev_, &host_join_ev_})
      for (cudaEvent_t e : *v)
        if (e) cudaEventDestroy(e);
    join_ev_.clear();
    join_from_.clear();
    host_join_ev_.clear();
    cudaEventDestroy(fork_ev_);
    cudaEventDestroy(host_fork_ev_);
    cudaStreamDestroy(host_stream_);
    host_stream_ = nullptr;
    for (auto& p : stalls_) {
      cudaEventDestroy(p.first);
      cudaEventDestroy(p.second);
    }
    copy_ev_.clear();
    read_ev_.clear();
    pool_.clear();
    stalls_.clear();
    for (Stage& st : ring_) {
      if (st.buf) cudaFreeHost(st.buf);
      if (st.free) cudaEventDestroy(st.free);
      st = Stage{};
    }
    cudaStreamDestroy(copy_stream_);
    copy_stream_ = nullptr;
    cudaGetLastError();
    cudaSetDevice(prev);
  }

  std::string name() const override { return "cuda"; }
  int dlpack_device_type() const override { return 2; }
  int device_index() const override { return device_; }

  void* alloc_host(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw AllocError("cannot allocate " + std::to_string(bytes) +
                       " bytes of pinned host memory: " + cudaGetErrorString(err));
    }
    return p;
  }
  void free_host(void* p) noexcept override {
    if (p) cudaFreeHost(p);
  }
  void* alloc_slab(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw AllocError("cannot allocate " + std::to_string(bytes) +
                       " bytes of device memory: " + cudaGetErrorString(err));
    }
    return p;
  }
  void free_slab(void* p) noexcept override {
    if (p) {
      DeviceGuard g(device_);
      cudaFree(p);
    }
  }

  void init_slots(size_t n) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard g(device_);
    copy_ev_.assign(n, nullptr);
    read_ev_.assign(n, nullptr);
    has_read_.assign(n, false);
    error_.assign(n, std::string());
    for (size_t i = 0; i < n; ++i) {
      check(cudaEventCreateWithFlags(&copy_ev_[i], cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventCreateWithFlags(&read_ev_[i], cudaEventDisableTiming), "cudaEventCreate");
    }
    std::lock_guard<std::mutex> r(rmu_);
    rpending_.assign(n, 0);
  }

  bool gathers_pageable() const override { return false; }

  void copy_pageable(size_t g, void* dst, const PageableRow& row, const FileSet& files,
                     TierBytes& t, int64_t cached, size_t bytes, const std::string& what) override {
    bool fail = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (fail_next_ > 0) {
        --fail_next_;
        fail = true;
      }
    }
    queue_read(ReadJob{g, dst, nullptr, &row, &files, &t, cached, bytes, what, fail});
  }

  void copy_async(size_t g, void* dst, const void* src, size_t bytes,
                  const std::string& what) override {
    {
      std::lock_guard<std::mutex> r(rmu_);
      if (!rq_.empty() || rbusy_) {  // behind the reader's queued copies, in order
        rq_.push_back(ReadJob{g, dst, src, nullptr, nullptr, nullptr, -1, bytes, what, false});
        rpending_[g] += 1;
        rcv_.notify_all();
        return;
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    error_[g].clear();
    cudaError_t err = cudaSuccess;
    if (fail_next_ > 0) {
      --fail_next_;
      error_[g] = "injected copy failure (" + what + ")";
    } else {
      if (has_read_[g]) err = cudaStreamWaitEvent(copy_stream_, read_ev_[g], 0);
      if (err == cudaSuccess)
        err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy_stream_);
      if (err != cudaSuccess) {
        cudaGetLastError();  // clear a non-sticky error; wait_copies reports it
        error_[g] = "cudaMemcpyAsync (" + what + "): " + cudaGetErrorString(err);
      }
    }
    // Recorded even after a failure: later waits stay ordered behind this point.
    check(cudaEventRecord(copy_ev_[g], copy_stream_), "cudaEventRecord");
  }

  std::vector<std::string> wait_copies(const std::vector<size_t>& gs, uintptr_t stream,
                                       Counters& c) override {
    wait_reads(gs, c);  // before mu_: the reader needs it to issue
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    std::vector<std::string> errs(gs.size());
    std::vector<size_t> pending;
    for (size_t i = 0; i < gs.size(); ++i) {
      c.waits += 1;
      if (!error_[gs[i]].empty()) {
        errs[i] = error_[gs[i]];
        continue;
      }
      cudaError_t q = cudaEventQuery(copy_ev_[gs[i]]);
      if (q == cudaErrorNotReady) {
        pending.push_back(gs[i]);
      } else if (q != cudaSuccess) {
        cudaGetLastError();
        errs[i] = cudaGetErrorString(q);
      }
    }
    if (pending.empty()) return errs;
    // Bracket the waits with timing events: their distance on the compute
    // stream is the stall, read lazily by drain_stall_ns().
    cudaEvent_t begin = event(), end = event();
    check(cudaEventRecord(begin, s), "cudaEventRecord");
    for (size_t g : pending) check(cudaStreamWaitEvent(s, copy_ev_[g], 0), "cudaStreamWaitEvent");
    check(cudaEventRecord(end, s), "cudaEventRecord");
    stalls_.emplace_back(begin, end);
    c.stalled_waits += pending.size();
    return errs;
  }

  void record_read(const std::vector<size_t>& gs, uintptr_t stream) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    for (size_t g : gs) {
      check(cudaEventRecord(read_ev_[g], s), "cudaEventRecord");
      has_read_[g] = true;
    }
  }

  void gather(const GatherArgs& a, uintptr_t stream, bool side, size_t tag) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    if (a.max_rows <= 0) return;
    cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
    if (side) {  // fork: the copy stream continues from the compute stream's current point
      check(cudaEventRecord(fork_ev_, s), "cudaEventRecord");
      check(cudaStreamWaitEvent(copy_stream_, fork_ev_, 0), "cudaStreamWaitEvent");
      s = copy_stream_;
    }
    const dim3 grid(gather_ctas(a.row_bytes), static_cast<unsigned>(a.max_rows));
    gather_rows<<<grid, 256, 0, s>>>(a.rows, a.count, static_cast<unsigned char*>(a.slab),
                                     static_cast<const unsigned char*>(a.host), a.row_bytes,
                                     a.num_slots, a.num_experts);
    check(cudaGetLastError(), "gather_rows launch");
    if (side) {
      if (join_ev_.size() <= tag) {
        join_ev_.resize(tag + 1, nullptr);
        join_from_.resize(tag + 1, kJoined);
      }
      if (!join_ev_[tag])
        check(cudaEventCreateWithFlags(&join_ev_[tag], cudaEventDisableTiming), "cudaEventCreate");
      check(cudaEventRecord(join_ev_[tag], copy_stream_), "cudaEventRecord");
      join_from_[tag] = capture_id(reinterpret_cast<cudaStream_t>(stream));
    }
  }

  void join(size_t tag, uintptr_t stream, Counters& c) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    if (join_ev_.size() <= tag || !join_ev_[tag] || join_from_[tag] == kJoined) return;
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const uint64_t cap = capture_id(s);
    const uint64_t from = join_from_[tag];
    join_from_[tag] = kJoined;
    if (cap != kNotCapturing) {  // inside a CUDA graph: no timing events
      // Only a side gather of this capture can be waited on here: an event recorded before
      // it began (an eager step's prefetch that no join consumed, e.g. a policy with
      // prefetch before one without on the same store) would invalidate the capture.
      // DecodeGraph synchronizes the store before capturing, so such work has finished.
      if (from == cap) check(cudaStreamWaitEvent(s, join_ev_[tag], 0), "cudaStreamWaitEvent");
      return;
    }
    cudaEvent_t begin = event(), end = event();
    check(cudaEventRecord(begin, s), "cudaEventRecord");
    check(cudaStreamWaitEvent(s, join_ev_[tag], 0), "cudaStreamWaitEvent");
    check(cudaEventRecord(end, s), "cudaEventRecord");
    stalls_.emplace_back(begin, end);
    (void)c;
  }

  // Fork the host stream from `stream`, stage the inputs into pinned memory, run the task
  // as a host function (the CUDA callback thread; it calls no CUDA API), copy its outputs
  // back, and record the tag's join event: all stream work, so a graph captures it.
  void host_task(const std::vector<Transfer>& in, HostFn fn, void* ctx,
                 const std::vector<Transfer>& out, uintptr_t stream, size_t tag) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    check(cudaEventRecord(host_fork_ev_, s), "cudaEventRecord");
    check(cudaStreamWaitEvent(host_stream_, host_fork_ev_, 0), "cudaStreamWaitEvent");
    for (const Transfer& t : in)
      check(cudaMemcpyAsync(t.dst, t.src, t.bytes, cudaMemcpyDefault, host_stream_),
            "cudaMemcpyAsync (to the host task)");
    check(cudaLaunchHostFunc(host_stream_, fn, ctx), "cudaLaunchHostFunc");
    for (const Transfer& t : out)
      check(cudaMemcpyAsync(t.dst, t.src, t.bytes, cudaMemcpyDefault, host_stream_),
            "cudaMemcpyAsync (from the host task)");
    if (host_join_ev_.size() <= tag) host_join_ev_.resize(tag + 1, nullptr);
    if (!host_join_ev_[tag])
      check(cudaEventCreateWithFlags(&host_join_ev_[tag], cudaEventDisableTiming),
            "cudaEventCreate");
    check(cudaEventRecord(host_join_ev_[tag], host_stream_), "cudaEventRecord");
  }

  void host_join(size_t tag, uintptr_t stream) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    if (host_join_ev_.size() <= tag || !host_join_ev_[tag]) return;
    check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), host_join_ev_[tag], 0),
          "cudaStreamWaitEvent");
  }

  void fence(uintptr_t stream) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    check(cudaEventRecord(fork_ev_, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord");
    check(cudaStreamWaitEvent(copy_stream_, fork_ev_, 0), "cudaStreamWaitEvent");
  }

  const void* device_address(const void* host) override {
    DeviceGuard dg(device_);
    void* d = nullptr;
    check(cudaHostGetDevicePointer(&d, const_cast<void*>(host), 0), "cudaHostGetDevicePointer");
    return d;
  }

  bool copy_done(size_t g) override {
    {
      std::lock_guard<std::mutex> r(rmu_);
      if (rpending_[g] > 0) return false;
    }
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    cudaError_t q = cudaEventQuery(copy_ev_[g]);
    if (q != cudaSuccess && q != cudaErrorNotReady) cudaGetLastError();
    return q != cudaErrorNotReady;
  }

  // Not under mu_: other threads keep enqueueing while this one waits.
  void synchronize() override {
    {
      std::unique_lock<std::mutex> r(rmu_);
      rcv_.wait(r, [&] { return rq_.empty() && !rbusy_; });
    }
    DeviceGuard dg(device_);
    check(cudaStreamSynchronize(copy_stream_), "cudaStreamSynchronize");
    check(cudaStreamSynchronize(host_stream_), "cudaStreamSynchronize");
  }

  uint64_t drain_stall_ns() override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    uint64_t ns = 0;
    std::vector<std::pair<cudaEvent_t, cudaEvent_t>> keep;
    for (auto& p : stalls_) {
      if (cudaEventQuery(p.second) != cudaSuccess) {
        cudaGetLastError();
        keep.push_back(p);
        continue;
      }
      float ms = 0.f;
      if (cudaEventElapsedTime(&ms, p.first, p.second) == cudaSuccess && ms > 0)
        ns += static_cast<uint64_t>(ms * 1e6);
      pool_.push_back(p.first);
      pool_.push_back(p.second);
    }
    stalls_.swap(keep);
    return ns;
  }

  bool equal(const void* slot, const void* host, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    DeviceGuard dg(device_);
    void* dev_host = nullptr;
    check(cudaHostGetDevicePointer(&dev_host, const_cast<void*>(host), 0),
          "cudaHostGetDevicePointer");
    unsigned long long* d = nullptr;
    unsigned long long h = 0;
    check(cudaMalloc(&d, sizeof(h)), "cudaMalloc");
    cudaMemsetAsync(d, 0, sizeof(h), copy_stream_);
    count_mismatch<<<256, 256, 0, copy_stream_>>>(static_cast<const unsigned char*>(slot),
                                                  static_cast<const unsigned char*>(dev_host),
                                                  bytes, d);
    cudaError_t err = cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, copy_stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(copy_stream_);
    cudaFree(d);
    check(err, "verify");
    return h == 0;
  }

  void fail_next_copies(int64_t n) override {
    if (n < 0) throw std::invalid_argument("fail_next_copies: n must be >= 0");
    std::lock_guard<std::mutex> lk(mu_);
    fail_next_ = n;
  }

 private:
  struct ReadJob {
    size_t g;
    void* dst;
    const void* src;         // a held row (queued behind pageable ones), or
    const PageableRow* row;  // a pageable row, read from `files`
    const FileSet* files;
    TierBytes* tiers;
    int64_t cached;  // resident bytes before the readahead
    size_t bytes;
    std::string what;
    bool fail;  // injected failure
  };
  struct Stage {
    void* buf = nullptr;  // pinned
    size_t bytes = 0;
    cudaEvent_t free = nullptr;  // the last copy out of `buf` finished
    bool used = false;
  };

  void queue_read(ReadJob j) {
    std::lock_guard<std::mutex> r(rmu_);
    if (!reader_.joinable()) reader_ = std::thread([this] { read_loop(); });
    rpending_[j.g] += 1;
    rq_.push_back(std::move(j));
    rcv_.notify_all();
  }

  // The compute side waits (host time, counted as pageable stall) until the reader has
  // issued the copies into these slots; then their events order the rest.
  void wait_reads(const std::vector<size_t>& gs, Counters& c) {
    std::unique_lock<std::mutex> r(rmu_);
    auto issued = [&] {
      for (size_t g : gs)
        if (rpending_[g] > 0) return false;
      return true;
    };
    if (issued()) return;
    const auto t0 = std::chrono::steady_clock::now();
    rcv_.wait(r, issued);
    const uint64_t ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
    c.stall_ns += ns;
    c.stall_pageable_ns += ns;
  }

  // A staging buffer of at least `bytes`, free of its last copy.
  void* stage(size_t bytes, std::string& err) {
    Stage& st = ring_[next_stage_];
    next_stage_ ^= 1;
    DeviceGuard dg(device_);
    if (st.used) cudaEventSynchronize(st.free);
    st.used = false;
    if (st.bytes < bytes) {
      if (st.buf) cudaFreeHost(st.buf);
      st.buf = nullptr;
      st.bytes = 0;
      if (cudaHostAlloc(&st.buf, bytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        err = "cannot allocate a pinned staging buffer of " + std::to_string(bytes) + " bytes";
        return nullptr;
      }
      st.bytes = bytes;
    }
    if (!st.free && cudaEventCreateWithFlags(&st.free, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      err = "cudaEventCreate (staging)";
      return nullptr;
    }
    return st.buf;
  }

  void read_loop() {
    std::unique_lock<std::mutex> r(rmu_);
    for (;;) {
      rcv_.wait(r, [&] { return rstop_ || !rq_.empty(); });
      if (rq_.empty()) return;  // stopped and drained
      ReadJob j = std::move(rq_.front());
      rq_.pop_front();
      rbusy_ = true;
      r.unlock();
      std::string err;
      const void* src = j.src;
      Stage* used = nullptr;
      if (j.fail) {
        err = "injected copy failure (" + j.what + ")";
      } else if (j.row) {
        const int k = next_stage_;
        void* buf = stage(j.bytes, err);
        if (buf) {
          err = j.files->read(*j.row, buf, *j.tiers, j.cached);
          if (!err.empty()) err = j.what + ": " + err;
          src = buf;
          used = &ring_[k];
        }
      }
      issue(j, src, err, used);
      r.lock();
      rpending_[j.g] -= 1;
      rbusy_ = false;
      rcv_.notify_all();
    }
  }

  // The reader's copy onto the copy stream (or its error), as copy_async would.
  void issue(const ReadJob& j, const void* src, const std::string& err, Stage* used) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!copy_stream_) return;
    DeviceGuard dg(device_);
    error_[j.g] = err;
    if (err.empty()) {
      cudaError_t e = cudaSuccess;
      if (has_read_[j.g]) e = cudaStreamWaitEvent(copy_stream_, read_ev_[j.g], 0);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(j.dst, src, j.bytes, cudaMemcpyHostToDevice, copy_stream_);
      if (e == cudaSuccess && used) {
        e = cudaEventRecord(used->free, copy_stream_);
        used->used = e == cudaSuccess;
      }
      if (e != cudaSuccess) {
        cudaGetLastError();
        error_[j.g] = "cudaMemcpyAsync (" + j.what + "): " + cudaGetErrorString(e);
      }
    }
    if (cudaEventRecord(copy_ev_[j.g], copy_stream_) != cudaSuccess) cudaGetLastError();
  }

  cudaEvent_t event() {
    if (!pool_.empty()) {
      cudaEvent_t e = pool_.back();
      pool_.pop_back();
      return e;
    }
    cudaEvent_t e;
    check(cudaEventCreate(&e), "cudaEventCreate");
    return e;
  }

  std::mutex mu_;  // guards the slot state, events and pools below (device_ is const)
  int device_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t fork_ev_ = nullptr;
  std::vector<cudaEvent_t> copy_ev_, read_ev_, pool_;
  std::vector<cudaEvent_t> join_ev_;  // per tag (MoE layer): after its last side gather
  // Per tag: the capture its last side gather was recorded in (kNotCapturing: eager), or
  // kJoined once a join consumed it.
  static constexpr uint64_t kNotCapturing = 0, kJoined = ~uint64_t{0};
  std::vector<uint64_t> join_from_;

  // The id of the capture `s` is in (unique per capture sequence), else kNotCapturing.
  static uint64_t capture_id(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    check(cudaStreamGetCaptureInfo(s, &status, &id), "cudaStreamGetCaptureInfo");
    return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) + 1 : kNotCapturing;
  }
  // Host tasks (the device step's CPU experts): their stream, fork event, and per tag
  // (MoE layer) the event after the last one's outputs.
  cudaStream_t host_stream_ = nullptr;
  cudaEvent_t host_fork_ev_ = nullptr;
  std::vector<cudaEvent_t> host_join_ev_;
  std::vector<bool> has_read_;
  std::vector<std::string> error_;  // per slot: why its last copy was not issued
  int64_t fail_next_ = 0;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> stalls_;
  // The staging ring and its reader (rmu_ guards the queue and rpending_; the ring
  // itself is the reader thread's alone, until shutdown joins it).
  std::mutex rmu_;
  std::condition_variable rcv_;
  std::deque<ReadJob> rq_;
  std::vector<int> rpending_;  // per slot: copies queued at the reader, not yet issued
  std::thread reader_;
  bool rstop_ = false, rbusy_ = false;
  Stage ring_[2];
  int next_stage_ = 0;
};

}  // namespace

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int cuda_runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace psr
