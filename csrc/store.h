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

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace psr {

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
};

struct Counters {
  uint64_t copies = 0;         // copies issued (deferred ones once issued)
  uint64_t bytes_copied = 0;
  uint64_t failed_copies = 0;  // copies that reported an error at wait time
  uint64_t waits = 0;          // slots the compute side waited for
  uint64_t stalled_waits = 0;  // of those, slots whose copy was still running
  uint64_t stall_ns = 0;       // time the compute side stalled on copies
};

// Memory, copy stream and events. Slots are addressed by a global index g.
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
  virtual void copy_async(size_t g, void* dst, const void* src, size_t bytes,
                          const std::string& what) = 0;
  // Make the compute side (`stream`; the calling thread on the CPU) wait for
  // the last copy into each slot. Returns one message per slot, "" if it
  // succeeded. Adds stalls to the counters.
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

  // Fault injection (CPU backend only).
  virtual void set_copy_delay(uint32_t max_delay_us, uint64_t seed);
  virtual void fail_next_copies(int64_t n);
};

std::unique_ptr<Backend> make_cpu_backend(uint32_t max_delay_us, uint64_t seed);
bool cuda_compiled();
int cuda_device_count();  // 0 without a driver or device
int cuda_runtime_version();
std::unique_ptr<Backend> make_cuda_backend(int device);

class Store {
 public:
  Store(std::vector<LayerSpec> layers, std::string dtype, int64_t itemsize,
        std::unique_ptr<Backend> backend);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Copy one expert's matrices (parts, packed in order) into its host buffer.
  void register_expert(int64_t layer, int64_t expert, const std::string& dtype,
                       const std::vector<std::pair<uintptr_t, size_t>>& parts);
  bool is_registered(int64_t layer, int64_t expert) const;

  // Start async copies of experts[i] into slots[i]. A slot still held by a
  // reader is written once its last reader releases it.
  void load(int64_t layer, const std::vector<int64_t>& slots, const std::vector<int64_t>& experts);
  // Compute side waits for these slots' copies and holds them for reading;
  // `experts`, if not empty, must be what the slots hold. All or nothing:
  // on error no slot stays held, and failed slots are left empty.
  void acquire(int64_t layer, const std::vector<int64_t>& slots,
               const std::vector<int64_t>& experts, uintptr_t stream);
  // The compute reading these slots has been enqueued on `stream`.
  void release(int64_t layer, const std::vector<int64_t>& slots, uintptr_t stream);

  std::vector<int64_t> slot_experts(int64_t layer) const;  // -1 = empty
  std::vector<int64_t> readers(int64_t layer) const;
  // Per slot: loaded and its copy has finished, right now (physical, timing-dependent).
  std::vector<bool> ready(int64_t layer);
  bool verify(int64_t layer, int64_t slot);  // slot bytes == its expert's host bytes
  void synchronize();
  Counters counters();
  void reset_counters();

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const LayerSpec& spec(int64_t layer) const;
  const std::string& dtype() const { return dtype_; }
  int64_t itemsize() const { return itemsize_; }
  void* slab_ptr(int64_t layer) const;
  void* host_ptr(int64_t layer) const;
  Backend& backend() { return *backend_; }

 private:
  struct Slot {
    int64_t expert = -1;       // what the slot holds (or will, once copied)
    bool loaded = false;       // a copy into it was ever issued or deferred
    bool deferred = false;     // copy waits for the readers to release
    int64_t readers = 0;
  };
  struct Layer {
    LayerSpec spec;
    size_t first_slot = 0;  // global index of slot 0
    void* host = nullptr;   // num_experts * expert_bytes
    void* slab = nullptr;   // num_slots * expert_bytes
    std::vector<bool> registered;
    std::vector<Slot> slots;
  };

  Layer& layer_at(int64_t layer);
  const Layer& layer_at(int64_t layer) const;
  void check_slot(const Layer& L, int64_t layer, int64_t slot) const;
  void issue_copy(Layer& L, int64_t layer, int64_t slot);

  mutable std::mutex mu_;
  std::vector<Layer> layers_;
  std::string dtype_;
  int64_t itemsize_;
  std::unique_ptr<Backend> backend_;
  Counters counters_;
};

}  // namespace psr
