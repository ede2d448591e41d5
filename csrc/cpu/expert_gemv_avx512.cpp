// AVX-512 (F, BW, VL) row kernels of the CPU expert FFN. Compiled for that target with a
// pragma (this file only: no standard-library code is instantiated here), called only
// after run-time detection (supported_isas). Sixteen lanes per row; tails by masked loads,
// which never touch the bytes they mask out.
#include <immintrin.h>

#include <cstdint>

#include "expert_gemv.h"

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

template <class Load>
void dot4(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // whole chunks: plain loads (folded into the widening)
    const __m512 x = _mm512_loadu_ps(v + i);
    a0 = _mm512_fmadd_ps(Load::full(w[0], i), x, a0);
    a1 = _mm512_fmadd_ps(Load::full(w[1], i), x, a1);
    a2 = _mm512_fmadd_ps(Load::full(w[2], i), x, a2);
    a3 = _mm512_fmadd_ps(Load::full(w[3], i), x, a3);
  }
  if (i < n) {  // the tail: masked loads touch nothing past the row
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
    a0 = _mm512_fmadd_ps(Load::at(w[0], i, m), x, a0);
    a1 = _mm512_fmadd_ps(Load::at(w[1], i, m), x, a1);
    a2 = _mm512_fmadd_ps(Load::at(w[2], i, m), x, a2);
    a3 = _mm512_fmadd_ps(Load::at(w[3], i, m), x, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0) * Load::kScale;  // a power of two: exact
  out[1] = _mm512_reduce_add_ps(a1) * Load::kScale;
  out[2] = _mm512_reduce_add_ps(a2) * Load::kScale;
  out[3] = _mm512_reduce_add_ps(a3) * Load::kScale;
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
// fp32 FMAs into two accumulators of sixteen lanes, summed once at the row's end. Every
// load stays inside its block (rows are whole blocks: checked by the caller).
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

// Q4_K / Q5_K: eight sub-blocks of 32 with 6-bit scales and mins: w = d * sc * q - dmin * m.
void kquant45(bool q5, const uint8_t* b, const float* v, __m512& a0, __m512& a1) {
  const float d = g_h2f(b), dmin = g_h2f(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (q5 ? 48 : 16);
  const __m512i k16 = _mm512_set1_epi32(16), m4 = _mm512_set1_epi32(0xF);
  for (int j = 0; j < 4; ++j) {
    int s1, m1, s2, m2;
    g_k_scale_min(2 * j, sc, &s1, &m1);
    g_k_scale_min(2 * j + 1, sc, &s2, &m2);
    const float d1 = d * static_cast<float>(s1), c1 = -(dmin * static_cast<float>(m1));
    const float d2 = d * static_cast<float>(s2), c2 = -(dmin * static_cast<float>(m2));
    const __m512 l1 = lut(d1, c1), l2 = lut(d2, c2);
    for (int hh = 0; hh < 2; ++hh) {
      const __m512i bq = widen16(qs + 32 * j + 16 * hh);
      const float* v0 = v + 64 * j + 16 * hh;
      __m512i lo = _mm512_and_si512(bq, m4), hi = _mm512_srli_epi32(bq, 4);
      if (q5) {
        const __m512i bh = widen16(qh + 16 * hh);
        const __mmask16 f0 = _mm512_test_epi32_mask(bh, _mm512_set1_epi32(1 << (2 * j)));
        const __mmask16 f1 = _mm512_test_epi32_mask(bh, _mm512_set1_epi32(2 << (2 * j)));
        lo = _mm512_mask_add_epi32(lo, f0, lo, k16);
        hi = _mm512_mask_add_epi32(hi, f1, hi, k16);
        a0 = _mm512_fmadd_ps(_mm512_permutex2var_ps(l1, lo, lut_hi(d1, c1)), ldv(v0), a0);
        a1 = _mm512_fmadd_ps(_mm512_permutex2var_ps(l2, hi, lut_hi(d2, c2)), ldv(v0 + 32), a1);
      } else {
        a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, l1), ldv(v0), a0);
        a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, l2), ldv(v0 + 32), a1);
      }
    }
  }
}

// Q6_K: 6-bit codes (4 low bits in ql, 2 high in qh) minus 32, a scale per 16 elements.
void kquant6(const uint8_t* b, const float* v, __m512& a0, __m512& a1) {
  const float d = g_h2f(b + 208);
  const __m512i m4 = _mm512_set1_epi32(0xF), m3 = _mm512_set1_epi32(3);
  const __m512i k32 = _mm512_set1_epi32(32);
  for (int n = 0; n < 2; ++n) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * n);
    for (int g = 0; g < 4; ++g) {
      const uint8_t* ql = b + 64 * n + 32 * (g & 1);
      const __m128i shift = _mm_cvtsi32_si128(g < 2 ? 0 : 4);
      const __m128i hshift = _mm_cvtsi32_si128(2 * g);
      for (int hh = 0; hh < 2; ++hh) {
        const __m512i l4 = _mm512_and_si512(_mm512_srl_epi32(widen16(ql + 16 * hh), shift), m4);
        const __m512i h2 =
            _mm512_and_si512(_mm512_srl_epi32(widen16(b + 128 + 32 * n + 16 * hh), hshift), m3);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(l4, _mm512_slli_epi32(h2, 4)), k32);
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q),
                                       _mm512_set1_ps(d * static_cast<float>(sc[2 * g + hh])));
        const float* v0 = v + 128 * n + 32 * g + 16 * hh;
        if (hh == 0) {
          a0 = _mm512_fmadd_ps(w, ldv(v0), a0);
        } else {
          a1 = _mm512_fmadd_ps(w, ldv(v0), a1);
        }
      }
    }
  }
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

float ggml_row_dot(int type, const uint8_t* row, int64_t K, const float* v) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  switch (type) {
    case 0:
      return float_row<LoadF32>(row, K, v);
    case 1:
      return float_row<LoadF16>(row, K, v);
    case 30:
      return float_row<LoadBF16>(row, K, v);
    case 8:  // Q8_0: the block's partial dot, scaled once
      for (int64_t k = 0; k < K; k += 32, row += 34) {
        const __m512 q0 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2))));
        const __m512 q1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18))));
        const __m512 p = _mm512_fmadd_ps(q1, ldv(v + k + 16), _mm512_mul_ps(q0, ldv(v + k)));
        a0 = _mm512_fmadd_ps(p, _mm512_set1_ps(g_h2f(row)), a0);
      }
      break;
    case 2:
    case 3:  // Q4_0: d (q - 8); Q4_1: d q + m
      for (int64_t k = 0; k < K; k += 32, row += type == 2 ? 18 : 20) {
        const float d = g_h2f(row);
        const __m512 t = type == 2 ? lut(d, -8.f * d) : lut(d, g_h2f(row + 2));
        nib_block(row + (type == 2 ? 2 : 4), t, v + k, a0, a1);
      }
      break;
    case 6:
    case 7:  // Q5_0: d (q - 16); Q5_1: d q + m
      for (int64_t k = 0; k < K; k += 32, row += type == 6 ? 22 : 24) {
        const float d = g_h2f(row), m = type == 6 ? -16.f * d : g_h2f(row + 2);
        const uint8_t* hp = row + (type == 6 ? 2 : 4);
        uint32_t qh;
        __builtin_memcpy(&qh, hp, 4);
        nib5_block(hp + 4, qh, lut(d, m), lut_hi(d, m), v + k, a0, a1);
      }
      break;
    case 39:  // MXFP4: the FP4 values times the block's power of two
      for (int64_t k = 0; k < K; k += 32, row += 17) {
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(kFp4), _mm512_set1_ps(g_e8m0(row[0])));
        nib_block(row + 1, t, v + k, a0, a1);
      }
      break;
    case 12:
    case 13:
      for (int64_t k = 0; k < K; k += 256, row += type == 12 ? 144 : 176)
        kquant45(type == 13, row, v + k, a0, a1);
      break;
    case 14:
      for (int64_t k = 0; k < K; k += 256, row += 210) kquant6(row, v + k, a0, a1);
      break;
    case 200:  // FP8_B128: codes / 256 dotted per block, times the block's scale, then * 256
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

const BlockRowDotFn kAvx512GgmlDot = ggml_row_dot;
}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target region: runs on any CPU (it only reads a table of addresses).
namespace psr::cpu {
BlockRowDotFn avx512_ggml_dot() { return kAvx512GgmlDot; }
DotFn avx512_dot(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 6 ? kAvx512Dots[i] : nullptr;
}
GroupDotFn avx512_int4_groups() { return kAvx512Int4Groups; }
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
DotFn avx512_dot(Fmt) { return nullptr; }
BlockRowDotFn avx512_ggml_dot() { return nullptr; }
GroupDotFn avx512_int4_groups() { return nullptr; }
}  // namespace psr::cpu

#endif
