// AVX2 + FMA + F16C row kernels of the CPU expert FFN. Compiled for that target with a
// pragma (this file only: no standard-library code is instantiated here), called only
// after run-time detection (supported_isas). Eight lanes per row over whole chunks, then
// the tail element by element (never a load past the row), added after the lanes' sum.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "expert_gemv.h"

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

template <class W>
void dot4(const uint8_t* const w[4], int64_t n, const float* v, const float*, float out[4]) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    a0 = _mm256_fmadd_ps(W::vec(w[0], i), x, a0);
    a1 = _mm256_fmadd_ps(W::vec(w[1], i), x, a1);
    a2 = _mm256_fmadd_ps(W::vec(w[2], i), x, a2);
    a3 = _mm256_fmadd_ps(W::vec(w[3], i), x, a3);
  }
  const __m256 a[4] = {a0, a1, a2, a3};
  for (int r = 0; r < 4; ++r) {
    float s = hsum(a[r]);
    for (int64_t j = i; j < n; ++j) s += W::one(w[r], j) * v[j];
    out[r] = s;
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

}  // namespace

// Instantiated here, inside the target region; indexed by Fmt.
const DotFn kAvx2Dots[6] = {dot4<F32>, dot4<BF16>, dot4<F16>, dot4<I8>, dot4<FP8>, dot4_int4};

const BlockRowDotFn kAvx2GgmlDot = g_row_dot;
}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target region: runs on any CPU (it only reads a table of addresses).
namespace psr::cpu {
BlockRowDotFn avx2_ggml_dot() { return kAvx2GgmlDot; }
DotFn avx2_dot(Fmt f) {
  const int i = static_cast<int>(f);
  return i >= 0 && i < 6 ? kAvx2Dots[i] : nullptr;
}
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
DotFn avx2_dot(Fmt) { return nullptr; }
BlockRowDotFn avx2_ggml_dot() { return nullptr; }
}  // namespace psr::cpu

#endif
