// AVX2 + FMA + F16C row kernels of the CPU expert FFN. Compiled for that target with a
// pragma (this file only: no standard-library code is instantiated here), called only
// after run-time detection (supported_isas). Eight lanes per row over whole chunks, then
// the tail element by element (never a load past the row), added after the lanes' sum.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "expert_gemv.h"
#include "prefetch.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

// GGML block rows, compiled (and auto-vectorised) for this target.
#define PSR_GGML_F16C 1
#include "ggml_dot.h"

namespace psr::cpu {
namespace {

inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256 fp8_to_f32(__m256i c) {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(0xF));
  const __m256i m = _mm256_and_si256(c, _mm256_set1_epi32(7));
  const __m256i mag7 = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(mag7, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.001953125f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag7, _mm256_set1_epi32(0x7F)));
  mag = _mm256_blendv_ps(mag, _mm256_set1_ps(__builtin_nanf("")), is_nan);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

inline __m128i load8(const uint8_t* p) {
  int64_t q;
  std::memcpy(&q, p, 8);
  return _mm_cvtsi64_si128(q);
}

struct F32 {
  static __m256 vec(const uint8_t* p, int64_t i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
  }
  static float one(const uint8_t* p, int64_t i) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
};
struct BF16 {
  static __m256 vec(const uint8_t* p, int64_t i) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  static float one(const uint8_t* p, int64_t i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    return bf16_to_f32(b);
  }
};
struct F16 {
  static __m256 vec(const uint8_t* p, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
  }
  static float one(const uint8_t* p, int64_t i) {
    uint16_t b;
    std::memcpy(&b, p + 2 * i, 2);
    return f16_to_f32(b);
  }
};
struct I8 {
  static __m256 vec(const uint8_t* p, int64_t i) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + i)));
  }
  static float one(const uint8_t* p, int64_t i) {
    return static_cast<float>(static_cast<int8_t>(p[i]));
  }
};
struct FP8 {
  static __m256 vec(const uint8_t* p, int64_t i) {
    return fp8_to_f32(_mm256_cvtepu8_epi32(load8(p + i)));
  }
  static float one(const uint8_t* p, int64_t i) { return fp8_e4m3_to_f32(p[i]); }
};

// Four rows against NV inputs (each chunk of a row widened once for all of them):
// out[4 t + r]. Input t sees the same operations in the same order as at NV = 1 (dot4,
// the one-input kernel), so the same bits. At NV = 3, 12 accumulators, the inputs' chunks
// and one widened row fill AVX2's 16 registers; NV = 4 spills accumulators (a store and a
// reload on their chains), so more inputs go three at a time (kAvx2DotsInputs).
template <class W, int NV>
void dot4_nv(const uint8_t* const w[4], int64_t n, const float* const* v, float* out) {
  __m256 a[NV][4];
  for (int t = 0; t < NV; ++t)
    for (int r = 0; r < 4; ++r) a[t][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if constexpr (NV == 4) {  // the four rows widened first: the order that spills least
      const __m256 w0 = W::vec(w[0], i), w1 = W::vec(w[1], i), w2 = W::vec(w[2], i),
                   w3 = W::vec(w[3], i);
      for (int t = 0; t < NV; ++t) {
        const __m256 x = _mm256_loadu_ps(v[t] + i);
        a[t][0] = _mm256_fmadd_ps(w0, x, a[t][0]);
        a[t][1] = _mm256_fmadd_ps(w1, x, a[t][1]);
        a[t][2] = _mm256_fmadd_ps(w2, x, a[t][2]);
        a[t][3] = _mm256_fmadd_ps(w3, x, a[t][3]);
      }
    } else {  // one widened row at a time beside the NV inputs' chunks
      __m256 x[NV];
      for (int t = 0; t < NV; ++t) x[t] = _mm256_loadu_ps(v[t] + i);
      for (int r = 0; r < 4; ++r) {
        const __m256 wr = W::vec(w[r], i);
        for (int t = 0; t < NV; ++t) a[t][r] = _mm256_fmadd_ps(wr, x[t], a[t][r]);
      }
    }
  }
  for (int t = 0; t < NV; ++t) {
    for (int r = 0; r < 4; ++r) {
      float s = hsum(a[t][r]);
      for (int64_t j = i; j < n; ++j) s += W::one(w[r], j) * v[t][j];
      out[4 * t + r] = s;
    }
  }
}

template <class W>
void dot4(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  dot4_nv<W, 1>(w, n, &v, out);
}

template <class W>
void dots4(const uint8_t* const w[4], int64_t n, const float* const* v, int nv, float* out) {
  g_for_inputs(nv, [&](auto k) { dot4_nv<W, decltype(k)::value>(w, n, v, out); });
}

// Attention's weighted V sum (WsumFn): C vectors of 8 output columns at a time for NH heads,
// the accumulators in registers across the keys; the last columns one by one.
template <class W, int NH, int C>
void wsum_block(const uint8_t* v, int64_t vs, int64_t n, int64_t e0, const float* a, int64_t as,
                float* out, int64_t os, bool resume) {
  __m256 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c)
      acc[h][c] = resume ? _mm256_loadu_ps(out + h * os + e0 + 8 * c) : _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* vj = v + j * vs;
    __m256 x[C];
    for (int c = 0; c < C; ++c) x[c] = W::vec(vj, e0 + 8 * c);
    for (int h = 0; h < NH; ++h) {
      const __m256 b = _mm256_set1_ps(a[h * as + j]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm256_fmadd_ps(b, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + h * os + e0 + 8 * c, acc[h][c]);
}

template <class W, int NH>
void wsum_nh(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as,
             float* out, int64_t os, bool resume) {
  int64_t e0 = 0;
  for (; e0 + 16 <= dv; e0 += 16) wsum_block<W, NH, 2>(v, vs, n, e0, a, as, out, os, resume);
  for (; e0 + 8 <= dv; e0 += 8) wsum_block<W, NH, 1>(v, vs, n, e0, a, as, out, os, resume);
  for (; e0 < dv; ++e0)
    for (int h = 0; h < NH; ++h) {
      float acc = resume ? out[h * os + e0] : 0.f;
      for (int64_t j = 0; j < n; ++j)
        acc = __builtin_fmaf(a[h * as + j], W::one(v + j * vs, e0), acc);
      out[h * os + e0] = acc;
    }
}

template <class W>
void wsum(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as, int na,
          float* out, int64_t os, bool resume) {
  g_for_inputs(
      na, [&](auto k) { wsum_nh<W, decltype(k)::value>(v, vs, n, dv, a, as, out, os, resume); });
}

// exp(x - m) on 8 lanes: expert_gemv.h's kExp* polynomial, 2^k built in the exponent bits.
inline __m256 exp8(__m256 x) {
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(fx, _mm256_set1_ps(-126.f))),
                       _mm256_set1_epi32(127)),
      23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_GE_OQ);
  return _mm256_and_ps(out, keep);
}

void exp_minus(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  if (i < n) {  // the tail through a padded copy: the same lanes' arithmetic
    float t[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = i; j < n; ++j) t[j - i] = x[j];
    _mm256_storeu_ps(t, exp8(_mm256_sub_ps(_mm256_loadu_ps(t), mv)));
    for (int64_t j = i; j < n; ++j) x[j] = t[j - i];
  }
}

inline __m256 nib_fma(const uint8_t* p, __m256 ve, __m256 vo, __m256 a) {
  const __m256i b = _mm256_cvtepu8_epi32(load8(p));
  const __m256i k8 = _mm256_set1_epi32(8);
  const __m256i lo =
      _mm256_sub_epi32(_mm256_xor_si256(_mm256_and_si256(b, _mm256_set1_epi32(0xF)), k8), k8);
  const __m256i hi = _mm256_sub_epi32(_mm256_xor_si256(_mm256_srli_epi32(b, 4), k8), k8);
  a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), ve, a);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), vo, a);
}

void dot4_int4(const uint8_t* const w[4], int64_t n, const float* v, const float* v2,
               float out[4]) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 ve = _mm256_loadu_ps(v + i), vo = _mm256_loadu_ps(v2 + i);
    a0 = nib_fma(w[0] + i, ve, vo, a0);
    a1 = nib_fma(w[1] + i, ve, vo, a1);
    a2 = nib_fma(w[2] + i, ve, vo, a2);
    a3 = nib_fma(w[3] + i, ve, vo, a3);
  }
  const __m256 a[4] = {a0, a1, a2, a3};
  for (int r = 0; r < 4; ++r) {
    float s = hsum(a[r]);
    for (int64_t j = i; j < n; ++j) {
      const int b = w[r][j];
      s += static_cast<float>(((b & 0xF) ^ 8) - 8) * v[j];
      s += static_cast<float>(((b >> 4) ^ 8) - 8) * v2[j];
    }
    out[r] = s;
  }
}

// GGML block rows straight into registers (no scratch) for the common types; the others
// (Q5_0 / Q5_1 / FP8_B128, float parts) keep ggml_dot.h's scratch path. 4-bit codes
// become signed bytes by one in-register table lookup (vpshufb), bytes are widened eight at
// a time and met in fp32 FMAs; a block's (sub-block's) partial dot is scaled once, its min
// times the sum of its inputs.
inline __m128i lo_nib(__m128i raw) { return _mm_and_si128(raw, _mm_set1_epi8(0xF)); }
inline __m128i hi_nib(__m128i raw) {
  return _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0xF));
}
inline __m128i ld16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
// Sixteen signed bytes widened to fp32 once (several inputs then share them).
struct W16 {
  __m256 lo, hi;
};
inline W16 widen(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)))};
}
// Sixteen widened bytes against v[0..15]: p += w * v; sx += v (kSum).
template <bool kSum>
inline void dot16(const W16& w, const float* v, __m256& p, __m256& sx) {
  const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
  p = _mm256_fmadd_ps(w.lo, v0, p);
  p = _mm256_fmadd_ps(w.hi, v1, p);
  if (kSum) sx = _mm256_add_ps(sx, _mm256_add_ps(v0, v1));
}
template <bool kSum>
inline void bytes16(__m128i b, const float* v, __m256& p, __m256& sx) {
  dot16<kSum>(widen(b), v, p, sx);
}

// A 32-block of 4-bit codes (low nibbles elements 0..15, high 16..31) through `lut`
// (signed bytes), its partial dot scaled by s.
inline __m256 nib32(const uint8_t* qs, __m128i lut, const float* v, float s, __m256 acc) {
  const __m128i raw = ld16(qs);
  __m256 p = _mm256_setzero_ps(), unused = p;
  bytes16<false>(_mm_shuffle_epi8(lut, lo_nib(raw)), v, p, unused);
  bytes16<false>(_mm_shuffle_epi8(lut, hi_nib(raw)), v + 16, p, unused);
  return _mm256_fmadd_ps(p, _mm256_set1_ps(s), acc);
}

// 32 codes 0..15 (c0: elements 0..15, c1: 16..31): s * sum(q v) + m * sum(v).
inline __m256 min32(const W16& c0, const W16& c1, const float* v, float s, float m, __m256 acc) {
  __m256 p = _mm256_setzero_ps(), sx = p;
  dot16<true>(c0, v, p, sx);
  dot16<true>(c1, v + 16, p, sx);
  return _mm256_fmadd_ps(sx, _mm256_set1_ps(m), _mm256_fmadd_ps(p, _mm256_set1_ps(s), acc));
}
inline __m256 nib32_min(__m128i c0, __m128i c1, const float* v, float s, float m, __m256 acc) {
  return min32(widen(c0), widen(c1), v, s, m, acc);
}

// Scales stored to a small array stay there (without this barrier the compiler turns the
// broadcasts from it into shuffles): the blocks read them by broadcasts from memory.
template <int N>
inline void in_memory(float (&a)[N]) {
  __asm__ volatile("" : "+m"(a));
}

// A Q4_K super-block's 6-bit scales and mins (12 bytes at b + 4, llama.cpp's unpacking),
// decoded once: sc[s] = d * sc_s, mn[s] = -(dmin * m_s). The arrays stay in memory: the
// sub-blocks read them by broadcasts from memory (loads, not shuffles).
inline void k_scales_mins(const uint8_t* b, float (&sc)[8], float (&mn)[8]) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint32_t m1 = 0x3f3f3f3fu, m2 = 0x0f0f0f0fu, m3 = 0x03030303u;
  const uint64_t s = (u[0] & m1) | static_cast<uint64_t>((u[2] & m2) | (((u[0] >> 6) & m3) << 4))
                                       << 32;
  const uint64_t m =
      (u[1] & m1) | static_cast<uint64_t>(((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4)) << 32;
  const __m256 fs =
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(s))));
  const __m256 fm =
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(m))));
  _mm256_store_ps(sc, _mm256_mul_ps(fs, _mm256_set1_ps(g_h2f(b))));
  _mm256_store_ps(mn, _mm256_mul_ps(fm, _mm256_set1_ps(-g_h2f(b + 2))));
  in_memory(sc);
  in_memory(mn);
}

// out[t] = the dot of one row of `type` (g_several_inputs) with each of NV inputs v[t]: the
// codes widened once, input t's accumulator given the same operations in the same order as
// at NV = 1 (the one-input dot), so the same bits.
template <int NV>
void ggml_rows_nv(int type, const uint8_t* row, int64_t K, const float* const* v, float* out) {
  __m256 acc[NV];
  for (int t = 0; t < NV; ++t) acc[t] = _mm256_setzero_ps();
  switch (type) {
    case ggml_type::Q8_0:
      for (int64_t k = 0; k < K; k += 32, row += 34) {
        ahead(row, 1);
        const W16 w0 = widen(ld16(row + 2)), w1 = widen(ld16(row + 18));
        const __m256 d = _mm256_set1_ps(g_h2f(row));
        for (int t = 0; t < NV; ++t) {
          __m256 p = _mm256_setzero_ps(), unused = p;
          dot16<false>(w0, v[t] + k, p, unused);
          dot16<false>(w1, v[t] + k + 16, p, unused);
          acc[t] = _mm256_fmadd_ps(p, d, acc[t]);
        }
      }
      break;
    case ggml_type::Q4_K:  // per sub-block d * sc * q - dmin * m
    case ggml_type::Q5_K:  // Q4_K's codes plus a fifth bit, bit 2j (2j + 1) of qh[l] for
                           // sub-block 2j's (2j + 1's) element l
      for (int64_t k = 0; k < K; k += 256, row += type == ggml_type::Q4_K ? 144 : 176) {
        ahead(row, 3);
        alignas(32) float sc[8], mn[8];  // d * sc_s, -(dmin * m_s)
        k_scales_mins(row, sc, mn);
        const bool q5 = type == ggml_type::Q5_K;
        const uint8_t* qs = row + (q5 ? 48 : 16);
        const __m128i h0 = ld16(row + 16), h1 = ld16(row + 32), one = _mm_set1_epi8(1);
        for (int j = 0; j < 4; ++j) {
          const __m128i r0 = ld16(qs + 32 * j), r1 = ld16(qs + 16 + 32 * j);
          __m128i c[4] = {lo_nib(r0), lo_nib(r1), hi_nib(r0), hi_nib(r1)};
          if (q5) {
            const __m128i s0 = _mm_cvtsi32_si128(2 * j), s1 = _mm_cvtsi32_si128(2 * j + 1);
            auto fifth = [&](__m128i h, __m128i sh) {  // the bit at sh as 16
              return _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, sh), one), 4);
            };
            c[0] = _mm_or_si128(c[0], fifth(h0, s0));
            c[1] = _mm_or_si128(c[1], fifth(h1, s0));
            c[2] = _mm_or_si128(c[2], fifth(h0, s1));
            c[3] = _mm_or_si128(c[3], fifth(h1, s1));
          }
          const W16 w[4] = {widen(c[0]), widen(c[1]), widen(c[2]), widen(c[3])};
          for (int t = 0; t < NV; ++t) {
            const float* v0 = v[t] + k + 64 * j;
            acc[t] = min32(w[0], w[1], v0, sc[2 * j], mn[2 * j], acc[t]);
            acc[t] = min32(w[2], w[3], v0 + 32, sc[2 * j + 1], mn[2 * j + 1], acc[t]);
          }
        }
      }
      break;
    case ggml_type::Q6_K:  // (ql's 4 bits | qh's 2 bits << 4) - 32, a scale per 16
      for (int64_t k = 0; k < K; k += 256, row += 210) {
        ahead(row, 4);
        alignas(32) float sc[16];  // d * sc[i], the scale of elements 16 i .. 16 i + 15
        const __m128i raw = ld16(row + 192);
        const __m256 d = _mm256_set1_ps(g_h2f(row + 208));
        _mm256_store_ps(sc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d));
        _mm256_store_ps(
            sc + 8, _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw))), d));
        in_memory(sc);
        const __m128i m4 = _mm_set1_epi8(0xF), m3 = _mm_set1_epi8(3), k32 = _mm_set1_epi8(32);
        for (int n = 0; n < 2; ++n) {
          for (int g = 0; g < 4; ++g) {
            const __m128i sh = _mm_cvtsi32_si128(g < 2 ? 0 : 4), hs = _mm_cvtsi32_si128(2 * g);
            for (int hh = 0; hh < 2; ++hh) {
              const __m128i l4 =
                  _mm_and_si128(_mm_srl_epi16(ld16(row + 64 * n + 32 * (g & 1) + 16 * hh), sh), m4);
              const __m128i h2 =
                  _mm_and_si128(_mm_srl_epi16(ld16(row + 128 + 32 * n + 16 * hh), hs), m3);
              const W16 w = widen(_mm_sub_epi8(_mm_or_si128(l4, _mm_slli_epi16(h2, 4)), k32));
              const __m256 s = _mm256_set1_ps(sc[8 * n + 2 * g + hh]);
              for (int t = 0; t < NV; ++t) {
                __m256 p = _mm256_setzero_ps(), unused = p;
                dot16<false>(w, v[t] + k + 128 * n + 32 * g + 16 * hh, p, unused);
                acc[t] = _mm256_fmadd_ps(p, s, acc[t]);
              }
            }
          }
        }
      }
      break;
    default:
      break;  // not g_several_inputs: never called
  }
  for (int t = 0; t < NV; ++t) out[t] = hsum(acc[t]);
}

float ggml_row_dot(int type, const uint8_t* row, int64_t K, const float* v) {
  if (g_several_inputs(type)) {  // the same code as several inputs take: the same bits
    float out;
    ggml_rows_nv<1>(type, row, K, &v, &out);
    return out;
  }
  __m256 acc = _mm256_setzero_ps();
  switch (type) {
    case ggml_type::Q4_0: {  // d (q - 8)
      const __m128i lut = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t k = 0; k < K; k += 32, row += 18) {
        ahead(row, 1);
        acc = nib32(row + 2, lut, v + k, g_h2f(row), acc);
      }
      break;
    }
    case ggml_type::MXFP4: {  // twice the FP4 values, half the block's power of two
      const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
      for (int64_t k = 0; k < K; k += 32, row += 17) {
        ahead(row, 1);
        acc = nib32(row + 1, lut, v + k, 0.5f * g_e8m0(row[0]), acc);
      }
      break;
    }
    case ggml_type::Q4_1:  // d q + m
      for (int64_t k = 0; k < K; k += 32, row += 20) {
        ahead(row, 1);
        const __m128i raw = ld16(row + 4);
        acc = nib32_min(lo_nib(raw), hi_nib(raw), v + k, g_h2f(row), g_h2f(row + 2), acc);
      }
      break;
    default:
      return g_row_dot(type, row, K, v);
  }
  return hsum(acc);
}

}  // namespace

// Instantiated here, inside the target region; indexed by Fmt.
const DotFn kAvx2Dots[6] = {dot4<F32>, dot4<BF16>, dot4<F16>, dot4<I8>, dot4<FP8>, dot4_int4};
const DotsFn kAvx2SeveralDots[5] = {dots4<F32>, dots4<BF16>, dots4<F16>, dots4<I8>, dots4<FP8>};
const WsumFn kAvx2Wsum[3] = {wsum<F32>, wsum<BF16>, wsum<F16>};
const ExpFn kAvx2Exp = exp_minus;

static void ggml_row_dots(int type, const uint8_t* row, int64_t K, const float* const* v, int nv,
                          float* out) {
  if (!g_several_inputs(type)) {
    for (int t = 0; t < nv; ++t) out[t] = ggml_row_dot(type, row, K, v[t]);
    return;
  }
  g_for_inputs(nv, [&](auto k) { ggml_rows_nv<decltype(k)::value>(type, row, K, v, out); });
}

const BlockRowDotFn kAvx2GgmlDot = ggml_row_dot;
const BlockRowDotsFn kAvx2GgmlDots = ggml_row_dots;
}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target region: runs on any CPU (it only reads a table of addresses).
namespace psr::cpu {
BlockRowDotFn avx2_ggml_dot() { return kAvx2GgmlDot; }
BlockRowDotsFn avx2_ggml_dots() { return kAvx2GgmlDots; }
DotsFn avx2_dots(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 5 ? kAvx2SeveralDots[i] : nullptr;
}
DotFn avx2_dot(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 6 ? kAvx2Dots[i] : nullptr;
}
ExpFn avx2_exp() { return kAvx2Exp; }
WsumFn avx2_wsum(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 3 ? kAvx2Wsum[i] : nullptr;
}
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
DotFn avx2_dot(Fmt) { return nullptr; }
BlockRowDotFn avx2_ggml_dot() { return nullptr; }
BlockRowDotsFn avx2_ggml_dots() { return nullptr; }
DotsFn avx2_dots(Fmt) { return nullptr; }
WsumFn avx2_wsum(Fmt) { return nullptr; }
ExpFn avx2_exp() { return nullptr; }
}  // namespace psr::cpu

#endif
