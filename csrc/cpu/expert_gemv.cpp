// CPU expert kernels (expert_gemv.h): validation, the thread pool, the two-phase driver,
// the portable scalar row kernels and run-time ISA selection.
#include "expert_gemv.h"

#include "ggml_dot.h"
#include "ggml_qdot.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace psr::cpu {

// --- scalar decoders and row kernels -----------------------------------------------------

float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float mag;
  if (e == 0) {
    mag = std::ldexp(static_cast<float>(m), -24);  // subnormal (or zero)
  } else if (e == 31) {
    mag = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    const uint32_t bits = ((e + 112) << 23) | (m << 13);
    std::memcpy(&mag, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float fp8_e4m3_to_f32(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xF, m = c & 0x7;
  float mag;
  if ((c & 0x7F) == 0x7F) {
    mag = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: no inf, one NaN per sign
  } else if (e == 0) {
    mag = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  } else {
    const uint32_t bits = ((e + 120) << 23) | (m << 20);
    std::memcpy(&mag, &bits, 4);
  }
  return (c & 0x80) ? -mag : mag;
}

namespace {

template <class Load>
void scalar_dot4(const uint8_t* const w[4], int64_t n, const float* v, float out[4], Load load) {
  for (int r = 0; r < 4; ++r) {
    float a = 0.f;
    for (int64_t i = 0; i < n; ++i) a += load(w[r], i) * v[i];
    out[r] = a;
  }
}

void dot_f32(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  scalar_dot4(w, n, v, out, [](const uint8_t* p, int64_t i) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  });
}
void dot_bf16(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  scalar_dot4(w, n, v, out, [](const uint8_t* p, int64_t i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    return bf16_to_f32(b);
  });
}
void dot_f16(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  scalar_dot4(w, n, v, out, [](const uint8_t* p, int64_t i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    return f16_to_f32(b);
  });
}
void dot_int8(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  scalar_dot4(w, n, v, out, [](const uint8_t* p, int64_t i) {
    return static_cast<float>(static_cast<int8_t>(p[i]));
  });
}
void dot_fp8(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  scalar_dot4(w, n, v, out, [](const uint8_t* p, int64_t i) { return fp8_e4m3_to_f32(p[i]); });
}
void dot_int4(const uint8_t* const w[4], int64_t n, const float* v, const float* v2, float out[4]) {
  for (int r = 0; r < 4; ++r) {
    float a = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const int b = w[r][i];
      a += static_cast<float>(((b & 0xF) ^ 8) - 8) * v[i];
      a += static_cast<float>(((b >> 4) ^ 8) - 8) * v2[i];
    }
    out[r] = a;
  }
}

template <class Load>
void scalar_wsum_of(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as,
                    int na, float* out, int64_t os, bool resume, Load load) {
  for (int h = 0; h < na; ++h)
    for (int64_t e = 0; e < dv; ++e) {
      float acc = resume ? out[h * os + e] : 0.f;
      for (int64_t j = 0; j < n; ++j) acc += a[h * as + j] * load(v + j * vs, e);
      out[h * os + e] = acc;
    }
}
float load_f32(const uint8_t* p, int64_t i) {
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}
float load_bf16(const uint8_t* p, int64_t i) {
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return bf16_to_f32(b);
}
float load_f16(const uint8_t* p, int64_t i) {
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return f16_to_f32(b);
}
template <float (*Load)(const uint8_t*, int64_t)>
void wsum(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as, int na,
          float* out, int64_t os, bool resume) {
  scalar_wsum_of(v, vs, n, dv, a, as, na, out, os, resume, Load);
}

}  // namespace

BlockRowDotFn scalar_ggml_dot() { return g_row_dot; }

QuantFn scalar_quant() { return qref::quant_row; }
QRowDotsFn scalar_qdots() {
  return [](int type, const uint8_t* row, int64_t K, const uint8_t* const* xq, int nv, float* out) {
    for (int t = 0; t < nv; ++t) out[t] = qref::qdot(type, row, K, xq[t]);
  };
}

QTileDotsFn scalar_q4k_tiles() {
  return [](const uint8_t* g, int64_t K, const uint8_t* const* xq, int nv, float* out) {
    for (int t = 0; t < nv; ++t) qref::q4k_tile(g, K, xq[t], out + 8 * t);
  };
}

namespace {
// The tile layout's one definition (expert_gemv.h): for row r of a tile's super-block,
// fn(tile offset, row offset, bytes) for each piece of the row's 144 bytes.
template <class Fn>
void q4k_tile_pieces(int r, Fn&& fn) {
  fn(2 * r, 0, 2);                                                    // d
  fn(16 + 2 * r, 2, 2);                                               // dmin
  for (int w = 0; w < 3; ++w) fn(32 + 32 * w + 4 * r, 4 + 4 * w, 4);  // scale words
  for (int p = 0; p < 4; ++p)
    for (int c = 0; c < 8; ++c) fn(128 + 256 * p + 32 * c + 4 * r, 16 + 32 * p + 4 * c, 4);
}
}  // namespace

void tile_q4k(const uint8_t* src, int64_t stride, int64_t rows, int64_t K, uint8_t* dst) {
  if (rows < 0 || rows % kTileRows || K < 256 || K % 256)
    throw std::invalid_argument("tile_q4k: rows must be a multiple of 8 and K of 256, got " +
                                std::to_string(rows) + " x " + std::to_string(K));
  if (stride < K / 256 * 144)
    throw std::invalid_argument("tile_q4k: row stride is shorter than a row");
  for (int64_t g = 0; g < rows / kTileRows; ++g)
    for (int64_t b = 0; b < K / 256; ++b, dst += kQ4KTileBytes)
      for (int r = 0; r < kTileRows; ++r) {
        const uint8_t* s = src + (kTileRows * g + r) * stride + 144 * b;
        q4k_tile_pieces(r, [&](int to, int from, int n) { std::memcpy(dst + to, s + from, n); });
      }
}

void untile_q4k(const uint8_t* t, int64_t K, uint8_t* rows8) {
  const int64_t rb = K / 256 * 144;
  for (int64_t b = 0; b < K / 256; ++b, t += kQ4KTileBytes)
    for (int r = 0; r < kTileRows; ++r) {
      uint8_t* d = rows8 + r * rb + 144 * b;
      q4k_tile_pieces(r, [&](int to, int from, int n) { std::memcpy(d + from, t + to, n); });
    }
}

int64_t act_row_bytes(int act, int64_t K) {
  if (act == ggml_type::Q8_K) return K % 256 ? -1 : K / 256 * kQ8KBytes;
  if (act == ggml_type::Q8_0) return K % 32 ? -1 : K / 32 * kQ8_0Bytes;
  return -1;
}

int64_t ggml_row_bytes(int type, int64_t K) {
  const int qk = g_block_len(type), bs = g_block_bytes(type);
  if (qk == 0 || K < 1) return -1;
  if (is_float_type(type)) return K * type_traits(type)->block_bytes;  // any K
  return K % qk ? -1 : K / qk * bs;
}

DotFn scalar_dot(Fmt f) {
  switch (f) {
    case Fmt::f32:
      return dot_f32;
    case Fmt::bf16:
      return dot_bf16;
    case Fmt::f16:
      return dot_f16;
    case Fmt::int8:
      return dot_int8;
    case Fmt::fp8:
      return dot_fp8;
    case Fmt::int4:
      return dot_int4;
    case Fmt::ggml:
      return nullptr;  // per part: the block row dots
  }
  return nullptr;
}

ExpFn scalar_exp() {
  return [](float* x, int64_t n, float m) {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - m);
  };
}

WsumFn scalar_wsum(Fmt f) {
  switch (f) {
    case Fmt::f32:
      return wsum<load_f32>;
    case Fmt::bf16:
      return wsum<load_bf16>;
    case Fmt::f16:
      return wsum<load_f16>;
    default:
      return nullptr;
  }
}

// --- ISA selection -----------------------------------------------------------------------

namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && cpu_has_avx2();
#else
  return false;
#endif
}

}  // namespace

std::vector<Isa> supported_isas() {
  std::vector<Isa> out{Isa::scalar};
  if (cpu_has_avx2() && avx2_dot(Fmt::f32)) out.push_back(Isa::avx2);
  if (cpu_has_avx512() && avx512_dot(Fmt::f32)) out.push_back(Isa::avx512);
  return out;
}

Isa best_isa() { return supported_isas().back(); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return "scalar";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

Isa isa_from_name(const std::string& name) {
  if (name == "auto") return best_isa();
  for (Isa i : supported_isas())
    if (name == isa_name(i)) return i;
  std::string have;
  for (Isa i : supported_isas()) have += std::string(have.empty() ? "" : ", ") + isa_name(i);
  throw std::invalid_argument("cpu expert kernels: isa '" + name +
                              "' is not available on this CPU (have: auto, " + have + ")");
}

bool cpu_has_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

const char* dot_name(Dot d) {
  switch (d) {
    case Dot::f32:
      return "f32";
    case Dot::q8:
      return "q8";
    case Dot::q8_madd:
      return "q8_madd";
    case Dot::best:
      return "auto";
  }
  return "?";
}

static std::atomic<int> g_default_dot{static_cast<int>(Dot::best)};
Dot default_dot() { return static_cast<Dot>(g_default_dot.load(std::memory_order_relaxed)); }
void set_default_dot(Dot d) { g_default_dot.store(static_cast<int>(d), std::memory_order_relaxed); }

Dot dot_from_name(const std::string& name) {
  for (Dot d : {Dot::f32, Dot::q8, Dot::q8_madd, Dot::best})
    if (name == dot_name(d)) return d;
  throw std::invalid_argument("cpu kernels: dot '" + name +
                              "' is not one of auto, f32, q8, q8_madd");
}

static DotFn dot_for(Isa isa, Fmt f) {
  DotFn d = nullptr;
  if (isa == Isa::avx512) d = avx512_dot(f);
  if (isa == Isa::avx2) d = avx2_dot(f);
  return d ? d : scalar_dot(f);
}

int max_threads() {
  // Read once: hardware_concurrency() reads sysfs (~20 us) and every kernel call checks it.
  static const int n = [] {
    const unsigned h = std::thread::hardware_concurrency();
    return h ? static_cast<int>(h) : 1;
  }();
  return n;
}

// --- thread pool ---------------------------------------------------------------------------

namespace {

// A few persistent workers; the calling thread takes part 0. Work [0, n) is split in
// `parts` contiguous ranges: which thread computes an item never changes what it computes.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool;  // never destroyed: workers may outlive static destruction
    return *pool;
  }

  void run(int parts, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (parts <= 1 || n <= 1) {
      fn(0, n);
      return;
    }
    parts = static_cast<int>(std::min<int64_t>(parts, n));
    {
      std::unique_lock<std::mutex> g(mu_);
      while (static_cast<int>(workers_->size()) < parts - 1) {
        const int idx = static_cast<int>(workers_->size()) + 1;
        workers_->emplace_back([this, idx] { loop(idx); });
#if defined(__linux__)
        pthread_setname_np(workers_->back().native_handle(), "psr-cpu-ffn");
#endif
      }
      fn_ = &fn;
      n_ = n;
      parts_ = parts;
      pending_ = parts - 1;
      error_ = nullptr;
      ++gen_;
    }
    cv_.notify_all();
    std::exception_ptr mine;
    try {
      fn(0, n / parts);
    } catch (...) {
      mine = std::current_exception();
    }
    std::unique_lock<std::mutex> g(mu_);
    done_.wait(g, [this] { return pending_ == 0; });
    fn_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex& call_mutex() { return call_mu_; }

 private:
  Pool() {
    workers_ = new std::vector<std::thread>;
#if defined(__linux__)
    // A forked child has none of the parent's threads: start from no workers (the old
    // thread objects are leaked on purpose, destroying them would terminate).
    pthread_atfork(nullptr, nullptr, [] {
      Pool& p = get();
      p.workers_ = new std::vector<std::thread>;
      p.gen_ = 0;
    });
#endif
  }

  void loop(int idx) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t, int64_t)>* fn;
      int64_t b = 0, e = 0;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return gen_ != seen; });
        seen = gen_;
        if (idx >= parts_) continue;
        fn = fn_;
        b = n_ * idx / parts_;
        e = n_ * (idx + 1) / parts_;
      }
      std::exception_ptr err;
      try {
        (*fn)(b, e);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> g(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mu_;  // one call at a time
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::vector<std::thread>* workers_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int parts_ = 0;
  int pending_ = 0;
  uint64_t gen_ = 0;
  std::exception_ptr error_;
};

void check_threads(int threads) {
  if (threads < 1 || threads > max_threads())
    throw std::invalid_argument("cpu expert kernels: threads must be in [1, " +
                                std::to_string(max_threads()) + "] (this machine's hardware " +
                                "threads), got " + std::to_string(threads));
}

// --- validation ------------------------------------------------------------------------------

int64_t itemsize(Fmt f) {
  switch (f) {
    case Fmt::f32:
      return 4;
    case Fmt::bf16:
    case Fmt::f16:
      return 2;
    default:
      return 1;
  }
}

bool quantized(Fmt f) { return f == Fmt::int8 || f == Fmt::fp8 || f == Fmt::int4; }

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("cpu expert kernels: " + what);
}

void check_part(const char* name, int64_t at, int64_t rows, int64_t bytes, int64_t row_bytes) {
  if (at < 0 || rows < 0 || bytes < 0 || at > row_bytes || rows * bytes > row_bytes - at)
    bad(std::string("part ") + name + " (offset " + std::to_string(at) + ", " +
        std::to_string(rows) + " x " + std::to_string(bytes) + " bytes) does not fit in a row of " +
        std::to_string(row_bytes) + " bytes");
}

void check_group(const char* dim, int64_t K, int64_t group) {
  if (group < 1 || K % group) bad(std::string("scale group must divide ") + dim);
  if (K / group > 1 && group % 2) bad(std::string("int4 groups along ") + dim + " must be even");
}

void check_ggml_layout(const Layout& L) {
  const int64_t H = L.hidden, F = L.ffn;
  const int types[3] = {L.t_gate, L.t_up, L.t_down};
  const int64_t want[3] = {ggml_row_bytes(L.t_gate, H), ggml_row_bytes(L.t_up, H),
                           ggml_row_bytes(L.t_down, F)};
  const int64_t have[3] = {L.rb_h, L.rb_up, L.rb_f};
  const char* names[3] = {"gate", "up", "down"};
  for (int p = 0; p < 3; ++p) {
    if (want[p] < 0)
      bad(std::string("GGML type ") + std::to_string(types[p]) + " of part " + names[p] +
          " is unknown or its rows are not whole blocks");
    if (have[p] != want[p])
      bad(std::string("part ") + names[p] + " rows hold " + std::to_string(have[p]) +
          " bytes, its type needs " + std::to_string(want[p]));
  }
  const int64_t rows[3] = {F, F, H};
  for (int p = 0; p < 3; ++p)
    if (is_tiled_type(types[p]) && rows[p] % kTileRows)
      bad(std::string("part ") + names[p] + " is in tiles of 8 rows but has " +
          std::to_string(rows[p]) + " rows");
  check_part("gate", L.gate, F, L.rb_h, L.row_bytes);
  check_part("up", L.up, F, L.rb_up, L.row_bytes);
  check_part("down", L.down, H, L.rb_f, L.row_bytes);
}

void check_layout(const Layout& L) {
  const int64_t H = L.hidden, F = L.ffn;
  if (H < 1 || F < 1) bad("hidden and ffn sizes must be positive");
  const int fi = static_cast<int>(L.fmt);
  if (fi < 0 || fi > 6) bad("unknown format code " + std::to_string(fi));
  if (L.fmt == Fmt::ggml) {
    check_ggml_layout(L);
    return;
  }
  const int64_t isz = itemsize(L.fmt);
  const int64_t want_h = L.fmt == Fmt::int4 ? (H + 1) / 2 : H * isz;
  const int64_t want_f = L.fmt == Fmt::int4 ? (F + 1) / 2 : F * isz;
  if (L.rb_h != want_h || L.rb_f != want_f)
    bad("row byte counts " + std::to_string(L.rb_h) + ", " + std::to_string(L.rb_f) +
        " do not match the format (expected " + std::to_string(want_h) + ", " +
        std::to_string(want_f) + ")");
  check_part("gate", L.gate, F, L.rb_h, L.row_bytes);
  check_part("up", L.up, F, L.rb_h, L.row_bytes);
  check_part("down", L.down, H, L.rb_f, L.row_bytes);
  if (!quantized(L.fmt)) return;
  if (L.fmt == Fmt::int4) {
    check_group("hidden", H, L.group_h);
    check_group("ffn", F, L.group_f);
  } else if (L.group_h != H || L.group_f != F) {
    bad("int8/fp8 scales are per row: groups must equal the row lengths");
  }
  check_part("gate scales", L.gate_s, F, 4 * (H / L.group_h), L.row_bytes);
  check_part("up scales", L.up_s, F, 4 * (H / L.group_h), L.row_bytes);
  check_part("down scales", L.down_s, H, 4 * (F / L.group_f), L.row_bytes);
}

int64_t read_index(const void* p, int bytes, int64_t i) {
  if (bytes == 4) return static_cast<const int32_t*>(p)[i];
  return static_cast<const int64_t*>(p)[i];
}

// The row of each routed (token, expert), validated: never a read outside the rows; null
// for an absent expert (Call::skip_absent).
std::vector<const uint8_t*> routed_rows(const Layout& L, const Call& c) {
  if (c.tokens < 0 || c.k < 0) bad("tokens and k must be non-negative");
  if (!c.x || !c.y || !c.rows || (c.tokens * c.k != 0 && (!c.ids || !c.weights)))
    bad("null pointer argument");
  if (c.num_rows < 1) bad("no rows");
  if (c.row_stride < L.row_bytes) bad("row stride is shorter than a row");
  if ((c.id_bytes != 4 && c.id_bytes != 8) || (c.table && c.table_bytes != 4 && c.table_bytes != 8))
    bad("ids and the slot table must be int32 or int64");
  const int ai = static_cast<int>(c.act);
  if (ai < 0 || ai > 1) bad("unknown activation code " + std::to_string(ai));
  std::vector<const uint8_t*> out(static_cast<size_t>(c.tokens * c.k), nullptr);
  for (int64_t i = 0; i < c.tokens * c.k; ++i) {
    int64_t slot = read_index(c.ids, c.id_bytes, i);
    if (c.table) {
      if (slot < 0 || slot >= c.table_len)
        throw std::out_of_range("cpu expert kernels: expert id " + std::to_string(slot) +
                                " out of range [0, " + std::to_string(c.table_len) + ")");
      slot = read_index(c.table, c.table_bytes, slot);
      if (slot == -1 && c.skip_absent) continue;  // absent: its row stays null
    }
    if (slot < 0 || slot >= c.num_rows)
      throw std::out_of_range("cpu expert kernels: slot " + std::to_string(slot) +
                              " out of range [0, " + std::to_string(c.num_rows) + ")");
    out[static_cast<size_t>(i)] = c.rows + slot * c.row_stride;
  }
  return out;
}

// --- the driver ----------------------------------------------------------------------------

constexpr int64_t kBlock = 16;  // output rows per work item

struct Matrix {
  int64_t at;     // codes offset in the row
  int64_t s_at;   // scales offset (quantized)
  int64_t rb;     // bytes per row
  int64_t K;      // input dim
  int64_t group;  // scale group (quantized)
  int type = 0;   // ggml: the part's block type
  int act = 0;    // ggml on the q8 path: the inputs' vec_dot type (0: fp32 inputs)
};

struct Dots {
  DotFn dot;
  GroupDotFn gdot;
  BlockRowDotFn bdot;           // ggml
  BlockRowDotsFn bdots;         // ggml, several inputs (nullptr: bdot per input)
  DotsFn dots;                  // several inputs (nullptr: dot per input)
  BlockGemmFn gemm;             // ggml, tiled over inputs (nullptr: the row dots)
  QuantFn quant = nullptr;      // the q8 path (Dot::q8 / q8_madd): activation rows
  QRowDotsFn qdots = nullptr;   // and the integer row dots
  QTileDotsFn tiles = nullptr;  // and the tiles' (Q4_K_X8)
  Dot mode = Dot::f32;          // the q8 path's choice of types (Dot::best: q8_by_default's)
  Isa isa = Isa::scalar;
  // GGML's float types (F32, F16, BF16: float_slot) are rows of their float format: that
  // format's dot products on the same ISA path (one dot product per format).
  DotFn fdot[3] = {};
  DotsFn fdots[3] = {};
  int dots_inputs = kRowInputs;  // inputs a dots / fdots call takes best of more than 4
};

// A GGML float type's float format (F32, F16, BF16 -> Fmt::f32 / f16 / bf16) and its
// slot in Dots::fdot; -1 for a block type.
constexpr Fmt kFloatFmts[3] = {Fmt::f32, Fmt::f16, Fmt::bf16};
int float_slot(int type) {
  return type == ggml_type::F32 ? 0 : type == ggml_type::F16 ? 1 : type == ggml_type::BF16 ? 2 : -1;
}

// On the q8 path the inputs of a matrix whose type has a vec_dot type are its quantized
// rows, passed where fp32 vectors go (const float*, rows padded to whole floats): qin
// gives their bytes back.
inline const uint8_t* qin(const float* v) { return reinterpret_cast<const uint8_t*>(v); }
int64_t qfloats(int act, int64_t K) { return (act_row_bytes(act, K) + 3) / 4; }

// out[r] = dot of four rows `rows[r]` of matrix m in expert row `base` with v (v2: int4's
// odd half), scales applied once per row or group, groups summed in order.
void dot_rows(const Dots& ds, Fmt fmt, const uint8_t* base, const Matrix& m, const int64_t rows[4],
              const float* v, const float* v2, float out[4]) {
  const DotFn dot = ds.dot;
  const GroupDotFn gdot = ds.gdot;
  const uint8_t* w[4];
  for (int r = 0; r < 4; ++r) w[r] = base + m.at + rows[r] * m.rb;
  if (const int f = fmt == Fmt::ggml ? float_slot(m.type) : -1; f >= 0) {
    ds.fdot[f](w, m.K, v, nullptr, out);
    return;
  }
  if (fmt == Fmt::ggml && m.act) {
    const uint8_t* xq = qin(v);
    for (int r = 0; r < 4; ++r) ds.qdots(m.type, w[r], m.K, &xq, 1, &out[r]);
    return;
  }
  if (fmt == Fmt::ggml) {
    for (int r = 0; r < 4; ++r) out[r] = ds.bdot(m.type, w[r], m.K, v);
    return;
  }
  if (!quantized(fmt)) {
    dot(w, m.K, v, v2, out);
    return;
  }
  const bool i4 = fmt == Fmt::int4;
  const int64_t ng = m.K / m.group;
  const float* s[4];
  for (int r = 0; r < 4; ++r) s[r] = reinterpret_cast<const float*>(base + m.s_at) + rows[r] * ng;
  if (ng == 1) {
    dot(w, m.rb, v, v2, out);
    for (int r = 0; r < 4; ++r) {
      float sc;
      std::memcpy(&sc, s[r], 4);
      out[r] *= sc;
    }
    return;
  }
  const int64_t step = i4 ? m.group / 2 : m.group;  // bytes (and v entries) per group
  if (gdot && i4) {
    gdot(w, ng, step, v, v2, s, out);
    return;
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg[4];
    for (int r = 0; r < 4; ++r) wg[r] = w[r] + g * step;
    float part[4];
    dot(wg, step, v + g * step, i4 ? v2 + g * step : nullptr, part);
    for (int r = 0; r < 4; ++r) {
      float sc;
      std::memcpy(&sc, s[r] + g, 4);
      acc[r] += part[r] * sc;
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = acc[r];
}

// dot_rows for n inputs sharing the expert row `base` (the tokens routed to it):
// out[4 u + r] = dot_rows' out[r] for input u, bit for bit. Float / int8 / fp8 rows and
// GGML blocks go through the path's several-input dots where it has them (each chunk
// widened, each block decoded once per kRowInputs inputs); int4, the other block types and
// the scalar path input by input (the rows then come from L1).
void dot_rows_shared(const Dots& ds, Fmt fmt, const uint8_t* base, const Matrix& m,
                     const int64_t rows[4], const float* const* v, const float* const* v2,
                     int64_t n, float* out) {
  const int f = fmt == Fmt::ggml ? float_slot(m.type) : -1;  // a GGML float type: its format's
  const DotsFn dots = f >= 0 ? ds.fdots[f] : fmt != Fmt::ggml ? ds.dots : nullptr;
  if (dots && fmt != Fmt::int4) {  // int8 / fp8: one scale a row
    const uint8_t* w[4];
    for (int r = 0; r < 4; ++r) w[r] = base + m.at + rows[r] * m.rb;
    // Up to kRowInputs in one call; more ds.dots_inputs at a time (AVX2: three, whose
    // accumulators fit its registers; four alone ran no slower than three and one).
    const int g = n <= kRowInputs ? kRowInputs : ds.dots_inputs;
    for (int64_t u0 = 0; u0 < n; u0 += g) {
      const int nv = static_cast<int>(std::min<int64_t>(g, n - u0));
      dots(w, m.K, v + u0, nv, out + 4 * u0);
      if (!quantized(fmt)) continue;
      for (int r = 0; r < 4; ++r) {  // as dot_rows: the row's scale times its sum
        float sc;
        std::memcpy(&sc, base + m.s_at + rows[r] * 4, 4);
        for (int i = 0; i < nv; ++i) out[4 * (u0 + i) + r] *= sc;
      }
    }
    return;
  }
  if (fmt == Fmt::ggml && m.act) {
    for (int64_t u0 = 0; u0 < n; u0 += kRowInputs) {
      const int nv = static_cast<int>(std::min<int64_t>(kRowInputs, n - u0));
      const uint8_t* xq[kRowInputs];
      for (int i = 0; i < nv; ++i) xq[i] = qin(v[u0 + i]);
      for (int r = 0; r < 4; ++r) {
        float o[kRowInputs];
        ds.qdots(m.type, base + m.at + rows[r] * m.rb, m.K, xq, nv, o);
        for (int i = 0; i < nv; ++i) out[4 * (u0 + i) + r] = o[i];
      }
    }
    return;
  }
  if (fmt != Fmt::ggml || f >= 0 || !ds.bdots) {
    for (int64_t u = 0; u < n; ++u)
      dot_rows(ds, fmt, base, m, rows, v[u], v2 ? v2[u] : nullptr, out + 4 * u);
    return;
  }
  for (int64_t u0 = 0; u0 < n; u0 += kRowInputs) {
    const int nv = static_cast<int>(std::min<int64_t>(kRowInputs, n - u0));
    for (int r = 0; r < 4; ++r) {
      float o[kRowInputs];
      ds.bdots(m.type, base + m.at + rows[r] * m.rb, m.K, v + u0, nv, o);
      for (int i = 0; i < nv; ++i) out[4 * (u0 + i) + r] = o[i];
    }
  }
}

inline float activate(const Call& c, float g, float u) {
  if (c.act == Act::swiglu_oai) {
    g = std::min(g, c.limit);
    u = std::max(-c.limit, std::min(u, c.limit));
    return (u + 1.f) * (g / (1.f + std::exp(-c.alpha * g)));
  }
  return g / (1.f + std::exp(-g)) * u;
}

// Four row indices of a block starting at r0 (of n rows); missing ones repeat the last.
void quad(int64_t r0, int64_t n, int64_t rows[4]) {
  for (int r = 0; r < 4; ++r) rows[r] = std::min(r0 + r, n - 1);
}

// Eight rows r0..r0 + 7 of matrix m (of nrows) in expert row `base` against n inputs:
// out[8 u + r]. A tiled part (r0 a multiple of 8) through its tile kernel on the q8 path,
// or untiled into scratch rows on the f32 path (then the rows' bits); others as two quads.
void dot_rows8(const Dots& ds, Fmt fmt, const uint8_t* base, const Matrix& m, int64_t r0,
               int64_t nrows, const float* const* v, const float* const* v2, int64_t n,
               float* out) {
  if (is_tiled_type(m.type) && m.act) {
    const uint8_t* tile = base + m.at + r0 * m.rb;  // the tile holds rows r0.. r0 + 7's bytes
    for (int64_t u0 = 0; u0 < n; u0 += kTileInputs) {
      const int nv = static_cast<int>(std::min<int64_t>(kTileInputs, n - u0));
      const uint8_t* xq[kTileInputs];
      for (int i = 0; i < nv; ++i) xq[i] = qin(v[u0 + i]);
      ds.tiles(tile, m.K, xq, nv, out + kTileRows * u0);
    }
    return;
  }
  Matrix mm = m;
  const uint8_t* b = base;
  std::vector<uint8_t> rows8;  // the fp32 dot's untiled rows
  int64_t first = r0;
  if (is_tiled_type(m.type)) {
    rows8.resize(static_cast<size_t>(kTileRows * m.rb));
    untile_q4k(base + m.at + r0 * m.rb, m.K, rows8.data());
    mm.type = ggml_type::Q4_K;
    mm.at = 0;
    b = rows8.data();
    first = 0;
    nrows = kTileRows;
  }
  std::vector<float> dg(static_cast<size_t>(4 * n));
  for (int h = 0; h < 2; ++h) {
    int64_t q[4];
    quad(first + 4 * h, nrows, q);
    dot_rows_shared(ds, fmt, b, mm, q, v, v2, n, dg.data());
    for (int64_t u = 0; u < n; ++u)
      for (int r = 0; r < 4; ++r) out[kTileRows * u + 4 * h + r] = dg[4 * u + r];
  }
}

// Rows r0.. r0 + S - 1 of matrix m (of nrows) against n inputs, out[S u + r]: S = 8 where a
// tiled part takes part in the step (dot_rows8), else a quad (dot_rows_shared).
void dot_rows_step(const Dots& ds, Fmt fmt, const uint8_t* base, const Matrix& m, int S, int64_t r0,
                   int64_t nrows, const float* const* v, const float* const* v2, int64_t n,
                   float* out) {
  if (S == kTileRows) return dot_rows8(ds, fmt, base, m, r0, nrows, v, v2, n, out);
  int64_t q[4];
  quad(r0, nrows, q);
  dot_rows_shared(ds, fmt, base, m, q, v, v2, n, out);
}

// Input vectors as the row kernels read them: int4 splits even / odd elements (each half
// padded with a zero to ceil(K/2)); other formats use the vector as is.
int64_t vec_len(Fmt fmt, int64_t K) { return fmt == Fmt::int4 ? 2 * ((K + 1) / 2) : K; }
int64_t vec_pos(Fmt fmt, int64_t K, int64_t i) {
  return fmt == Fmt::int4 ? (i % 2) * ((K + 1) / 2) + i / 2 : i;
}

// The row dot products of `fmt` on ISA path `isa` (checked: one this CPU runs).
Dots dots_for(Isa isa, Fmt fmt, Dot dot = Dot::f32) {
  bool ok = false;
  for (Isa i : supported_isas()) ok |= i == isa;
  if (!ok) bad(std::string("isa ") + isa_name(isa) + " is not available on this CPU");
  BlockRowDotFn bdot = isa == Isa::avx512 ? avx512_ggml_dot()
                       : isa == Isa::avx2 ? avx2_ggml_dot()
                                          : nullptr;
  Dots ds{dot_for(isa, fmt),
          isa == Isa::avx512 ? avx512_int4_groups() : nullptr,
          bdot ? bdot : scalar_ggml_dot(),
          isa == Isa::avx512 ? avx512_ggml_dots()
          : isa == Isa::avx2 ? avx2_ggml_dots()
                             : nullptr,
          isa == Isa::avx512 ? avx512_dots(fmt)
          : isa == Isa::avx2 ? avx2_dots(fmt)
                             : nullptr,
          isa == Isa::avx512 && fmt == Fmt::ggml ? avx512_ggml_gemm() : nullptr};
  ds.mode = dot;
  ds.isa = isa;
  ds.dots_inputs = isa == Isa::avx2 ? kAvx2DotsInputs : kRowInputs;
  for (int f = 0; f < 3 && fmt == Fmt::ggml; ++f) {
    ds.fdot[f] = dot_for(isa, kFloatFmts[f]);
    ds.fdots[f] = isa == Isa::avx512 ? avx512_dots(kFloatFmts[f])
                  : isa == Isa::avx2 ? avx2_dots(kFloatFmts[f])
                                     : nullptr;
  }
  if (fmt == Fmt::ggml && dot != Dot::f32) {
    const bool v512 = isa == Isa::avx512 && avx512_qdots(false);
    const bool v256 = isa == Isa::avx2 && avx2_qdots();
    ds.quant = v512 ? avx512_quant() : v256 ? avx2_quant() : scalar_quant();
    ds.qdots = v512   ? avx512_qdots(dot == Dot::q8 && cpu_has_vnni())
               : v256 ? avx2_qdots()
                      : scalar_qdots();
    // The tiles' AVX2 kernel on the vector paths (AVX-512 CPUs run it too); the same bits
    // as the scalar one.
    ds.tiles = isa != Isa::scalar && avx2_q4k_tiles() ? avx2_q4k_tiles() : scalar_q4k_tiles();
  }
  return ds;
}

// Matrix m's inputs on ds's path: its type's vec_dot type on the q8 path, else 0 (fp32).
int act_of(const Dots& ds, int type) {
  const TypeTraits* t = type_traits(type);
  if (!ds.qdots || !t || (ds.mode == Dot::best && !q8_by_default(type, ds.isa))) return 0;
  return t->vec_dot;
}

// n rows x[i] (at x + i * xs, K values) quantized to `act` into q (qfloats(act, K) floats a
// row), the rows split over the pool; skip[i]: left as is.
void quantize_rows(const Dots& ds, int act, const float* x, int64_t xs, int64_t K, int64_t n,
                   std::vector<float>& q, int threads,
                   const std::function<bool(int64_t)>& skip = nullptr) {
  const int64_t qf = qfloats(act, K);
  q.assign(static_cast<size_t>(n * qf), 0.f);
  Pool::get().run(threads, n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (!skip || !skip(i))
        ds.quant(act, x + i * xs, K, reinterpret_cast<uint8_t*>(q.data() + i * qf));
  });
}

// Inputs sharing a weight matrix from which the tiled GEMM runs (below it the row dots'
// kRowInputs-at-a-time decode is as fast); either way every output has the same bits.
constexpr int64_t kGemmMin = 8;
// Output rows per work item of the tiled GEMM: the items' inputs are streamed once a item.
constexpr int64_t kGemmRows = 64;

// Whether matrix m's n inputs go through ds's tiled GEMM.
bool tiled(const Dots& ds, const Matrix& m, int64_t n) {
  return (ds.gemm != nullptr || m.act) && n >= kGemmMin && g_several_inputs(m.type);
}

// Inputs per pass of the q8 path's GEMM: their quantized rows stay in L1 / L2 while a
// row (from L1) meets each four of them.
constexpr int64_t kQTokens = 16;

// Rows [r0, r1) of matrix m in expert row `base` against n inputs by the tiled GEMM:
// out[u][r - r0] (the row dots' bits).
void gemm_rows(const Dots& ds, const uint8_t* base, const Matrix& m, int64_t r0, int64_t r1,
               const float* const* v, int64_t n, float* const* out) {
  if (m.act) {  // the row dots four inputs a call: the same bits as any other grouping
    for (int64_t t0 = 0; t0 < n; t0 += kQTokens) {
      const int64_t t1 = std::min(n, t0 + kQTokens);
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = base + m.at + r * m.rb;
        for (int64_t u0 = t0; u0 < t1; u0 += kQInputs) {
          const int nv = static_cast<int>(std::min<int64_t>(kQInputs, t1 - u0));
          const uint8_t* xq[kQInputs];
          float o[kQInputs];
          for (int i = 0; i < nv; ++i) xq[i] = qin(v[u0 + i]);
          ds.qdots(m.type, row, m.K, xq, nv, o);
          for (int i = 0; i < nv; ++i) out[u0 + i][r - r0] = o[i];
        }
      }
    }
    return;
  }
  std::vector<float> scratch(static_cast<size_t>(gemm_scratch_floats(m.K)));
  ds.gemm(m.type, base + m.at + r0 * m.rb, m.rb, m.K, r1 - r0, v, n, out, scratch.data());
}

// The routed (token, expert) pairs grouped by the row they read: order holds the indices
// t * k + j of present pairs sorted by row (then index), group g is order[starts[g],
// starts[g + 1]). Grouping changes which thread computes a pair, never how.
void group_by_row(const std::vector<const uint8_t*>& rows, std::vector<int64_t>& order,
                  std::vector<int64_t>& starts) {
  order.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i)
    if (rows[static_cast<size_t>(i)]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::less<const uint8_t*>()(rows[static_cast<size_t>(a)], rows[static_cast<size_t>(b)]);
  });
  starts.clear();
  for (size_t u = 0; u < order.size(); ++u)
    if (u == 0 || rows[static_cast<size_t>(order[u])] != rows[static_cast<size_t>(order[u - 1])])
      starts.push_back(static_cast<int64_t>(u));
  starts.push_back(static_cast<int64_t>(order.size()));
}

// The down phase (down_by_expert): tokens per chunk, which bounds its d[pair, H] buffer (and
// a run of down rows is read once for the chunk's tokens of its expert), and down rows per
// work item (a run of consecutive rows of one expert's matrix): kDownTokens and kGemmRows
// with AVX-512's tiled GEMM, kDownChunk and kDownRows on the row dots. Neither changes how
// a token is computed, only which thread computes it and what is read together.
constexpr int64_t kDownTokens = 512;
constexpr int64_t kDownChunk = 32;
constexpr int64_t kDownRows = 1024;

// expert_ffn's down phase by expert for tokens [t0, t1): each routed row's down rows, in
// items of `per_item` consecutive rows (one long read of its matrix), against all its
// (token, expert) pairs' h at once into d[pair, H] (AVX-512's tiled GEMM where it has one
// and a row has kGemmMin pairs, the row dots otherwise: the same bits), then each token's
// y = sum_j w_j d[t, j] over its experts in order j = 0..k-1, the sum T = 1 makes.
void down_by_expert(const Dots& ds, Fmt fmt, const Matrix& down,
                    const std::vector<const uint8_t*>& rows, int64_t t0, int64_t t1, const float* h,
                    int64_t hs, const Call& c, int64_t H, int64_t per_item, int threads) {
  const int64_t K = c.k, p0 = t0 * K, np = (t1 - t0) * K;
  const std::vector<const uint8_t*> mine(rows.begin() + p0, rows.begin() + p0 + np);
  std::vector<int64_t> order, starts;
  group_by_row(mine, order, starts);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  std::vector<float> d(static_cast<size_t>(np * H));  // pair p0 + i at d + i * H
  const int64_t hb = (H + per_item - 1) / per_item;
  const bool i4 = fmt == Fmt::int4;  // no quantized h: its even / odd halves at hs / 2
  const int S = is_tiled_type(down.type) ? kTileRows : 4;  // rows a step
  Pool::get().run(threads, groups * hb, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / hb, h0 = (item % hb) * per_item, h1 = std::min(H, h0 + per_item);
      const int64_t* users = order.data() + starts[g];
      const int64_t n = starts[g + 1] - starts[g];
      const uint8_t* row = mine[static_cast<size_t>(users[0])];
      std::vector<const float*> v(static_cast<size_t>(n)), v2(static_cast<size_t>(n));
      std::vector<float*> out(static_cast<size_t>(n));
      for (int64_t u = 0; u < n; ++u) {
        v[u] = h + (p0 + users[u]) * hs;
        v2[u] = i4 ? v[u] + hs / 2 : nullptr;
        out[u] = d.data() + users[u] * H + h0;
      }
      if (ds.gemm && tiled(ds, down, n)) {
        gemm_rows(ds, row, down, h0, h1, v.data(), n, out.data());
        continue;
      }
      std::vector<float> dg(static_cast<size_t>(S * n));
      for (int64_t r0 = h0; r0 < h1; r0 += S) {
        dot_rows_step(ds, fmt, row, down, S, r0, H, v.data(), i4 ? v2.data() : nullptr, n,
                      dg.data());
        for (int64_t u = 0; u < n; ++u)
          for (int r = 0; r < S && r0 + r < h1; ++r) out[u][r0 - h0 + r] = dg[S * u + r];
      }
    }
  });
  Pool::get().run(threads, t1 - t0, [&](int64_t b, int64_t e) {
    for (int64_t t = t0 + b; t < t0 + e; ++t)
      for (int64_t i = 0; i < H; ++i) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; ++j) {  // experts in order: the sum T = 1 makes
          if (!rows[t * K + j]) continue;  // absent: contributes nothing
          const float wj = c.weights[t * K + j];
          acc += wj * d[(t * K + j - p0) * H + i];
        }
        c.y[t * H + i] = acc;
      }
  });
}

}  // namespace

void expert_ffn(const Layout& L, const Call& c, int threads, Isa isa) {
  check_threads(threads);
  check_layout(L);
  const std::vector<const uint8_t*> rows = routed_rows(L, c);
  const int64_t H = L.hidden, F = L.ffn, T = c.tokens, K = c.k;
  const Fmt fmt = L.fmt;
  const Dots ds = dots_for(isa, fmt, c.dot);
  if (T == 0) return;
  if (K == 0) {
    std::fill(c.y, c.y + T * H, 0.f);
    return;
  }
  const bool i4 = fmt == Fmt::int4;
  const int64_t xl = vec_len(fmt, H), hl = vec_len(fmt, F);
  const bool gg = fmt == Fmt::ggml;
  Matrix gate{L.gate, L.gate_s, L.rb_h, H, L.group_h, L.t_gate};
  Matrix up{L.up, L.up_s, gg ? L.rb_up : L.rb_h, H, L.group_h, L.t_up};
  Matrix down{L.down, L.down_s, L.rb_f, F, L.group_f, L.t_down};
  if (gg) {
    gate.act = act_of(ds, L.t_gate);
    up.act = act_of(ds, L.t_up);
    down.act = act_of(ds, L.t_down);
  }
  std::vector<float> xs;  // int4: each token's x split even / odd
  if (i4) {
    xs.assign(static_cast<size_t>(T * xl), 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < H; ++i) xs[t * xl + vec_pos(fmt, H, i)] = c.x[t * H + i];
  }
  std::vector<float> h(static_cast<size_t>(T * K * hl), 0.f);
  std::vector<int64_t> order, starts;
  group_by_row(rows, order, starts);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;

  std::lock_guard<std::mutex> serial(Pool::get().call_mutex());
  // The q8 path: each token's x quantized once for gate (and up, if its vec_dot type
  // differs), read by every routed expert.
  std::vector<float> xg, xu;
  if (gate.act) quantize_rows(ds, gate.act, c.x, H, H, T, xg, threads);
  if (up.act && up.act != gate.act) quantize_rows(ds, up.act, c.x, H, H, T, xu, threads);
  const std::vector<float>& xup = up.act == gate.act ? xg : xu;
  const int64_t qg = gate.act ? qfloats(gate.act, H) : 0, qu = up.act ? qfloats(up.act, H) : 0;
  const int64_t blk = ds.gemm ? kGemmRows : kBlock;  // rows per gate/up item
  const int64_t fb = (F + blk - 1) / blk;
  Pool::get().run(threads, groups * fb, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / fb, f0 = (item % fb) * blk, f1 = std::min(F, f0 + blk);
      const int64_t* users = order.data() + starts[g];  // the row's (token, expert) pairs
      const int64_t n = starts[g + 1] - starts[g];
      const uint8_t* row = rows[static_cast<size_t>(users[0])];
      std::vector<const float*> v(static_cast<size_t>(n)), v2(static_cast<size_t>(n));
      std::vector<const float*> vg(static_cast<size_t>(n)), vu(static_cast<size_t>(n));
      for (int64_t u = 0; u < n; ++u) {
        const int64_t t = users[u] / K;
        v[u] = i4 ? xs.data() + t * xl : c.x + t * H;
        v2[u] = i4 ? v[u] + xl / 2 : nullptr;
        vg[u] = gate.act ? xg.data() + t * qg : v[u];
        vu[u] = up.act ? xup.data() + t * qu : v[u];
      }
      if (tiled(ds, gate, n) && tiled(ds, up, n)) {  // the expert's tokens as one GEMM
        const int64_t nf = f1 - f0;
        std::vector<float> gu(static_cast<size_t>(2 * n * nf));
        std::vector<float*> go(static_cast<size_t>(n)), uo(static_cast<size_t>(n));
        for (int64_t u = 0; u < n; ++u) {
          go[u] = gu.data() + u * nf;
          uo[u] = gu.data() + (n + u) * nf;
        }
        gemm_rows(ds, row, gate, f0, f1, vg.data(), n, go.data());
        gemm_rows(ds, row, up, f0, f1, vu.data(), n, uo.data());
        for (int64_t u = 0; u < n; ++u)
          for (int64_t r = 0; r < nf; ++r)
            h[users[u] * hl + f0 + r] = activate(c, go[u][r], uo[u][r]);
        continue;
      }
      const int S = is_tiled_type(gate.type) || is_tiled_type(up.type) ? kTileRows : 4;
      std::vector<float> gv(static_cast<size_t>(S * n)), uv(static_cast<size_t>(S * n));
      for (int64_t r0 = f0; r0 < f1; r0 += S) {
        const float* const* vi2 = i4 ? v2.data() : nullptr;
        dot_rows_step(ds, fmt, row, gate, S, r0, F, vg.data(), vi2, n, gv.data());
        dot_rows_step(ds, fmt, row, up, S, r0, F, vu.data(), vi2, n, uv.data());
        for (int64_t u = 0; u < n; ++u) {
          float* ht = h.data() + users[u] * hl;
          for (int r = 0; r < S && r0 + r < F; ++r)
            ht[vec_pos(fmt, F, r0 + r)] = activate(c, gv[S * u + r], uv[S * u + r]);
        }
      }
    }
  });
  // The q8 path: each routed pair's h quantized once for the down rows.
  const float* hin = h.data();  // pair i's input at hin + i * hs
  int64_t hs = hl;
  std::vector<float> hq;
  if (down.act) {
    quantize_rows(ds, down.act, h.data(), hl, F, T * K, hq, threads,
                  [&](int64_t i) { return rows[static_cast<size_t>(i)] == nullptr; });
    hin = hq.data();
    hs = qfloats(down.act, F);
  }
  // AVX-512's tiled GEMM: long token chunks, GEMM-sized row items. Else short chunks and
  // runs of kDownRows rows (interleaving the 8 experts' rows in small blocks streamed ~5%
  // of a decode token slower).
  const bool gemm = ds.gemm && g_several_inputs(down.type) && T >= kGemmMin;
  const int64_t chunk = gemm ? kDownTokens : kDownChunk, per_item = gemm ? kGemmRows : kDownRows;
  for (int64_t t0 = 0; t0 < T; t0 += chunk)
    down_by_expert(ds, fmt, down, rows, t0, std::min(T, t0 + chunk), hin, hs, c, H, per_item,
                   threads);
}

// Tokens per pass over a block of rows: the chunk's inputs stay in L1 while the block
// (read from memory once) is reused from cache for every chunk.
constexpr int64_t kLinearChunk = 8;

void linear(const LinearCall& c, int threads, Isa isa) {
  check_threads(threads);
  const int64_t T = c.tokens, K = c.in, N = c.out;
  if (T < 0 || K < 1 || N < 1) bad("linear: tokens must be >= 0, in and out features >= 1");
  if (!c.w || (T > 0 && (!c.x || !c.y))) bad("linear: null pointer argument");
  int64_t rb = -1;
  if (c.fmt == Fmt::ggml) {
    rb = ggml_row_bytes(c.type, K);
    if (rb < 0)
      bad("linear: GGML type " + std::to_string(c.type) + " is unknown or a row of " +
          std::to_string(K) + " inputs is not whole blocks");
  } else if (c.fmt == Fmt::f32 || c.fmt == Fmt::bf16 || c.fmt == Fmt::f16) {
    rb = K * itemsize(c.fmt);
  } else {
    bad("linear: weights must be float32 / bfloat16 / float16 or GGML blocks");
  }
  if (c.w_stride < rb) bad("linear: weight row stride is shorter than a row");
  const Dots ds = dots_for(isa, c.fmt, c.dot);
  const bool tiles = c.fmt == Fmt::ggml && is_tiled_type(c.type);
  if (tiles && (N % kTileRows || c.w_stride != rb))
    bad("linear: Q4_K_X8 weights need out features a multiple of 8 and contiguous rows, got " +
        std::to_string(N) + " rows");
  if (T == 0) return;
  Matrix m{0, 0, c.w_stride, K, K, c.type};
  if (c.fmt == Fmt::ggml) m.act = act_of(ds, c.type);
  std::lock_guard<std::mutex> serial(Pool::get().call_mutex());
  const float* xin = c.x;  // input t at xin + t * xs (the q8 path: its quantized row)
  int64_t xs = K;
  std::vector<float> xq;
  if (m.act) {
    quantize_rows(ds, m.act, c.x, K, K, T, xq, threads);
    xin = xq.data();
    xs = qfloats(m.act, K);
  }
  if (c.fmt == Fmt::ggml && tiled(ds, m, T)) {  // threads split the output rows
    std::vector<const float*> v(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) v[t] = xin + t * xs;
    Pool::get().run(threads, (N + kGemmRows - 1) / kGemmRows, [&](int64_t b, int64_t e) {
      std::vector<float*> out(static_cast<size_t>(T));
      for (int64_t item = b; item < e; ++item) {
        const int64_t n0 = item * kGemmRows, n1 = std::min(N, n0 + kGemmRows);
        for (int64_t t = 0; t < T; ++t) out[t] = c.y + t * N + n0;
        gemm_rows(ds, c.w, m, n0, n1, v.data(), T, out.data());
        if (c.bias)
          for (int64_t t = 0; t < T; ++t)
            for (int64_t n = n0; n < n1; ++n) c.y[t * N + n] += c.bias[n];
      }
    });
    return;
  }
  const int64_t nb = (N + kBlock - 1) / kBlock;
  const int S = tiles ? kTileRows : 4;  // rows a step (kBlock a multiple of both)
  Pool::get().run(threads, nb, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t n0 = item * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t t0 = 0; t0 < T; t0 += kLinearChunk) {
        const int64_t nt = std::min(T - t0, kLinearChunk);
        const float* v[kLinearChunk];
        for (int64_t t = 0; t < nt; ++t) v[t] = xin + (t0 + t) * xs;
        for (int64_t r0 = n0; r0 < n1; r0 += S) {
          float d[kTileRows * kLinearChunk];
          dot_rows_step(ds, c.fmt, c.w, m, S, r0, N, v, nullptr, nt, d);
          for (int64_t t = 0; t < nt; ++t)
            for (int r = 0; r < S && r0 + r < n1; ++r)
              c.y[(t0 + t) * N + r0 + r] = c.bias ? d[S * t + r] + c.bias[r0 + r] : d[S * t + r];
        }
      }
    }
  });
}

DotFn row_dot(Isa isa, Fmt f) { return dots_for(isa, f).dot; }
DotsFn row_dots(Isa isa, Fmt f) { return dots_for(isa, f).dots; }

void parallel_run(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  check_threads(threads);
  std::lock_guard<std::mutex> serial(Pool::get().call_mutex());
  Pool::get().run(threads, n, fn);
}

double triad_bytes_per_s(int64_t n, int threads, int reps) {
  check_threads(threads);
  if (n < 1 || reps < 1) bad("triad: n and reps must be positive");
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.f),
      cc(static_cast<size_t>(n), 2.f);
  const float s = 3.f;
  std::lock_guard<std::mutex> serial(Pool::get().call_mutex());
  auto pass = [&](int64_t lo, int64_t hi) {
    float* pa = a.data();
    const float* pb = b.data();
    const float* pc = cc.data();
    for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + s * pc[i];
  };
  // Parts of [0, n) by thread, each thread touching its own range (first touch too).
  const int64_t parts = threads;
  auto split = [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) pass(n * p / parts, n * (p + 1) / parts);
  };
  Pool::get().run(threads, parts, split);  // warm-up
  double best = 0.0;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    Pool::get().run(threads, parts, split);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > 0) best = std::max(best, 12.0 * static_cast<double>(n) / dt);
  }
  return best;
}

}  // namespace psr::cpu
