// Backend-independent bookkeeping and validation of the expert store.
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

// --- FileSet -------------------------------------------------------------------

FileSet::~FileSet() {
  for (File& f : files_) {
    if (f.map) munmap(f.map, f.size);
    if (f.fd >= 0) ::close(f.fd);
  }
}

int32_t FileSet::add(const std::string& path) {
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i].path == path) return static_cast<int32_t>(i);
  File f;
  f.path = path;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0)
    throw StoreError("cannot open checkpoint file " + path + ": " + std::strerror(errno));
  struct stat st{};
  if (fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(f.fd);
    throw StoreError("checkpoint file " + path + " is not a regular file" +
                     (err ? std::string(": ") + std::strerror(err) : std::string()));
  }
  f.size = static_cast<uint64_t>(st.st_size);
  if (f.size > 0) {
    f.map = mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd, 0);
    if (f.map == MAP_FAILED) {
      const int err = errno;
      ::close(f.fd);
      throw StoreError("cannot memory-map checkpoint file " + path + " (its filesystem may not " +
                       "support mmap): " + std::strerror(err));
    }
  }
  files_.push_back(f);
  return static_cast<int32_t>(files_.size() - 1);
}

uint64_t FileSet::size(int32_t file) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(file)).size;
}

const std::string& FileSet::path(int32_t file) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(file)).path;
}

namespace {
const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

// Resident bytes of [off, off + n) of a mapped file (pages counted partially at the ends).
uint64_t resident_bytes(void* map, uint64_t size, uint64_t off, uint64_t n) {
  if (!map || n == 0 || off >= size) return 0;
  const uint64_t end = std::min(off + n, size);
  const uint64_t first = off / kPage, last = (end + kPage - 1) / kPage;
  std::vector<unsigned char> vec(last - first);
  char* base = static_cast<char*>(map) + first * kPage;
  if (mincore(base, (last - first) * kPage, vec.data()) != 0) return 0;
  uint64_t r = 0;
  for (uint64_t p = first; p < last; ++p) {
    if (!(vec[p - first] & 1)) continue;
    const uint64_t a = std::max(off, p * kPage), b = std::min(end, (p + 1) * kPage);
    r += b - a;
  }
  return r;
}
}  // namespace

FileSet::File FileSet::file(int32_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(i));
}

uint64_t FileSet::resident(const PageableRow& row) const {
  uint64_t r = 0;
  for (const Segment& s : row) {
    if (s.file < 0) continue;
    const File f = file(s.file);
    r += resident_bytes(f.map, f.size, s.offset, s.bytes);
  }
  return r;
}

void FileSet::readahead(const PageableRow& row) const {
  for (const Segment& s : row)
    if (s.file >= 0)
      posix_fadvise(file(s.file).fd, static_cast<off_t>(s.offset), static_cast<off_t>(s.bytes),
                    POSIX_FADV_WILLNEED);
}

std::string FileSet::read(const PageableRow& row, void* dst, TierBytes& t, int64_t given) const {
  char* out = static_cast<char*>(dst);
  uint64_t total = 0, cached = given >= 0 ? static_cast<uint64_t>(given) : 0;
  for (const Segment& s : row) {
    if (s.file < 0) {
      std::memset(out, 0, s.bytes);
      out += s.bytes;
      continue;
    }
    const File f = file(s.file);
    if (given < 0) cached += resident_bytes(f.map, f.size, s.offset, s.bytes);
    uint64_t done = 0;
    while (done < s.bytes) {
      const ssize_t n =
          pread(f.fd, out + done, s.bytes - done, static_cast<off_t>(s.offset + done));
      if (n > 0) {
        done += static_cast<uint64_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      std::ostringstream m;
      m << "reading " << f.path << " tensor '" << s.tensor << "' (bytes " << s.offset << ".."
        << s.offset + s.bytes << "): "
        << (n == 0 ? "the file ends at byte " + std::to_string(s.offset + done) + " (truncated?)"
                   : std::string(std::strerror(errno)));
      t.read_errors += 1;
      return m.str();
    }
    out += s.bytes;
    total += s.bytes;
  }
  t.pageable += total;
  t.page_cache += cached;
  t.disk += total - cached;
  return "";
}

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
    L.slab = std::shared_ptr<void>(b->alloc_slab(slab_bytes), [b](void* p) { b->free_slab(p); });
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

void Store::register_pageable(
    int64_t layer, int64_t expert,
    const std::vector<std::tuple<std::string, uint64_t, uint64_t, std::string>>& segs) {
  auto live = hold_open("register_pageable");
  // Files are opened before the lock (a slow filesystem does not block copies).
  PageableRow row;
  uint64_t total = 0;
  for (const auto& sg : segs) {
    Segment s;
    s.offset = std::get<1>(sg);
    s.bytes = std::get<2>(sg);
    s.tensor = std::get<3>(sg);
    if (!std::get<0>(sg).empty()) {
      s.file = files_.add(std::get<0>(sg));
      const uint64_t size = files_.size(s.file);
      if (s.offset > size || s.bytes > size - s.offset)
        throw StoreError("tensor '" + s.tensor + "' of layer " + std::to_string(layer) +
                         " expert " + std::to_string(expert) + " needs bytes up to " +
                         std::to_string(s.offset + s.bytes) + " of " + std::get<0>(sg) +
                         ", which holds " + std::to_string(size) + " (truncated?)");
    }
    total += s.bytes;
    row.push_back(std::move(s));
  }
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  check_expert(L, layer, expert);
  if (total != static_cast<uint64_t>(L.spec.expert_bytes))
    throw std::invalid_argument("size mismatch registering layer " + std::to_string(layer) +
                                " expert " + std::to_string(expert) + " as pageable: expected " +
                                std::to_string(L.spec.expert_bytes) + " bytes, got " +
                                std::to_string(total));
  const size_t ei = static_cast<size_t>(expert);
  if (L.host_row[ei] >= 0)
    throw StoreError("layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
                     " is held in host memory; it cannot become pageable");
  for (const Slot& s : L.slots)
    if (s.loaded && s.expert == expert) {
      backend_->synchronize();
      break;
    }
  if (L.pageable[ei].empty()) L.num_pageable += 1;
  L.pageable[ei] = std::move(row);
  L.registered[ei] = true;
}

std::vector<int64_t> Store::host_rows(int64_t layer) const {
  auto live = hold_open("host_rows");
  std::lock_guard<std::mutex> g(mu_);
  return layer_at(layer).host_row;
}

void Store::read_row(int64_t layer, int64_t expert, uintptr_t dst) {
  auto live = hold_open("read_row");
  const PageableRow* row = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    const Layer& L = layer_at(layer);
    if (expert < 0 || expert >= L.spec.num_experts ||
        L.pageable[static_cast<size_t>(expert)].empty())
      throw StoreError("read_row: layer " + std::to_string(layer) + " expert " +
                       std::to_string(expert) + " is not a pageable expert");
    row = &L.pageable[static_cast<size_t>(expert)];
  }
  if (!dst) throw std::invalid_argument("read_row: null destination");
  // Registration happens before decoding: the row is not rewritten while it is read.
  const std::string err = files_.read(*row, reinterpret_cast<void*>(dst), tiers_);
  if (!err.empty())
    throw CopyError("layer " + std::to_string(layer) + " expert " + std::to_string(expert) + ": " +
                    err);
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
