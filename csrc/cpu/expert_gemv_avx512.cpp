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

namespace psr::cpu {
namespace {

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// e4m3fn codes (int32 lanes) to fp32, by integer arithmetic.
inline __m512 fp8_to_f32(__m512i c) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(0xF));
  const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
  const __m512i mag7 = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag7, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f));
  __m512 mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                    _mm512_castsi512_ps(normal), sub);
  mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag7, _mm512_set1_epi32(0x7F)), mag,
                             _mm512_set1_ps(__builtin_nanf("")));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

struct LoadF32 {
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + i);
  }
};
struct LoadBF16 {
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    const __m256i b = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
};
struct LoadF16 {
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i));
  }
};
struct LoadI8 {
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p + i)));
  }
};
struct LoadFP8 {
  static __m512 at(const uint8_t* p, int64_t i, __mmask16 m) {
    return fp8_to_f32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p + i)));
  }
};

template <class Load>
void dot4(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
    a0 = _mm512_fmadd_ps(Load::at(w[0], i, m), x, a0);
    a1 = _mm512_fmadd_ps(Load::at(w[1], i, m), x, a1);
    a2 = _mm512_fmadd_ps(Load::at(w[2], i, m), x, a2);
    a3 = _mm512_fmadd_ps(Load::at(w[3], i, m), x, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}

// int4: 16 bytes = 32 elements per step; low nibbles times v (even elements), high times v2.
inline __m512 nib_fma(const uint8_t* p, int64_t i, __mmask16 m, __m512 ve, __m512 vo, __m512 a) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p + i));
  const __m512i k8 = _mm512_set1_epi32(8);
  const __m512i lo =
      _mm512_sub_epi32(_mm512_xor_si512(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), k8), k8);
  const __m512i hi = _mm512_sub_epi32(_mm512_xor_si512(_mm512_srli_epi32(b, 4), k8), k8);
  a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), ve, a);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), vo, a);
}

void dot4_int4(const uint8_t* const w[4], int64_t n, const float* v, const float* v2,
               float out[4]) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 ve = _mm512_maskz_loadu_ps(m, v + i), vo = _mm512_maskz_loadu_ps(m, v2 + i);
    a0 = nib_fma(w[0], i, m, ve, vo, a0);
    a1 = nib_fma(w[1], i, m, ve, vo, a1);
    a2 = nib_fma(w[2], i, m, ve, vo, a2);
    a3 = nib_fma(w[3], i, m, ve, vo, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}

}  // namespace

// Instantiated here, inside the target region; indexed by Fmt.
const DotFn kAvx512Dots[6] = {dot4<LoadF32>, dot4<LoadBF16>, dot4<LoadF16>,
                              dot4<LoadI8>,  dot4<LoadFP8>,  dot4_int4};

}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target region: runs on any CPU (it only reads a table of addresses).
namespace psr::cpu {
DotFn avx512_dot(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 6 ? kAvx512Dots[i] : nullptr;
}
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
DotFn avx512_dot(Fmt) { return nullptr; }
}  // namespace psr::cpu

#endif
