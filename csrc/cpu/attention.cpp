// Row-invariant causal attention on the CPU (expert_gemv.h's `attention`): the expert
// kernels' row dots give the scores (each key a weight row, the query the input), their
// weighted sum the V sum. Items are (token, kv head): the group's query heads, kRowInputs
// at a time, share each key quad's loads. Everything one output row sees depends only on
// its position p and the keys / values at positions <= p, so the row's bits do too.
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

// The outputs of query token t for kv head g's query heads: scores into buf [kRowInputs][n]
// (n keys in the window), then the weights' V sum into the accumulators after them.
void attend(const AttentionCall& c, const Kernels& ks, int64_t t, int64_t g,
            std::vector<float>& buf) {
  const int64_t G = c.q_heads / c.kv_heads, p = c.q_start + t;
  const int64_t lo = c.window ? std::max<int64_t>(0, p - c.window + 1) : 0, n = p + 1 - lo;
  const int64_t kb = float_bytes(c.k_fmt), vb = float_bytes(c.v_fmt);
  const uint8_t* kg = c.k + (lo * c.k_sl + g * c.k_sh) * kb;
  const uint8_t* vg = c.v + (lo * c.v_sl + g * c.v_sh) * vb;
  buf.resize(static_cast<size_t>(kRowInputs * (n + c.dv)));
  float* s = buf.data();
  float* acc = s + kRowInputs * n;
  for (int64_t h0 = 0; h0 < G; h0 += kRowInputs) {
    const int nh = static_cast<int>(std::min<int64_t>(kRowInputs, G - h0));
    const int64_t hq = g * G + h0;  // the first query head of this pass
    const float* qs[kRowInputs];
    for (int i = 0; i < nh; ++i) qs[i] = c.q + (t * c.q_heads + hq + i) * c.dk;
    for (int64_t j0 = 0; j0 < n; j0 += 4) {  // a quad of keys (the last one repeated)
      const uint8_t* w[4];
      for (int r = 0; r < 4; ++r) w[r] = kg + std::min(j0 + r, n - 1) * c.k_sl * kb;
      float d[4 * kRowInputs];
      if (ks.dots) {
        ks.dots(w, c.dk, qs, nh, d);
      } else {
        for (int i = 0; i < nh; ++i) ks.dot(w, c.dk, qs[i], nullptr, d + 4 * i);
      }
      for (int i = 0; i < nh; ++i)
        for (int r = 0; r < 4 && j0 + r < n; ++r) s[i * n + j0 + r] = d[4 * i + r] * c.scale;
    }
    float sum[kRowInputs];
    for (int i = 0; i < nh; ++i) {  // softmax numerators, their sum, the sink's term last
      float* si = s + i * n;
      const float m = window_max(si, n, c.sinks ? c.sinks[hq + i] : -kInf);
      ks.exp(si, n, m);
      const float z = window_sum(si, n);
      sum[i] = c.sinks ? z + std::exp(c.sinks[hq + i] - m) : z;
    }
    ks.wsum(vg, c.v_sl * vb, n, c.dv, s, n, nh, acc, c.dv);
    for (int i = 0; i < nh; ++i) {
      const float inv = 1.f / sum[i];
      float* y = c.y + (t * c.q_heads + hq + i) * c.dv;
      for (int64_t e = 0; e < c.dv; ++e) y[e] = acc[i * c.dv + e] * inv;
    }
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
  // Items (u, g), u taking the tokens from both ends in turn (0, T-1, 1, T-2, ...): each
  // thread's contiguous range gets short and long causal rows alike (which thread computes
  // a row never changes how).
  const int64_t T = c.tokens;
  parallel_run(threads, T * c.kv_heads, [&](int64_t b, int64_t e) {
    std::vector<float> buf;
    for (int64_t item = b; item < e; ++item) {
      const int64_t u = item / c.kv_heads;
      attend(c, ks, u % 2 ? T - 1 - u / 2 : u / 2, item % c.kv_heads, buf);
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
