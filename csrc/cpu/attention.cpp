// Row-invariant causal attention on the CPU (expert_gemv.h's `attention`): the expert
// kernels' row dots give the scores (each key a weight row, the query the input), their
// weighted sum the V sum. Items are (tile of query rows, kv head): the tile's rows (of its
// tokens x the group's query heads), kRowInputs at a time, share each key quad's loads, and
// each block of keys and values is read once for the tile. Everything one output row sees
// depends only on its position p and the keys / values at positions <= p, so the row's bits
// do too.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "expert_gemv.h"

namespace psr::cpu {
namespace {

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("cpu attention: " + what);
}

int64_t float_bytes(Fmt f) {
  if (f != Fmt::f32 && f != Fmt::bf16 && f != Fmt::f16)
    bad("keys and values must be float32 / bfloat16 / float16");
  return f == Fmt::f32 ? 4 : 2;
}

struct Kernels {
  DotFn dot;
  DotsFn dots;  // nullptr: dot per head
  WsumFn wsum;
  ExpFn exp;
};

WsumFn wsum_for(Isa isa, Fmt f) {
  WsumFn w = nullptr;
  if (isa == Isa::avx512) w = avx512_wsum(f);
  if (isa == Isa::avx2) w = avx2_wsum(f);
  return w ? w : scalar_wsum(f);
}

ExpFn exp_for(Isa isa) {
  ExpFn f = nullptr;
  if (isa == Isa::avx512) f = avx512_exp();
  if (isa == Isa::avx2) f = avx2_exp();
  return f ? f : scalar_exp();
}

void check(const AttentionCall& c) {
  if (c.tokens < 0 || c.q_heads < 1 || c.kv_heads < 1 || c.dk < 1 || c.dv < 1)
    bad("tokens must be >= 0; heads and head dims >= 1");
  if (c.q_heads % c.kv_heads)
    bad(std::to_string(c.q_heads) + " query heads are not a multiple of " +
        std::to_string(c.kv_heads) + " kv heads");
  if (c.q_start < 0 || c.keys < c.q_start + c.tokens)
    bad(std::to_string(c.keys) + " keys do not cover queries at positions " +
        std::to_string(c.q_start) + ".." + std::to_string(c.q_start + c.tokens - 1));
  if (c.window < 0) bad("window must be >= 1 (0: none)");
  if (c.k_sl < 0 || c.k_sh < 0 || c.v_sl < 0 || c.v_sh < 0) bad("strides must be >= 0");
  if (c.tokens > 0 && (!c.q || !c.k || !c.v || !c.y)) bad("null pointer argument");
  float_bytes(c.k_fmt);
  float_bytes(c.v_fmt);
}

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kLanes = 8;  // independent partial sums / maxima (instruction-level parallelism)

// max(m0, x[0..n)): exact in any order (no NaN), so partial maxima change nothing.
float window_max(const float* x, int64_t n, float m0) {
  float m[kLanes];
  std::fill(m, m + kLanes, m0);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = std::max(m[l], x[j + l]);
  for (; j < n; ++j) m[0] = std::max(m[0], x[j]);
  for (int l = 1; l < kLanes; ++l) m[0] = std::max(m[0], m[l]);
  return m[0];
}

// sum(x[0..n)) in a fixed order given n: kLanes partial sums of x[l], x[l + kLanes], ...
// (relative to the window's first key), then added lane 0 first.
float window_sum(const float* x, int64_t n) {
  float z[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) z[l] += x[j + l];
  for (int l = 0; j < n; ++j, ++l) z[l] += x[j];
  float t = 0.f;
  for (int l = 0; l < kLanes; ++l) t += z[l];
  return t;
}

// Query rows a tile holds (a kv head's rows in (token, head) order cut every kQueryRows,
// whole tokens or not: a tile's scratch is at most kQueryRows x its keys, however wide the
// group), and keys a block: each key and value is read once a tile from L2 / L3 instead
// of once a row (32x fewer bytes for MHA prefill), a block's for all the tile's rows at a
// time. Tuned on a Xeon (AVX-512) at Dk 128: 16-64 rows and 32-256 keys were within
// the machine's noise of each other; 4 rows (the kernel before tiles) 1.3-2.9x slower.
constexpr int64_t kQueryRows = 32;
constexpr int64_t kKeyBlock = 64;
// A tile's rows start at most kQueryRows - 1 keys after its first (the window's start moves
// a key a token), so within its first key block: a row's V sum starts in block 0.
static_assert(kQueryRows <= kKeyBlock);

struct Scratch {
  std::vector<float> buf;  // scores [R][S], then the accumulators [R][Dv]
  std::vector<int64_t> lo, hi;
  std::vector<const float*> q;
  std::vector<float> sum;
};

// The outputs of kv head g's query rows [q0, q1) (row q: token q / G, the group's head q % G;
// at most kQueryRows, whole tokens or not), local row r = q - q0 with its keys [lo_r, hi_r)
// (relative to the tile's first key). Per key block:
// the scores of every row the block reaches (row dots, kRowInputs rows a key quad); then
// each row's softmax over its own keys; then per key block the weighted V sum, resumed
// from the last block's accumulators. A row's scores, max, exp, sum and V sum are the same
// operations in the same order as the row alone (DotsFn's per-input bits, WsumFn's key
// order and `resume`), so tiling never changes a bit.
void attend(const AttentionCall& c, const Kernels& ks, int64_t q0, int64_t q1, int64_t g,
            Scratch& sc) {
  const int64_t G = c.q_heads / c.kv_heads, R = q1 - q0;
  auto first_key = [&](int64_t p) {
    return c.window ? std::max<int64_t>(0, p - c.window + 1) : int64_t{0};
  };
  // local row r's row of q / y [T, Hq] (token (q0 + r) / G, head g * G + (q0 + r) % G)
  auto qy_row = [&](int64_t r) { return (q0 + r) / G * c.q_heads + g * G + (q0 + r) % G; };
  const int64_t base = first_key(c.q_start + q0 / G), S = c.q_start + (q1 - 1) / G + 1 - base;
  const int64_t kb = float_bytes(c.k_fmt), vb = float_bytes(c.v_fmt);
  const uint8_t* kg = c.k + (base * c.k_sl + g * c.k_sh) * kb;
  const uint8_t* vg = c.v + (base * c.v_sl + g * c.v_sh) * vb;
  sc.buf.resize(static_cast<size_t>(R * (S + c.dv)));
  sc.lo.resize(R);
  sc.hi.resize(R);
  sc.q.resize(R);
  sc.sum.resize(R);
  float* s = sc.buf.data();
  float* acc = s + R * S;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = (q0 + r) / G, p = c.q_start + t;
    sc.lo[r] = first_key(p) - base;
    sc.hi[r] = p + 1 - base;
    sc.q[r] = c.q + qy_row(r) * c.dk;
  }
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {  // scores
    const int64_t j1 = std::min(S, j0 + kKeyBlock);
    for (int64_t r0 = 0; r0 < R; r0 += kRowInputs) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowInputs, R - r0));
      // rows are in token order, so the group's keys are [lo of its first, hi of its last)
      const int64_t a = std::max(j0, sc.lo[r0]), b = std::min(j1, sc.hi[r0 + nr - 1]);
      for (int64_t j = a; j < b; j += 4) {  // a quad of keys (the last one repeated)
        const uint8_t* w[4];
        for (int q = 0; q < 4; ++q) w[q] = kg + std::min(j + q, b - 1) * c.k_sl * kb;
        float d[4 * kRowInputs];
        if (ks.dots) {
          ks.dots(w, c.dk, sc.q.data() + r0, nr, d);
        } else {
          for (int i = 0; i < nr; ++i) ks.dot(w, c.dk, sc.q[r0 + i], nullptr, d + 4 * i);
        }
        for (int i = 0; i < nr; ++i) {
          const int64_t r = r0 + i, lo = std::max(j, sc.lo[r]), hi = std::min(j + 4, sc.hi[r]);
          for (int64_t jj = lo; jj < hi; ++jj) s[r * S + jj] = d[4 * i + (jj - j)] * c.scale;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // softmax numerators, their sum, the sink's term last
    float* sr = s + r * S + sc.lo[r];
    const int64_t n = sc.hi[r] - sc.lo[r], hq = qy_row(r) % c.q_heads;
    const float m = window_max(sr, n, c.sinks ? c.sinks[hq] : -kInf);
    ks.exp(sr, n, m);
    const float z = window_sum(sr, n);
    sc.sum[r] = c.sinks ? z + std::exp(c.sinks[hq] - m) : z;
  }
  for (int64_t j0 = 0; j0 < S; j0 += kKeyBlock) {  // the V sums, block by block
    const int64_t j1 = std::min(S, j0 + kKeyBlock);
    for (int64_t r = 0; r < R;) {
      const int64_t a = std::max(j0, sc.lo[r]), b = std::min(j1, sc.hi[r]);
      if (a >= b) {
        ++r;
        continue;
      }
      // the run of rows with the same keys in this block shares it; a row's keys start in
      // block 0 (kQueryRows <= kKeyBlock), so every row resumes after it
      int na = 1;
      while (na < kRowInputs && r + na < R && std::max(j0, sc.lo[r + na]) == a &&
             std::min(j1, sc.hi[r + na]) == b)
        ++na;
      ks.wsum(vg + a * c.v_sl * vb, c.v_sl * vb, b - a, c.dv, s + r * S + a, S, na, acc + r * c.dv,
              c.dv, j0 > 0);
      r += na;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / sc.sum[r];
    float* y = c.y + qy_row(r) * c.dv;
    for (int64_t e = 0; e < c.dv; ++e) y[e] = acc[r * c.dv + e] * inv;
  }
}

}  // namespace

void attention(const AttentionCall& c, int threads, Isa isa) {
  check(c);
  const Kernels ks{row_dot(isa, c.k_fmt), row_dots(isa, c.k_fmt), wsum_for(isa, c.v_fmt),
                   exp_for(isa)};
  if (c.tokens == 0) {
    parallel_run(threads, 0, [](int64_t, int64_t) {});  // still checks threads
    return;
  }
  // Items (tile u, kv head g), u taking the tiles from both ends in turn (0, U-1, 1, U-2,
  // ...): each thread's contiguous range gets short and long causal rows alike (which
  // thread computes a row, and which rows share its tile, never changes how).
  const int64_t T = c.tokens, G = c.q_heads / c.kv_heads;
  const int64_t rows = T * G, U = (rows + kQueryRows - 1) / kQueryRows;
  parallel_run(threads, U * c.kv_heads, [&](int64_t b, int64_t e) {
    Scratch sc;
    for (int64_t item = b; item < e; ++item) {
      const int64_t u = item / c.kv_heads, tile = u % 2 ? U - 1 - u / 2 : u / 2;
      const int64_t q0 = tile * kQueryRows;
      attend(c, ks, q0, std::min(rows, q0 + kQueryRows), item % c.kv_heads, sc);
    }
  });
}

namespace {

// bfloat16 <-> float as torch converts them: widening exact, narrowing to nearest even
// (NaN kept quiet).
float widen(float x) { return x; }
float widen(uint16_t b) { return bf16_to_f32(b); }
uint16_t bf16_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// x rounded to T's precision, as a float (torch rounds each elementwise op's result).
template <typename T>
float rounded(float x) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_f32(bf16_of(x));
  return x;
}
template <typename O>
O stored(float x) {  // x is already representable in O's precision where O is bf16
  if constexpr (std::is_same_v<O, uint16_t>) return bf16_of(x);
  return x;
}

// out = x * c + rotate_half(x) * s over one head of d values (d even) in T's arithmetic:
// each product and the sum rounded to T, as torch's separate elementwise ops round them
// (this file is built without FMA contraction); stored as O (T, or float widened).
template <typename T, typename O>
void rope_row(const T* x, const T* c, const T* s, int64_t d, O* out) {
  const int64_t h = d / 2;
  for (int64_t e = 0; e < d; ++e) {
    const float r = e < h ? -widen(x[e + h]) : widen(x[e - h]);
    const float a = rounded<T>(widen(x[e]) * widen(c[e])), b = rounded<T>(r * widen(s[e]));
    out[e] = stored<O>(rounded<T>(a + b));
  }
}

template <typename T>
void rope_write(const RopeAttentionCall& r, int threads) {
  const AttentionCall& c = r.attn;
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads, dk = c.dk, dv = c.dv;
  const T* qi = static_cast<const T*>(r.q_in);
  const T* ki = static_cast<const T*>(r.k_in);
  const T* vi = static_cast<const T*>(r.v_in);
  const T* cs = static_cast<const T*>(r.cos);
  const T* sn = static_cast<const T*>(r.sin);
  float* q = const_cast<float*>(c.q);  // the call's own buffer for the roped queries
  T* kc = reinterpret_cast<T*>(const_cast<uint8_t*>(c.k));
  T* vc = reinterpret_cast<T*>(const_cast<uint8_t*>(c.v));
  // Elementwise work, one token a part: which thread writes a row never changes its bits.
  parallel_run(threads, c.tokens, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* ct = cs + t * dk;
      const T* st = sn + t * dk;
      for (int64_t h = 0; h < Hq; ++h)
        rope_row(qi + (t * Hq + h) * dk, ct, st, dk, q + (t * Hq + h) * dk);
      const int64_t p = c.q_start + t;
      for (int64_t g = 0; g < Hkv; ++g) {
        rope_row(ki + (t * Hkv + g) * dk, ct, st, dk, kc + p * c.k_sl + g * c.k_sh);
        std::copy_n(vi + (t * Hkv + g) * dv, dv, vc + p * c.v_sl + g * c.v_sh);
      }
    }
  });
}

}  // namespace

void rope_attention(const RopeAttentionCall& r, int threads, Isa isa) {
  const AttentionCall& c = r.attn;
  check(c);
  if (c.k_fmt != r.fmt || c.v_fmt != r.fmt || (r.fmt != Fmt::f32 && r.fmt != Fmt::bf16))
    bad("the new rows and the cache must be one format, float32 or bfloat16");
  if (c.dk % 2) bad("the head dim must be even for the rotary embedding");
  if (c.tokens > 0 && (!r.q_in || !r.k_in || !r.v_in || !r.cos || !r.sin))
    bad("null pointer argument");
  if (r.fmt == Fmt::f32)
    rope_write<float>(r, threads);
  else
    rope_write<uint16_t>(r, threads);
  attention(c, threads, isa);
}

}  // namespace psr::cpu
