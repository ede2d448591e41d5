// psr expert store: pinned host copies of every expert, a per-layer slab of
// device slots, and an asynchronous copy engine between them.
//
// One interface (Store) with the bookkeeping and validation shared by both
// backends; a Backend supplies memory, the copy "stream" and its events:
//   cpu/  aligned host memory, a worker thread as the copy stream, events as
//         condition variables (plus seeded fault injection for tests);
//   cuda/ cudaHostAlloc + cudaMalloc, cudaMemcpyAsync on a dedicated stream,
//         CUDA events for copy-done and read-done ordering.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/expert_gemv.h"

namespace psr {

struct CpuTask;  // store.cpp: a layer's CPU experts for the device step

// Misuse of the store (maps to psr.StoreError, a RuntimeError).
struct StoreError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A copy that failed; raised when the compute side waits for it.
struct CopyError : StoreError {
  using StoreError::StoreError;
};

struct LayerSpec {
  int64_t num_experts = 0;
  int64_t num_slots = 0;
  int64_t expert_bytes = 0;  // all of one expert's matrices, packed
  int64_t num_held = -1;     // rows in host memory (-1: all); the rest are pageable
};

// Memory tiers. A held row lives in the store's host memory (pinned on CUDA); a
// pageable row stays in the checkpoint file and is read when a copy needs it. A
// pageable row is a list of segments of checkpoint files (a row packs gate|up|down,
// which a file keeps as separate tensors or slices of fused ones; padding between
// GGUF parts is a zero-fill segment, file -1).
struct Segment {
  int32_t file = -1;  // index in the store's FileSet; -1: `bytes` zeros
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string tensor;  // named in read errors
};
using PageableRow = std::vector<Segment>;

// Bytes read per tier. Pageable bytes split by where the page cache had them just
// before the read (mincore): page_cache + disk = pageable.
struct TierBytes {
  std::atomic<uint64_t> pinned{0};
  std::atomic<uint64_t> pageable{0};
  std::atomic<uint64_t> page_cache{0};
  std::atomic<uint64_t> disk{0};
  std::atomic<uint64_t> read_errors{0};
};

// The checkpoint files pageable rows read from. Rows are read with pread, never by
// touching a mapping: a truncated file or an I/O error is then an error return
// (named by file and tensor) instead of a SIGBUS that kills the process. Each file is
// also mapped read-only, never touched, only for mincore (page-cache residency) and
// readahead hints. Thread-safe after the files are added.
class FileSet {
 public:
  FileSet() = default;
  ~FileSet();
  FileSet(const FileSet&) = delete;
  FileSet& operator=(const FileSet&) = delete;
  // Opens and maps `path` once (StoreError naming it if it cannot be read or mapped).
  int32_t add(const std::string& path);
  uint64_t size(int32_t file) const;
  const std::string& path(int32_t file) const;
  // Bytes of the row's segments in the page cache now (file segments only).
  uint64_t resident(const PageableRow& row) const;
  // Asks the kernel to read the row's pages ahead (POSIX_FADV_WILLNEED).
  void readahead(const PageableRow& row) const;
  // Reads the row into dst (its bytes back to back). Returns "" or an error naming the
  // file, the tensor and the byte range; counts into `t` (pageable, page_cache, disk).
  // `cached`: the row's resident bytes measured by the caller before it asked for
  // readahead (-1: measured here, just before the read).
  std::string read(const PageableRow& row, void* dst, TierBytes& t, int64_t cached = -1) const;

 private:
  struct File {
    std::string path;
    int fd = -1;
    void* map = nullptr;
    uint64_t size = 0;
  };
  File file(int32_t i) const;  // a copy, under mu_ (files may be added while others read)
  mutable std::mutex mu_;      // guards `files_`
  std::vector<File> files_;
};

// Counting rule: every copy put on the copy stream counts once in `copies`
// and `bytes_copied`, retries included (a deferred copy once it is issued).
// A copy that reports an error at wait time counts in `failed_copies`; if
// acquire re-issues it, the re-issue counts in `retried_copies` (and in
// `copies`). So failed_copies - retried_copies = failures raised as CopyError.
struct Counters {
  uint64_t copies = 0;             // copies issued, retries included
  uint64_t bytes_copied = 0;       // bytes of those copies
  uint64_t retried_copies = 0;     // of `copies`, re-issues of a failed copy by acquire
  uint64_t failed_copies = 0;      // copies that reported an error at wait time
  uint64_t waits = 0;              // slots the compute side waited for (again after a retry)
  uint64_t stalled_waits = 0;      // of those, slots whose copy was still running
  uint64_t stall_ns = 0;           // time the compute side stalled on copies
  uint64_t stall_pageable_ns = 0;  // of stall_ns, waiting for copies of pageable rows
  // Bytes read per tier, copies and gathers alike (counted when read).
  uint64_t bytes_pinned = 0;
  uint64_t bytes_pageable = 0;
  uint64_t bytes_page_cache = 0;  // of bytes_pageable, in the page cache before the read
  uint64_t bytes_disk = 0;        // of bytes_pageable, not in it
  uint64_t read_errors = 0;       // pageable reads that failed
  // The device step's CPU experts (cpu_experts): tasks run, experts computed, host time.
  uint64_t cpu_tasks = 0;
  uint64_t cpu_task_experts = 0;
  uint64_t cpu_task_ns = 0;
};

// A device-written copy list, consumed by Backend::gather: `rows` holds int32
// (slot, expert, kind) triples and `count` the number of valid leading rows;
// both are read when the copy runs (device memory on CUDA, host memory on the
// CPU), so kernels queued before may still be writing them when gather() is called.
struct GatherArgs {
  void* slab = nullptr;        // the layer's slots
  const void* host = nullptr;  // the layer's experts, as the copy engine addresses them
  size_t row_bytes = 0;        // one expert
  int64_t num_slots = 0;
  int64_t num_experts = 0;
  const int32_t* rows = nullptr;
  const int32_t* count = nullptr;
  int64_t max_rows = 0;
  // Tiers (CPU backend): per expert its row in `host` or -1 (then `pageable[e]`, read
  // from `files`); per slot a flag set when a row into it failed (adopt_slots empties it).
  const int64_t* host_row = nullptr;
  const PageableRow* pageable = nullptr;
  const FileSet* files = nullptr;
  TierBytes* tiers = nullptr;
  std::atomic<uint8_t>* poisoned = nullptr;
  bool any_pageable = false;
  int64_t layer = 0;  // named in errors
};

// One transfer of a host task (Backend::host_task): bytes from src to dst.
struct Transfer {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};
// Host work run in stream order; must not throw (a task records its own errors).
using HostFn = void (*)(void* ctx);

// Memory, copy stream and events. Slots are addressed by a global index g.
// Thread-safe: Store calls wait_copies, synchronize and drain_stall_ns
// without its own lock. Memory may outlive shutdown(): free_host/free_slab
// keep working until the backend is destroyed (after the last buffer).
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int dlpack_device_type() const = 0;  // kDLCPU = 1, kDLCUDA = 2
  virtual int device_index() const = 0;

  virtual void* alloc_host(size_t bytes) = 0;  // throws std::bad_alloc
  virtual void free_host(void* p) noexcept = 0;
  virtual void* alloc_slab(size_t bytes) = 0;  // throws std::bad_alloc
  virtual void free_slab(void* p) noexcept = 0;
  virtual void init_slots(size_t n) = 0;

  // Enqueue dst <- src on the copy stream, ordered after slot g's last
  // recorded read (write-after-read) and after earlier copies (in order).
  // A copy that cannot be issued or fails is reported by wait_copies (so the
  // store can re-issue it); throws only if the stream itself is unusable.
  virtual void copy_async(size_t g, void* dst, const void* src, size_t bytes,
                          const std::string& what) = 0;
  // The same for a pageable row: read from `files` (into the slot on the CPU, through
  // the pinned staging ring on CUDA), counted into `t`; a read error is reported by
  // wait_copies like a failed copy. Both point into the Store, which outlives the copy.
  virtual void copy_pageable(size_t g, void* dst, const PageableRow& row, const FileSet& files,
                             TierBytes& t, int64_t cached, size_t bytes,
                             const std::string& what) = 0;
  // Whether gather() can read pageable rows (CPU: the copy reads the file; CUDA: a
  // kernel cannot read pageable memory, so the store refuses such gathers).
  virtual bool gathers_pageable() const = 0;
  // Make the compute side (`stream`; the calling thread on the CPU) wait for
  // the last copy into each slot. Returns one message per slot, "" if it
  // succeeded (or, on CUDA, is still running). Adds stalls to the counters.
  virtual std::vector<std::string> wait_copies(const std::vector<size_t>& gs, uintptr_t stream,
                                               Counters& c) = 0;
  // The compute enqueued so far on `stream` is the last reader of these slots.
  virtual void record_read(const std::vector<size_t>& gs, uintptr_t stream) = 0;
  // Non-blocking: has the last copy into slot g finished (successfully or not)?
  virtual bool copy_done(size_t g) = 0;
  virtual void synchronize() = 0;
  // Stall time still in flight (CUDA measures it with events, lazily).
  virtual uint64_t drain_stall_ns() { return 0; }
  // Bytes of a slot equal to bytes on the host (after synchronize()).
  virtual bool equal(const void* slot, const void* host, size_t bytes) = 0;
  // Finish the queued copies and stop the copy engine (CPU: join the worker
  // thread; CUDA: destroy the stream and events). Idempotent; nothing but
  // free_host/free_slab may be called afterwards.
  virtual void shutdown() noexcept = 0;

  // Device-indexed copies (the sync-free decode step). gather() copies the
  // list's rows host -> slab, skipping rows whose slot or expert is out of range
  // (the CPU backend raises StoreError for them instead: a bug in the list's
  // writer). side=false: in order on `stream` (the compute side; the calling
  // thread on the CPU). side=true: on the copy stream, after everything `stream`
  // has enqueued so far (so after the last reads of the slots it rewrites);
  // join(tag) makes `stream` wait for every side gather of that tag. A gather
  // cannot fail recoverably: no retries, no fault injection.
  virtual void gather(const GatherArgs& a, uintptr_t stream, bool side, size_t tag) = 0;
  virtual void join(size_t tag, uintptr_t stream, Counters& c) = 0;
  // The copy stream waits for what `stream` has enqueued so far (before the
  // store's own copies reuse slots that device-indexed work read or wrote).
  virtual void fence(uintptr_t stream) = 0;
  // Host work in stream order without a host sync (the device step's CPU experts):
  // after what `stream` has enqueued, copy `in` (device -> host), run fn(ctx) on the host,
  // copy `out` (host -> device); host_join(tag) makes `stream` wait for all of it.
  // CUDA: on a host stream forked from `stream` (memcpy and host-function nodes, so a
  // CUDA graph captures it), overlapping what `stream` enqueues between the two calls.
  // CPU: now, in the calling thread (the compute side). ctx outlives every replay.
  virtual void host_task(const std::vector<Transfer>& in, HostFn fn, void* ctx,
                         const std::vector<Transfer>& out, uintptr_t stream, size_t tag) = 0;
  virtual void host_join(size_t tag, uintptr_t stream) = 0;
  // The address the copy engine reads host memory at (mapped pinned memory's
  // device pointer on CUDA; the pointer itself on the CPU).
  virtual const void* device_address(const void* host) { return host; }

  // Fault injection: seeded copy delays (CPU backend only); the next n copies
  // fail, reported at wait time (both backends).
  virtual void set_copy_delay(uint32_t max_delay_us, uint64_t seed);
  virtual void fail_next_copies(int64_t n);
};

std::unique_ptr<Backend> make_cpu_backend(uint32_t max_delay_us, uint64_t seed);
bool cuda_compiled();
int cuda_device_count();  // 0 without a driver or device
int cuda_runtime_version();
std::unique_ptr<Backend> make_cuda_backend(int device);

// Thread-safe: every public method may be called from several threads (one
// mutex for the bookkeeping, released while acquire waits for copies). After
// close() every method but the metadata getters throws StoreError.
class Store {
 public:
  static constexpr int kMaxCopyRetries = 100;

  Store(std::vector<LayerSpec> layers, std::string dtype, int64_t itemsize,
        std::unique_ptr<Backend> backend, int copy_retries = 2);
  ~Store();  // close()
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Copy one expert's matrices (parts, packed in order) into its host buffer.
  void register_expert(int64_t layer, int64_t expert, const std::string& dtype,
                       const std::vector<std::pair<uintptr_t, size_t>>& parts);
  bool is_registered(int64_t layer, int64_t expert) const;
  // Register an expert as pageable: segments (path, offset, bytes, tensor) of checkpoint
  // files (path "": zero fill), read when a copy needs the row. The files are opened
  // and mapped here (errors name them); the ranges must lie inside them.
  void register_pageable(
      int64_t layer, int64_t expert,
      const std::vector<std::tuple<std::string, uint64_t, uint64_t, std::string>>& segs);
  // Per expert: its row in host_buffer(layer), or -1 (pageable).
  std::vector<int64_t> host_rows(int64_t layer) const;
  // Reads a pageable expert's row into dst (expert_bytes); CopyError naming the file
  // and tensor on failure (prefill and scoring read host rows with it).
  void read_row(int64_t layer, int64_t expert, uintptr_t dst);

  // Start async copies of experts[i] into slots[i]. A slot still held by a
  // reader is written once its last reader releases it.
  void enqueue_copies(int64_t layer, const std::vector<int64_t>& slots,
                      const std::vector<int64_t>& experts);
  // Compute side waits for these slots' copies and holds them for reading;
  // `experts`, if not empty, must be what the slots hold. A failed copy is
  // re-issued (same slot, same expert) up to copy_retries() times, then
  // raised as CopyError. All or nothing: on error no slot stays held, and
  // slots whose copy failed for good are left empty (and loadable).
  void acquire(int64_t layer, const std::vector<int64_t>& slots,
               const std::vector<int64_t>& experts, uintptr_t stream);
  // The compute reading these slots has been enqueued on `stream`.
  void release(int64_t layer, const std::vector<int64_t>& slots, uintptr_t stream);

  // Device-indexed copies of a copy list (Backend::gather) at device addresses
  // `rows` / `count` of at most `max_rows` rows, on `stream` (side=false) or the
  // copy stream (side=true, joined by join(layer)). They bypass the slot
  // bookkeeping below: adopt_slots() re-synchronises it afterwards.
  void gather(int64_t layer, uintptr_t rows, uintptr_t count, int64_t max_rows, bool side,
              uintptr_t stream);
  void join(int64_t layer, uintptr_t stream);
  // The slots now hold `experts` (-1: empty; written by gathers): bookkeeping
  // only, no copy. An expert may sit in two slots (a leftover beside a fresh
  // copy). No slot may be held by a reader or have a deferred copy; the copy
  // stream is fenced behind `stream`.
  void adopt_slots(int64_t layer, const std::vector<int64_t>& experts, uintptr_t stream);

  // The device step's CPU experts (experts_on cpu / hybrid), one token, no host sync.
  // Set up once per layer: the CPU kernels' layout of its host rows (all held), threads,
  // activation, x's and the weights' dtypes (0 fp32, 1 bf16, 2 fp16), the ids' bytes (4,
  // 8) and top-k. Then per token cpu_experts() hands x [H], the routed ids and weights [k]
  // and the CPU list [k] (the cache kernel's: expert ids, -1 past its count) to the host
  // (device addresses), computes the listed experts from the host rows, in routed order
  // and weighted, and writes their sum to y [H] fp32 (device); cpu_join() makes `stream`
  // wait for y. An error inside (an id out of range) zeroes y and is raised as
  // StoreError by the layer's next cpu_experts / cpu_join or by cpu_check().
  void cpu_experts_setup(int64_t layer, const cpu::Layout& lay, int threads, cpu::Act act,
                         float alpha, float limit, int x_dtype, int w_dtype, int id_bytes,
                         int64_t top_k);
  void cpu_experts(int64_t layer, uintptr_t x, uintptr_t ids, uintptr_t weights, uintptr_t list,
                   uintptr_t y, uintptr_t stream);
  void cpu_join(int64_t layer, uintptr_t stream);
  void cpu_check();

  std::vector<int64_t> slot_experts(int64_t layer) const;  // -1 = empty
  std::vector<int64_t> readers(int64_t layer) const;
  // Per slot: loaded and its copy has finished, right now (physical, timing-dependent).
  std::vector<bool> ready(int64_t layer);
  bool verify(int64_t layer, int64_t slot);  // slot bytes == its expert's host bytes
  void synchronize();
  Counters counters();
  void reset_counters();
  void set_copy_delay(uint32_t max_delay_us, uint64_t seed);
  void fail_next_copies(int64_t n);

  // Finish the queued copies, stop the copy engine and drop the store's
  // references to its memory. Idempotent; waits for calls in flight in other
  // threads. Buffers handed out by slab_buffer/host_buffer stay valid until
  // their last holder drops them.
  void close();
  bool closed() const;

  LayerSpec spec(int64_t layer) const;
  // The layer's memory; the returned reference keeps it alive (DLPack views).
  std::shared_ptr<void> slab_buffer(int64_t layer) const;
  std::shared_ptr<void> host_buffer(int64_t layer) const;

  // Metadata, readable after close().
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const std::string& dtype() const { return dtype_; }
  int64_t itemsize() const { return itemsize_; }
  int copy_retries() const { return copy_retries_; }
  const std::string& backend_name() const { return backend_name_; }
  int dlpack_device_type() const { return dlpack_device_type_; }
  int device_index() const { return device_index_; }

 private:
  struct Slot {
    int64_t expert = -1;    // what the slot holds (or will, once copied)
    bool loaded = false;    // a copy into it was issued or deferred
    bool deferred = false;  // copy waits for the readers to release
    bool pageable = false;  // its last copy reads a pageable row
    int64_t readers = 0;
    uint64_t gen = 0;  // bumped by every change of the above but readers
  };
  struct Layer {
    LayerSpec spec;
    size_t first_slot = 0;              // global index of slot 0
    std::shared_ptr<void> host;         // num_held * expert_bytes
    std::shared_ptr<void> slab;         // num_slots * expert_bytes
    const void* host_device = nullptr;  // `host` as the copy engine addresses it
    std::vector<bool> registered;
    std::vector<Slot> slots;
    std::vector<int64_t> host_row;  // per expert: its row in `host`, -1: pageable
    std::vector<PageableRow> pageable;
    int64_t next_held = 0;  // host rows handed out (a partial layer fills in order)
    int64_t num_pageable = 0;
    std::unique_ptr<std::atomic<uint8_t>[]> poisoned;  // per slot, set by a failed gather
    std::unique_ptr<CpuTask> cpu_task;                 // cpu_experts_setup's
  };

  // Shared hold on the store's lifetime: close() waits for it.
  std::shared_lock<std::shared_mutex> hold_open(const char* what) const;
  Layer& layer_at(int64_t layer);
  const Layer& layer_at(int64_t layer) const;
  void check_slot(const Layer& L, int64_t layer, int64_t slot) const;
  void check_expert(const Layer& L, int64_t layer, int64_t expert) const;
  void issue_copy(Layer& L, int64_t layer, int64_t slot);
  static void empty_slot(Slot& s);

  mutable std::shared_mutex life_;  // then mu_
  bool closed_ = false;
  mutable std::mutex mu_;
  std::vector<Layer> layers_;
  std::string dtype_;
  int64_t itemsize_;
  int copy_retries_;
  std::shared_ptr<Backend> backend_;
  std::string backend_name_;
  int dlpack_device_type_;
  int device_index_;
  Counters counters_;
  FileSet files_;
  TierBytes tiers_;
};

}  // namespace psr
