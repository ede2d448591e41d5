// AVX-512 (F, BW, VL) row kernels of the CPU expert FFN. Compiled for that target with a
// pragma (this file only: no standard-library code is instantiated here), called only
// after run-time detection (supported_isas). Sixteen lanes per row; tails by masked loads,
// which never touch the bytes they mask out.
#include <immintrin.h>

#include <cstdint>

#include "expert_gemv.h"
#include "prefetch.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif

// GGML block rows, compiled (and auto-vectorised) for this target.
#define PSR_GGML_F16C 1
#include "ggml_dot.h"

namespace psr::cpu {
namespace {

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// e4m3fn codes to fp32 / 256, exactly: each code shifted into an fp16 (sign, then the
// 4-bit exponent and 3-bit mantissa at fp16's 5-bit exponent and mantissa top, so its value
// is the code's times 2^-8, subnormals included) and widened by the F16C conversion;
// codes 0x7F / 0xFF (e4m3fn's NaNs) become NaN. The row kernel multiplies by 256 once.
inline __m512 fp8_to_f32_div256(__m128i c) {
  const __m256i w = _mm256_cvtepi8_epi16(c);  // sign copied into bits 8..15
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(-16385));
  const __m512 f = _mm512_cvtph_ps(h);  // -16385 = 0xBFFF: clears bit 14 (a sign copy)
  const __mmask16 nan =
      _mm_cmpeq_epi8_mask(_mm_and_si128(c, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(__builtin_nanf("")));
}

struct LoadF32 {
  static constexpr float kScale = 1.f;
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + i);
  }
  static __m512 full(const uint8_t* p, int64_t i) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
  }
};
struct LoadBF16 {
  static constexpr float kScale = 1.f;
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    const __m256i b = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  static __m512 full(const uint8_t* p, int64_t i) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
};
struct LoadF16 {
  static constexpr float kScale = 1.f;
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i));
  }
  static __m512 full(const uint8_t* p, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i)));
  }
};
struct LoadI8 {
  static constexpr float kScale = 1.f;
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p + i)));
  }
  static __m512 full(const uint8_t* p, int64_t i) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  }
};
struct LoadFP8 {  // the codes' values / 256 (dot4 scales the sums back)
  static constexpr float kScale = 256.f;
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return fp8_to_f32_div256(_mm_maskz_loadu_epi8(m, p + i));
  }
  static __m512 full(const uint8_t* p, int64_t i) {
    return fp8_to_f32_div256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
  }
};

// Four rows against NV inputs (each row chunk loaded and widened once for all of them):
// out[4 t + r]. Input t's accumulators see the same operations in the same order as at
// NV = 1 (dot4, the one-input kernel), so the same bits.
template <class Load, int NV>
void dot4_nv(const uint8_t* const w[4], int64_t n, const float* const* v, float* out) {
  __m512 a[NV][4];
  for (int t = 0; t < NV; ++t)
    for (int r = 0; r < 4; ++r) a[t][r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // whole chunks: plain loads (folded into the widening)
    const __m512 w0 = Load::full(w[0], i), w1 = Load::full(w[1], i);
    const __m512 w2 = Load::full(w[2], i), w3 = Load::full(w[3], i);
    for (int t = 0; t < NV; ++t) {
      const __m512 x = _mm512_loadu_ps(v[t] + i);
      a[t][0] = _mm512_fmadd_ps(w0, x, a[t][0]);
      a[t][1] = _mm512_fmadd_ps(w1, x, a[t][1]);
      a[t][2] = _mm512_fmadd_ps(w2, x, a[t][2]);
      a[t][3] = _mm512_fmadd_ps(w3, x, a[t][3]);
    }
  }
  if (i < n) {  // the tail: masked loads touch nothing past the row
    const __mmask16 m = tail_mask(n - i);
    const __m512 w0 = Load::at(w[0], i, m), w1 = Load::at(w[1], i, m);
    const __m512 w2 = Load::at(w[2], i, m), w3 = Load::at(w[3], i, m);
    for (int t = 0; t < NV; ++t) {
      const __m512 x = _mm512_maskz_loadu_ps(m, v[t] + i);
      a[t][0] = _mm512_fmadd_ps(w0, x, a[t][0]);
      a[t][1] = _mm512_fmadd_ps(w1, x, a[t][1]);
      a[t][2] = _mm512_fmadd_ps(w2, x, a[t][2]);
      a[t][3] = _mm512_fmadd_ps(w3, x, a[t][3]);
    }
  }
  for (int t = 0; t < NV; ++t)
    for (int r = 0; r < 4; ++r)
      out[4 * t + r] = _mm512_reduce_add_ps(a[t][r]) * Load::kScale;  // a power of two: exact
}

template <class Load>
void dot4(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  dot4_nv<Load, 1>(w, n, &v, out);
}

template <class Load>
void dots4(const uint8_t* const w[4], int64_t n, const float* const* v, int nv, float* out) {
  g_for_inputs(nv, [&](auto k) { dot4_nv<Load, decltype(k)::value>(w, n, v, out); });
}

// Attention's weighted V sum (WsumFn): 64 output columns (four vectors) at a time for NH
// heads, the accumulators in registers across the keys; the last block masked.
template <class Load, int NH, bool kFull>
void wsum_block(const uint8_t* v, int64_t vs, int64_t n, int64_t e0, int64_t dv, const float* a,
                int64_t as, float* out, int64_t os, bool resume) {
  __mmask16 m[4];
  for (int c = 0; c < 4; ++c) m[c] = e0 + 16 * c < dv ? tail_mask(dv - e0 - 16 * c) : 0;
  __m512 acc[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 4; ++c)
      acc[h][c] =
          resume ? _mm512_maskz_loadu_ps(m[c], out + h * os + e0 + 16 * c) : _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* vj = v + j * vs;
    __m512 x[4];
    for (int c = 0; c < 4; ++c)
      x[c] = kFull ? Load::full(vj, e0 + 16 * c) : Load::at(vj, e0 + 16 * c, m[c]);
    for (int h = 0; h < NH; ++h) {
      const __m512 b = _mm512_set1_ps(a[h * as + j]);
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_fmadd_ps(b, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + h * os + e0 + 16 * c, m[c], acc[h][c]);
}

template <class Load, int NH>
void wsum_nh(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as,
             float* out, int64_t os, bool resume) {
  int64_t e0 = 0;
  for (; e0 + 64 <= dv; e0 += 64)
    wsum_block<Load, NH, true>(v, vs, n, e0, dv, a, as, out, os, resume);
  if (e0 < dv) wsum_block<Load, NH, false>(v, vs, n, e0, dv, a, as, out, os, resume);
}

template <class Load>
void wsum(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a, int64_t as, int na,
          float* out, int64_t os, bool resume) {
  g_for_inputs(
      na, [&](auto k) { wsum_nh<Load, decltype(k)::value>(v, vs, n, dv, a, as, out, os, resume); });
}

// exp(x - m) on 16 lanes: expert_gemv.h's kExp* polynomial (about 1 ulp), 2^k by scalef.
inline __m512 exp16(__m512 x) {
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, fx));
}

void exp_minus(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
  }
}

// int4: 16 bytes = 32 elements per step; low nibbles times v (even elements), high times v2.
// A nibble becomes its signed value by one in-register table lookup (vpermps reads the low
// four bits of each lane): no masking, sign extension or int -> float conversion.
inline __m512 nib_fma(const uint8_t* p, int64_t i, __mmask16 m, __m512 ve, __m512 vo, __m512 a,
                      __m512 lut) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p + i));
  a = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, lut), ve, a);
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), vo, a);
}

void dot4_int4(const uint8_t* const w[4], int64_t n, const float* v, const float* v2,
               float out[4]) {
  // lut[n] = the signed value of nibble n: 0..7, then -8..-1.
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 ve = _mm512_maskz_loadu_ps(m, v + i), vo = _mm512_maskz_loadu_ps(m, v2 + i);
    a0 = nib_fma(w[0], i, m, ve, vo, a0, lut);
    a1 = nib_fma(w[1], i, m, ve, vo, a1, lut);
    a2 = nib_fma(w[2], i, m, ve, vo, a2, lut);
    a3 = nib_fma(w[3], i, m, ve, vo, a3, lut);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}

// Scale groups of gbytes bytes: each group's sum stays in lanes and is scaled there.
void dot4_int4_groups(const uint8_t* const w[4], int64_t ng, int64_t gbytes, const float* v,
                      const float* v2, const float* const s[4], float out[4]) {
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t g = 0; g < ng; ++g) {
    __m512 g0 = _mm512_setzero_ps(), g1 = g0, g2 = g0, g3 = g0;
    const int64_t at = g * gbytes;
    for (int64_t i = 0; i < gbytes; i += 16) {
      const __mmask16 m = tail_mask(gbytes - i);
      const __m512 ve = _mm512_maskz_loadu_ps(m, v + at + i);
      const __m512 vo = _mm512_maskz_loadu_ps(m, v2 + at + i);
      g0 = nib_fma(w[0] + at, i, m, ve, vo, g0, lut);
      g1 = nib_fma(w[1] + at, i, m, ve, vo, g1, lut);
      g2 = nib_fma(w[2] + at, i, m, ve, vo, g2, lut);
      g3 = nib_fma(w[3] + at, i, m, ve, vo, g3, lut);
    }
    float sc[4];
    for (int r = 0; r < 4; ++r) __builtin_memcpy(&sc[r], s[r] + g, 4);
    a0 = _mm512_fmadd_ps(g0, _mm512_set1_ps(sc[0]), a0);
    a1 = _mm512_fmadd_ps(g1, _mm512_set1_ps(sc[1]), a1);
    a2 = _mm512_fmadd_ps(g2, _mm512_set1_ps(sc[2]), a2);
    a3 = _mm512_fmadd_ps(g3, _mm512_set1_ps(sc[3]), a3);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}

// GGML block rows straight into registers (no scratch): a block's codes are widened into
// 32-bit lanes and become weights by one in-register table lookup over the block's 16
// (vpermps) or 32 (vpermt2ps) possible values, the table built from the block's scales
// (d * q + m for every code q); Q8_0 / Q6_K / FP8 codes are converted and scaled instead.
// fp32 FMAs into two or four accumulators of sixteen lanes, summed once at the row's end.
// Every load stays inside its block (rows are whole blocks: checked by the caller); only
// prefetch hints (ahead) reach past it.
inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline __m512i widen16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 ldv(const float* v) { return _mm512_loadu_ps(v); }

// Q4_0 / Q4_1 / MXFP4: sixteen bytes, low nibbles elements 0..15, high 16..31, lut[q].
inline void nib_block(const uint8_t* qs, __m512 lut, const float* v, __m512& a0, __m512& a1) {
  const __m512i b = widen16(qs);
  a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, lut), ldv(v), a0);
  a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut), ldv(v + 16), a1);
}

// Q5_0 / Q5_1: the fifth bit of element i is bit i of qh; lut_lo[q], lut_hi[q - 16].
inline void nib5_block(const uint8_t* qs, uint32_t qh, __m512 lo, __m512 hi, const float* v,
                       __m512& a0, __m512& a1) {
  const __m512i b = widen16(qs), k16 = _mm512_set1_epi32(16), m4 = _mm512_set1_epi32(0xF);
  const __m512i i0 = _mm512_mask_add_epi32(
      _mm512_and_si512(b, m4), static_cast<__mmask16>(qh & 0xFFFF), _mm512_and_si512(b, m4), k16);
  const __m512i h4 = _mm512_srli_epi32(b, 4);
  const __m512i i1 = _mm512_mask_add_epi32(h4, static_cast<__mmask16>(qh >> 16), h4, k16);
  a0 = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, i0, hi), ldv(v), a0);
  a1 = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, i1, hi), ldv(v + 16), a1);
}

inline __m512 lut(float d, float m) {  // d * q + m for q = 0..15, one rounding each
  return _mm512_fmadd_ps(_mm512_set1_ps(d), iota16(), _mm512_set1_ps(m));
}
inline __m512 lut_hi(float d, float m) {  // d * q + m for q = 16..31
  return _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_add_ps(iota16(), _mm512_set1_ps(16.f)),
                         _mm512_set1_ps(m));
}

// Q4_K / Q5_K / Q6_K decode a super-block's scales once into a small float array (vector
// conversions, no per-sub-block scalar work), then read each scale by a broadcast from it (a
// load, no shuffle); they and Q4_0 keep four accumulators (the FMAs' latency hidden). 4-bit
// codes index the table without masking: vpermps reads only the index's low four bits
// (vpermt2ps: five).
inline __m512 bcast(const float* p) { return _mm512_set1_ps(*p); }

// Scales are stored to a small array and read back by broadcasts from memory (load-port
// work only); without this barrier the compiler turns those broadcasts into vpermd on the
// shuffle port, which is the one the codes' table lookups need.
template <class T, int N>
inline void in_memory(T (&a)[N]) {
  __asm__ volatile("" : "+m"(a));
}

// A Q4_K / Q5_K super-block's scales and mins interleaved, each times its factor:
// out[2 s] = d * sc_s, out[2 s + 1] = -(dmin * m_s) for the sub-blocks s = 0..7. The 12
// bytes at b + 4 hold them in 6 bits each: s < 4 the low six bits of bytes s (sc) and s + 4
// (m); s >= 4 the nibbles of byte s + 4 and the top two bits of bytes s - 4 (sc), s (m).
inline void k_scales_mins(const uint8_t* b, float out[16]) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // in the block
  const __m128i lo =
      _mm_shuffle_epi8(x, _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 8, 9, 9, 10, 10, 11, 11));
  const __m128i hi =
      _mm_shuffle_epi8(x, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 1, 5, 2, 6, 3, 7));
  const __m128i lo4 = _mm_mask_mov_epi8(lo, 0xAA00, _mm_srli_epi16(lo, 4));  // m_s, s >= 4
  const __m128i m = _mm_setr_epi8(63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15, 15, 15, 15, 15);
  // (A & B) | C = 0xEA: the low bits, then the top two at bits 4..5
  const __m128i q = _mm_ternarylogic_epi32(
      lo4, m, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)), 0xEA);
  uint32_t dm;
  __builtin_memcpy(&dm, b, 4);  // d, dmin (fp16)
  const __m512 f = _mm512_castsi512_ps(_mm512_xor_si512(
      _mm512_castps_si512(_mm512_cvtph_ps(_mm256_set1_epi32(static_cast<int>(dm)))),
      _mm512_set1_epi64(static_cast<int64_t>(0x8000000000000000ull))));
  _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), f));
}

// Q4_K / Q5_K: sub-block s's weights d * sc_s * q - dmin * m_s as a table over its codes.
// Each 16 weights go to sink(c, w): c the chunk (elements 16 c ..) within the block. Every
// user of a block's weights (the row dots below, the tiled GEMM's decode) is this code.
template <bool kQ5, class Sink>
void kquant45(const uint8_t* b, Sink&& sink) {
  alignas(64) float sm[16];  // d * sc_s, -(dmin * m_s) interleaved
  k_scales_mins(b, sm);
  in_memory(sm);
  const uint8_t* qs = b + (kQ5 ? 48 : 16);
  const __m512 io = iota16(), io16 = _mm512_add_ps(io, _mm512_set1_ps(16.f));
  const __m512i m4 = _mm512_set1_epi32(0xF);
  // Q5_K: hs[hh] bit 4 holds the fifth bit of sub-block 2j's element 16 hh + lane (qh bit 2j).
  __m512i hs[2] = {_mm512_slli_epi32(widen16(b + 16), 4), _mm512_slli_epi32(widen16(b + 32), 4)};
  for (int j = 0; j < 4; ++j) {
    const __m512 l1 = _mm512_fmadd_ps(bcast(sm + 4 * j), io, bcast(sm + 4 * j + 1));
    const __m512 l2 = _mm512_fmadd_ps(bcast(sm + 4 * j + 2), io, bcast(sm + 4 * j + 3));
    for (int hh = 0; hh < 2; ++hh) {
      const __m512i bq = widen16(qs + 32 * j + 16 * hh);
      const __m512i hi = _mm512_srli_epi32(bq, 4);
      __m512 w0, w1;
      if (kQ5) {  // bits 0..3 the code's, bit 4 the fifth bit (0xE4: select by m4)
        const __m512i i0 = _mm512_ternarylogic_epi32(bq, hs[hh], m4, 0xE4);
        const __m512i i1 = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi32(hs[hh], 1), m4, 0xE4);
        w0 = _mm512_permutex2var_ps(
            l1, i0, _mm512_fmadd_ps(bcast(sm + 4 * j), io16, bcast(sm + 4 * j + 1)));
        w1 = _mm512_permutex2var_ps(
            l2, i1, _mm512_fmadd_ps(bcast(sm + 4 * j + 2), io16, bcast(sm + 4 * j + 3)));
        hs[hh] = _mm512_srli_epi32(hs[hh], 2);
      } else {
        w0 = _mm512_permutexvar_ps(bq, l1);
        w1 = _mm512_permutexvar_ps(hi, l2);
      }
      sink(4 * j + hh, w0);
      sink(4 * j + 2 + hh, w1);
    }
  }
}

// Q6_K: 6-bit codes (4 low bits in ql, 2 high in qh) minus 32, a scale per 16 elements. The
// codes of 64 elements are assembled as bytes in one register, stored to the stack and
// widened 16 at a time by loads; each 16 weights go to sink(c, w) as kquant45's.
template <class Sink>
void kquant6(const uint8_t* b, Sink&& sink) {
  alignas(64) float s[16];  // d * sc[i], the scale of elements 16 i .. 16 i + 15
  _mm512_store_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
                                   _mm512_set1_ps(g_h2f(b + 208))));
  in_memory(s);
  alignas(64) int8_t q[256];  // the codes minus 32, in element order
  const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
  const __m512i k32 = _mm512_set1_epi8(32);
  for (int n = 0; n < 2; ++n) {
    const __m512i ql = _mm512_loadu_si512(b + 64 * n);  // elements 0..63's low bits, 64.. high
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    // qh2's bytes 0..31 hold elements 0..31's (and 64..95's) high bits at bits 0..1 (4..5),
    // bytes 32..63 those of 32..63 (96..127).
    const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    // (A & B) | C = 0xEA
    const __m512i c0 = _mm512_sub_epi8(
        _mm512_ternarylogic_epi32(ql, m4, _mm512_and_si512(_mm512_slli_epi16(qh2, 4), m30), 0xEA),
        k32);
    const __m512i c1 = _mm512_sub_epi8(
        _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4, _mm512_and_si512(qh2, m30), 0xEA),
        k32);
    _mm512_store_si512(q + 128 * n, c0);
    _mm512_store_si512(q + 128 * n + 64, c1);
  }
  in_memory(q);  // widened by loads (not extracts on the shuffle port)
  for (int i = 0; i < 16; ++i) {
    const __m512 w = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * i))));
    sink(i, _mm512_mul_ps(w, bcast(s + i)));
  }
}

// Q4_0: d (q - 8), the table one multiply of the block's scale (read from the block, so no
// block waits for another's bytes); two blocks a step into four accumulators.
inline __m512 f16_bcast(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
}
inline void q4_0_block(const uint8_t* blk, const float* vb, __m512 io8, __m512& a0, __m512& a1) {
  const __m512 t = _mm512_mul_ps(f16_bcast(blk), io8);  // d (q - 8): one rounding
  const __m512i q = widen16(blk + 2);
  a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, t), ldv(vb), a0);
  a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t), ldv(vb + 16), a1);
}
void q4_0_row(const uint8_t* row, int64_t K, const float* v, __m512 a[4]) {
  const int64_t nb = K / 32;
  const __m512 io8 = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f));
  int64_t i = 0;
  for (; i + 2 <= nb; i += 2) {
    ahead(row + i * 18, 1);  // 36 bytes a step: every line
    q4_0_block(row + i * 18, v + 32 * i, io8, a[0], a[1]);
    q4_0_block(row + (i + 1) * 18, v + 32 * (i + 1), io8, a[2], a[3]);
  }
  if (i < nb) q4_0_block(row + i * 18, v + 32 * i, io8, a[0], a[1]);
}

inline float sum4(const __m512 a[4]) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

template <class Load>
float float_row(const uint8_t* row, int64_t K, const float* v) {
  __m512 a0 = _mm512_setzero_ps();
  for (int64_t i = 0; i < K; i += 16) {
    const __mmask16 m = tail_mask(K - i);
    a0 = _mm512_fmadd_ps(Load::at(row, i, m), _mm512_maskz_loadu_ps(m, v + i), a0);
  }
  return _mm512_reduce_add_ps(a0);
}

// out[t] = the dot of one row of `type` (g_several_inputs) with each of NV inputs v[t].
template <int NV>
void ggml_rows_nv(int type, const uint8_t* row, int64_t K, const float* const* v, float* out) {
  __m512 a[NV][4];
  for (int t = 0; t < NV; ++t)
    for (int i = 0; i < 4; ++i) a[t][i] = _mm512_setzero_ps();
  const float* vk[NV];
  switch (type) {
    case ggml_type::Q8_0:  // the block's partial dot, scaled once; blocks alternate two
                           // accumulators
      for (int64_t k = 0; k < K; k += 32, row += 34) {
        ahead(row, 1);
        const __m512 q0 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2))));
        const __m512 q1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18))));
        const __m512 d = f16_bcast(row);
        for (int t = 0; t < NV; ++t) {
          const __m512 p =
              _mm512_fmadd_ps(q1, ldv(v[t] + k + 16), _mm512_mul_ps(q0, ldv(v[t] + k)));
          a[t][(k & 32) ? 1 : 0] = _mm512_fmadd_ps(p, d, a[t][(k & 32) ? 1 : 0]);
        }
      }
      for (int t = 0; t < NV; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a[t][0], a[t][1]));
      return;
    case ggml_type::Q4_K:
    case ggml_type::Q5_K:
      for (int64_t k = 0; k < K; k += 256, row += type == ggml_type::Q4_K ? 144 : 176) {
        ahead(row, 3);
        for (int t = 0; t < NV; ++t) vk[t] = v[t] + k;
        // chunk c of the block into accumulator c % 4 of each input (the tiled GEMM's
        // classes: ggml_gemm_avx512)
        auto acc = [&](int c, __m512 w) {
          for (int t = 0; t < NV; ++t)
            a[t][c % 4] = _mm512_fmadd_ps(w, ldv(vk[t] + 16 * c), a[t][c % 4]);
        };
        if (type == ggml_type::Q4_K) {
          kquant45<false>(row, acc);
        } else {
          kquant45<true>(row, acc);
        }
      }
      break;
    case ggml_type::Q6_K:
      for (int64_t k = 0; k < K; k += 256, row += 210) {
        ahead(row, 4);
        for (int t = 0; t < NV; ++t) vk[t] = v[t] + k;
        kquant6(row, [&](int c, __m512 w) {
          for (int t = 0; t < NV; ++t)
            a[t][c % 4] = _mm512_fmadd_ps(w, ldv(vk[t] + 16 * c), a[t][c % 4]);
        });
      }
      break;
    default:
      break;  // not g_several_inputs: never called
  }
  for (int t = 0; t < NV; ++t) out[t] = sum4(a[t]);
}

// --- the tiled GEMM of GGML rows (BlockGemmFn) -----------------------------------------
// Each row's blocks are decoded once per tile of kGemmTokens inputs into fp32 scratch (the
// row dots' own decoders: kquant45 / kquant6's sinks, Q8_0's widened codes and scale), then
// 4 rows x 4 inputs a step. The row dot keeps four accumulators (K-quants: chunk c of 16
// weights into accumulator c % 4; Q8_0: two, by block parity) that each add their chunks in
// row order; here each such class is one pass over the row, in the same order, with the
// same operations: every output is the row dot's bits.
constexpr int64_t kGemmTokens = 64;  // inputs per tile: their vectors stay in L2

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// Q4_K / Q5_K / Q6_K: o[4 t + r] = the dot of decoded row r (W + r K) with x[t].
inline void tile_kquant(const float* W, int64_t K, const float* const x[4], float o[16]) {
  alignas(64) float cls[4][16][16];  // class q's partial sums of output i
  const int64_t nc = K / 16;
  for (int q = 0; q < 4; ++q) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t c = q; c < nc; c += 4) {
      const __m512 w0 = ldv(W + 16 * c), w1 = ldv(W + K + 16 * c);
      const __m512 w2 = ldv(W + 2 * K + 16 * c), w3 = ldv(W + 3 * K + 16 * c);
      for (int t = 0; t < 4; ++t) {
        const __m512 v = ldv(x[t] + 16 * c);
        a[4 * t] = _mm512_fmadd_ps(w0, v, a[4 * t]);
        a[4 * t + 1] = _mm512_fmadd_ps(w1, v, a[4 * t + 1]);
        a[4 * t + 2] = _mm512_fmadd_ps(w2, v, a[4 * t + 2]);
        a[4 * t + 3] = _mm512_fmadd_ps(w3, v, a[4 * t + 3]);
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(cls[q][i], a[i]);
  }
  for (int i = 0; i < 16; ++i) {
    const __m512 a[4] = {_mm512_load_ps(cls[0][i]), _mm512_load_ps(cls[1][i]),
                         _mm512_load_ps(cls[2][i]), _mm512_load_ps(cls[3][i])};
    o[i] = sum4(a);
  }
}

// Q8_0: codes as floats (W), each block's scale (D, K / 32 a row): per block the partial
// dot q0 v0 + q1 v1, then times the scale into the accumulator of the block's parity.
inline void tile_q8_0(const float* W, const float* D, int64_t K, const float* const x[4],
                      float o[16]) {
  alignas(64) float cls[2][16][16];
  const int64_t nb = K / 32;
  for (int q = 0; q < 2; ++q) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t b = q; b < nb; b += 2) {
      __m512 q0[4], q1[4], d[4];
      for (int r = 0; r < 4; ++r) {
        q0[r] = ldv(W + r * K + 32 * b);
        q1[r] = ldv(W + r * K + 32 * b + 16);
        d[r] = bcast(D + r * nb + b);
      }
      for (int t = 0; t < 4; ++t) {
        const __m512 v0 = ldv(x[t] + 32 * b), v1 = ldv(x[t] + 32 * b + 16);
        for (int r = 0; r < 4; ++r) {
          const __m512 p = _mm512_fmadd_ps(q1[r], v1, _mm512_mul_ps(q0[r], v0));
          a[4 * t + r] = _mm512_fmadd_ps(p, d[r], a[4 * t + r]);
        }
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(cls[q][i], a[i]);
  }
  for (int i = 0; i < 16; ++i)
    o[i] =
        _mm512_reduce_add_ps(_mm512_add_ps(_mm512_load_ps(cls[0][i]), _mm512_load_ps(cls[1][i])));
}

// Rows rows[0..3] of `type` into W (K floats a row) and, Q8_0, D (K / 32 scales a row).
void tile_decode(int type, const uint8_t* const rows[4], int64_t K, float* W, float* D) {
  for (int r = 0; r < 4; ++r) {
    const uint8_t* row = rows[r];
    float* o = W + r * K;
    switch (type) {
      case ggml_type::Q8_0:
        for (int64_t b = 0; b < K / 32; ++b, row += 34) {
          for (int h = 0; h < 2; ++h)
            _mm512_storeu_ps(o + 32 * b + 16 * h,
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(row + 2 + 16 * h)))));
          D[r * (K / 32) + b] = _mm512_cvtss_f32(f16_bcast(row));
        }
        break;
      case ggml_type::Q4_K:
      case ggml_type::Q5_K:
      case ggml_type::Q6_K: {
        const int64_t bs = type == ggml_type::Q4_K ? 144 : type == ggml_type::Q5_K ? 176 : 210;
        for (int64_t k = 0; k < K; k += 256, row += bs) {
          auto put = [&](int c, __m512 w) { _mm512_storeu_ps(o + k + 16 * c, w); };
          if (type == ggml_type::Q4_K) {
            kquant45<false>(row, put);
          } else if (type == ggml_type::Q5_K) {
            kquant45<true>(row, put);
          } else {
            kquant6(row, put);
          }
        }
        break;
      }
      default:
        break;  // not g_several_inputs: never called
    }
  }
}

void ggml_gemm(int type, const uint8_t* w, int64_t stride, int64_t K, int64_t nr,
               const float* const* v, int64_t nv, float* const* out, float* scratch) {
  float* W = scratch;
  float* D = scratch + 4 * K;
  for (int64_t t0 = 0; t0 < nv; t0 += kGemmTokens) {
    const int64_t t1 = lesser(nv, t0 + kGemmTokens);
    for (int64_t r0 = 0; r0 < nr; r0 += 4) {
      const uint8_t* rows[4];
      for (int r = 0; r < 4; ++r) rows[r] = w + lesser(r0 + r, nr - 1) * stride;  // repeats
      tile_decode(type, rows, K, W, D);
      const int64_t rn = lesser(4, nr - r0);
      for (int64_t u0 = t0; u0 < t1; u0 += 4) {
        const float* x[4];
        for (int t = 0; t < 4; ++t) x[t] = v[lesser(u0 + t, t1 - 1)];  // repeats
        float o[16];
        if (type == ggml_type::Q8_0) {
          tile_q8_0(W, D, K, x, o);
        } else {
          tile_kquant(W, K, x, o);
        }
        for (int64_t t = 0; t < lesser(4, t1 - u0); ++t)
          for (int64_t r = 0; r < rn; ++r) out[u0 + t][r0 + r] = o[4 * t + r];
      }
    }
  }
}

float ggml_row_dot(int type, const uint8_t* row, int64_t K, const float* v) {
  if (g_several_inputs(type)) {  // the same code as several inputs take: the same bits
    float out;
    ggml_rows_nv<1>(type, row, K, &v, &out);
    return out;
  }
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  __m512 a[4] = {a0, a0, a0, a0};
  switch (type) {
    case ggml_type::F32:
      return float_row<LoadF32>(row, K, v);
    case ggml_type::F16:
      return float_row<LoadF16>(row, K, v);
    case ggml_type::BF16:
      return float_row<LoadBF16>(row, K, v);
    case ggml_type::Q4_0:
      q4_0_row(row, K, v, a);
      return sum4(a);
    case ggml_type::Q4_1:  // d q + m
      for (int64_t k = 0; k < K; k += 32, row += 20)
        nib_block(row + 4, lut(g_h2f(row), g_h2f(row + 2)), v + k, a0, a1);
      break;
    case ggml_type::Q5_0:
    case ggml_type::Q5_1:  // Q5_0: d (q - 16); Q5_1: d q + m
      for (int64_t k = 0; k < K; k += 32, row += type == ggml_type::Q5_0 ? 22 : 24) {
        const float d = g_h2f(row), m = type == ggml_type::Q5_0 ? -16.f * d : g_h2f(row + 2);
        const uint8_t* hp = row + (type == ggml_type::Q5_0 ? 2 : 4);
        uint32_t qh;
        __builtin_memcpy(&qh, hp, 4);
        nib5_block(hp + 4, qh, lut(d, m), lut_hi(d, m), v + k, a0, a1);
      }
      break;
    case ggml_type::MXFP4:  // the FP4 values times the block's power of two
      for (int64_t k = 0; k < K; k += 32, row += 17) {
        ahead(row, 1);
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(kFp4), _mm512_set1_ps(g_e8m0(row[0])));
        nib_block(row + 1, t, v + k, a0, a1);
      }
      break;
    case ggml_type::FP8_B128:  // codes / 256 dotted per block, times the block's scale, then * 256
      for (int64_t k = 0; k < K; k += 128, row += 132) {
        float s;
        __builtin_memcpy(&s, row, 4);
        __m512 p = _mm512_setzero_ps();
        for (int i = 0; i < 128; i += 16)
          p = _mm512_fmadd_ps(
              fp8_to_f32_div256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4 + i))),
              ldv(v + k + i), p);
        a0 = _mm512_fmadd_ps(p, _mm512_set1_ps(s), a0);
      }
      return _mm512_reduce_add_ps(a0) * 256.f;
    default:
      return g_row_dot(type, row, K, v);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
}  // namespace

const GroupDotFn kAvx512Int4Groups = dot4_int4_groups;

// Instantiated here, inside the target region; indexed by Fmt.
const DotFn kAvx512Dots[6] = {dot4<LoadF32>, dot4<LoadBF16>, dot4<LoadF16>,
                              dot4<LoadI8>,  dot4<LoadFP8>,  dot4_int4};
const DotsFn kAvx512SeveralDots[5] = {dots4<LoadF32>, dots4<LoadBF16>, dots4<LoadF16>,
                                      dots4<LoadI8>, dots4<LoadFP8>};
const WsumFn kAvx512Wsum[3] = {wsum<LoadF32>, wsum<LoadBF16>, wsum<LoadF16>};
const ExpFn kAvx512Exp = exp_minus;

static void ggml_row_dots(int type, const uint8_t* row, int64_t K, const float* const* v, int nv,
                          float* out) {
  if (!g_several_inputs(type)) {
    for (int t = 0; t < nv; ++t) out[t] = ggml_row_dot(type, row, K, v[t]);
    return;
  }
  g_for_inputs(nv, [&](auto k) { ggml_rows_nv<decltype(k)::value>(type, row, K, v, out); });
}

const BlockRowDotFn kAvx512GgmlDot = ggml_row_dot;
const BlockRowDotsFn kAvx512GgmlDots = ggml_row_dots;
const BlockGemmFn kAvx512GgmlGemm = ggml_gemm;
}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target region: runs on any CPU (it only reads a table of addresses).
namespace psr::cpu {
BlockRowDotFn avx512_ggml_dot() { return kAvx512GgmlDot; }
BlockRowDotsFn avx512_ggml_dots() { return kAvx512GgmlDots; }
BlockGemmFn avx512_ggml_gemm() { return kAvx512GgmlGemm; }
DotFn avx512_dot(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 6 ? kAvx512Dots[i] : nullptr;
}
GroupDotFn avx512_int4_groups() { return kAvx512Int4Groups; }
DotsFn avx512_dots(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 5 ? kAvx512SeveralDots[i] : nullptr;
}
ExpFn avx512_exp() { return kAvx512Exp; }
WsumFn avx512_wsum(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 3 ? kAvx512Wsum[i] : nullptr;
}
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
DotFn avx512_dot(Fmt) { return nullptr; }
BlockRowDotFn avx512_ggml_dot() { return nullptr; }
BlockRowDotsFn avx512_ggml_dots() { return nullptr; }
BlockGemmFn avx512_ggml_gemm() { return nullptr; }
GroupDotFn avx512_int4_groups() { return nullptr; }
DotsFn avx512_dots(Fmt) { return nullptr; }
WsumFn avx512_wsum(Fmt) { return nullptr; }
ExpFn avx512_exp() { return nullptr; }
}  // namespace psr::cpu

#endif
