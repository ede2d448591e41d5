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

}  // namespace

const GroupDotFn kAvx512Int4Groups = dot4_int4_groups;

// Instantiated here, inside the target region; indexed by Fmt.
const DotFn kAvx512Dots[6] = {dot4<LoadF32>, dot4<LoadBF16>, dot4<LoadF16>,
                              dot4<LoadI8>,  dot4<LoadFP8>,  dot4_int4};

const BlockRowDotFn kAvx512GgmlDot = g_row_dot;
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
