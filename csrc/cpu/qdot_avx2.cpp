// AVX2 integer dots on quantized activations (ggml_qdot.h's rules): vpmaddubsw (u8 x s8
// pairs, exact for these codes) then vpmaddwd (the K-quants' int16 sub-block scales; Q8_0:
// ones), int32 lanes scaled in fp32 by d_w d_x per (super-)block into eight fp32 lanes a
// row and input, summed once at the row's end. Q8_0 meets its signed codes as |w| against
// x with w's sign (vpsignb). The quantizer: the scalar reference's bytes. Compiled for
// AVX2 + FMA + F16C with a pragma, chosen at run time.
#include <immintrin.h>

#include <cstdint>

#include "expert_gemv.h"
#include "ggml_dot.h"
#include "ggml_qdot.h"
#include "prefetch.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace psr::cpu {
namespace qdot_avx2 {
namespace {

// Prefetch distance of these kernels: 2 KiB ahead streamed the expert FFN 1.07x faster
// than prefetch.h's 1 KiB (IQR 1.04-1.11; 512: 0.90x, 4096: 1.04x; Q4_K_M rows, one
// thread, alternated in one process).
constexpr uintptr_t kQAhead = 2048;

inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline float ldf(const uint8_t* p) {
  float f;
  __builtin_memcpy(&f, p, 4);
  return f;
}
inline __m256i ld(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i scaled(__m256i codes, __m256i x, __m256i s16) {  // int32 lanes
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), s16);
}
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline __m256i lane16(int j) {  // shuffle control: every int16 lane byte j, zero-extended
  return _mm256_set1_epi16(static_cast<int16_t>(0x8000 | j));
}
inline __m256i pick16(int lo, int hi) {  // shuffle control: int16 lanes 0..7 lane lo, 8..15 hi
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((2 * hi + 1) << 8 | 2 * hi)),
                          _mm_set1_epi16(static_cast<int16_t>((2 * lo + 1) << 8 | 2 * lo)));
}

template <int NV>
void qrows_nv(int type, const uint8_t* row, int64_t K, const uint8_t* const* xq, float* out) {
  __m256 F[NV], G[NV];
  for (int t = 0; t < NV; ++t) F[t] = G[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  switch (type) {
    case ggml_type::Q8_0: {
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* wb = row + 34 * b;
        ahead<kQAhead>(wb, 1);
        const __m256i w = ld(wb + 2), aw = _mm256_abs_epi8(w);
        const float dw = h2f(wb);
        for (int t = 0; t < NV; ++t) {
          const uint8_t* xb = xq[t] + 34 * b;
          const __m256i I = scaled(aw, _mm256_sign_epi8(ld(xb + 2), w), ones);
          F[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_set1_ps(dw * h2f(xb)), F[t]);
        }
      }
      break;
    }
    case ggml_type::Q4_K:
    case ggml_type::Q5_K:  // Q5_K: plus bit j of qh[l] as the codes' 16s (sub-block j)
      for (int64_t k = 0; k < K; k += 256, row += type == ggml_type::Q5_K ? 176 : 144) {
        const bool five = type == ggml_type::Q5_K;
        ahead<kQAhead>(row, 3);
        const float d = h2f(row), dmin = h2f(row + 2);
        // The twelve bytes of 6-bit scales and mins to bytes sc[0..7], m[0..7] (g_k_scale_min's
        // rule, four lanes a word, as the AVX-512 path): the scalar rule per sub-block and the
        // lane-by-lane set took more instructions than the block's dots at one token.
        uint32_t u[4];
        __builtin_memcpy(u, row + 4, 12);
        const uint32_t k6 = 0x3F3F3F3Fu, k4 = 0x0F0F0F0Fu, k2 = 0x03030303u;
        u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // m[4..7]
        const uint32_t m03 = u[1] & k6;
        u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);  // sc[4..7]
        u[2] = m03;                                      // m[0..3]
        u[0] &= k6;                                      // sc[0..3]
        const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
        // int16 lanes m[0], m[0], m[1], m[1], ..., m[7], m[7]
        const __m256i md = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
            sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
        const __m256i sb = _mm256_broadcastsi128_si256(sm);  // byte j: sc[j] (j < 8)
        __m256i lo[4], hi[4], slo[4], shi[4];
        for (int p = 0; p < 4; ++p) {  // sub-block 2 p: low nibbles, 2 p + 1: high
          const __m256i q = ld(row + (five ? 48 : 16) + 32 * p);
          lo[p] = _mm256_and_si256(q, m4);
          hi[p] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if (five) {
            const __m256i qh = ld(row + 16), one = _mm256_set1_epi8(1);
            const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one);
            const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one);
            lo[p] = _mm256_or_si256(lo[p], _mm256_slli_epi16(b0, 4));
            hi[p] = _mm256_or_si256(hi[p], _mm256_slli_epi16(b1, 4));
          }
          slo[p] = _mm256_shuffle_epi8(sb, lane16(2 * p));  // every int16 lane sc[2 p]
          shi[p] = _mm256_shuffle_epi8(sb, lane16(2 * p + 1));
        }
        const int64_t xo = (k / 256) * kQ8KBytes;
        for (int t = 0; t < NV; ++t) {
          const uint8_t* xb = xq[t] + xo;
          __m256i I = _mm256_setzero_si256();
          for (int p = 0; p < 4; ++p) {
            I = _mm256_add_epi32(I, scaled(lo[p], ld(xb + 4 + 64 * p), slo[p]));
            I = _mm256_add_epi32(I, scaled(hi[p], ld(xb + 36 + 64 * p), shi[p]));
          }
          const float dx = ldf(xb);
          F[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_set1_ps(dx * d), F[t]);
          const __m256i M = _mm256_madd_epi16(ld(xb + 260), md);
          G[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(dx * dmin), G[t]);
        }
      }
      break;
    case ggml_type::Q6_K: {
      const __m256i m3 = _mm256_set1_epi8(0x03);
      for (int64_t k = 0; k < K; k += 256, row += 210) {
        ahead<kQAhead>(row, 4);
        const float d = h2f(row + 208);
        const __m256i sc16 =  // the 16 int8 scales, widened
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192)));
        __m256i cv[8], sv[8];  // run 4 n + g: elements 128 n + 32 g.., sub-blocks 8 n + 2 g (+1)
        for (int n = 0; n < 2; ++n) {
          const __m256i l0 = ld(row + 64 * n), l1 = ld(row + 64 * n + 32);
          const __m256i qh = ld(row + 128 + 32 * n);
          // sc[8 n..8 n + 7] (int16) in both 128-bit lanes: each run's two scales by a shuffle
          const __m256i half = n ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                 : _mm256_permute2x128_si256(sc16, sc16, 0x00);
          for (int g = 0; g < 4; ++g) {
            const __m256i l = g & 1 ? l1 : l0;
            const __m256i low =
                g < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
            const __m256i h = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m3);
            cv[4 * n + g] = _mm256_or_si256(low, _mm256_slli_epi16(h, 4));
            sv[4 * n + g] = _mm256_shuffle_epi8(half, pick16(2 * g, 2 * g + 1));
          }
        }
        const int64_t xo = (k / 256) * kQ8KBytes;
        for (int t = 0; t < NV; ++t) {
          const uint8_t* xb = xq[t] + xo;
          __m256i I = _mm256_setzero_si256();
          for (int r = 0; r < 8; ++r)
            I = _mm256_add_epi32(I, scaled(cv[r], ld(xb + 4 + 32 * r), sv[r]));
          // codes are q + 32: minus 32 sum_s sc_s bsum_s
          const __m256i O = _mm256_madd_epi16(sc16, ld(xb + 260));
          I = _mm256_sub_epi32(I, _mm256_slli_epi32(O, 5));
          F[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_set1_ps(ldf(xb) * d), F[t]);
        }
      }
      break;
    }
    default:
      break;  // no vec_dot type: never called
  }
  for (int t = 0; t < NV; ++t) out[t] = hsum(F[t]) - hsum(G[t]);
}

void qrows(int type, const uint8_t* row, int64_t K, const uint8_t* const* xq, int nv, float* out) {
  g_for_count<kQInputs>(nv, [&](auto k) { qrows_nv<decltype(k)::value>(type, row, K, xq, out); });
}

// One Q4_K tile (expert_gemv.h's tile_q4k layout) against NV Q8_K rows: row r in int32 /
// fp32 lane r. A sub-block's 8 chunk products add in int16 (|sum| <= 8 x 2 x 15 x 127 =
// 30480), then its scale by vpmaddwd; the fp32 steps are scalar_q4k_tiles' per lane.
template <int NV>
void tile_nv(const uint8_t* g, int64_t K, const uint8_t* const* xq, float* out) {
  __m256 F[NV], G[NV];
  for (int t = 0; t < NV; ++t) F[t] = G[t] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i k6 = _mm256_set1_epi8(0x3F), k4 = m4, k2 = _mm256_set1_epi8(0x03);
  // Shuffle controls (built once, not per block): byte j of each row's 32-bit lane to an
  // int16 pair (c0: j, j; c1: j + 1, j + 1; cm: j, j + 1), for j = 0 and 2.
  __m256i c0[2], c1[2], cm[2];
  for (int h = 0; h < 2; ++h) {
    const char j = static_cast<char>(2 * h);
    const __m128i a = _mm_setr_epi8(j, -1, j, -1, 4 + j, -1, 4 + j, -1, 8 + j, -1, 8 + j, -1,
                                    12 + j, -1, 12 + j, -1);
    const __m128i m = _mm_setr_epi8(j, -1, j + 1, -1, 4 + j, -1, 5 + j, -1, 8 + j, -1, 9 + j, -1,
                                    12 + j, -1, 13 + j, -1);
    c0[h] = _mm256_broadcastsi128_si256(a);
    c1[h] = _mm256_add_epi8(c0[h], _mm256_set1_epi16(1));  // byte j + 1; the -1 bytes kept
    cm[h] = _mm256_broadcastsi128_si256(m);
  }
  for (int64_t b = 0; b < K / 256; ++b, g += kQ4KTileBytes) {
    ahead<kQAhead>(g, 18);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
    // The 6-bit scales and mins of 8 rows at once (g_k_scale_min's rule on words).
    const __m256i u0 = ld(g + 32), u1 = ld(g + 64), u2 = ld(g + 96);
    const __m256i sc03 = _mm256_and_si256(u0, k6), m03 = _mm256_and_si256(u1, k6);
    const __m256i sc47 =
        _mm256_or_si256(_mm256_and_si256(u2, k4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k2), 4));
    const __m256i m47 =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k2), 4));
    __m256i I[NV], M[NV];
    int bsum[NV][4];  // per input: int16 pairs (bsum of sub-blocks 2 p, 2 p + 1) per p
    for (int t = 0; t < NV; ++t) {
      I[t] = M[t] = _mm256_setzero_si256();
      int16_t bs[16];
      __builtin_memcpy(bs, xq[t] + b * kQ8KBytes + 260, 32);
      for (int p = 0; p < 4; ++p) {
        const int16_t lo = static_cast<int16_t>(bs[4 * p] + bs[4 * p + 1]);
        const int16_t hi = static_cast<int16_t>(bs[4 * p + 2] + bs[4 * p + 3]);
        bsum[t][p] = static_cast<int>(static_cast<uint16_t>(lo) |
                                      (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
      }
    }
    for (int p = 0; p < 4; ++p) {
      __m256i Slo[NV], Shi[NV];
      for (int t = 0; t < NV; ++t) Slo[t] = Shi[t] = _mm256_setzero_si256();
      const uint8_t* q = g + 128 + 256 * p;
      for (int c = 0; c < 8; ++c) {
        const __m256i w = ld(q + 32 * c);
        const __m256i lo = _mm256_and_si256(w, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        for (int t = 0; t < NV; ++t) {
          const uint8_t* x = xq[t] + b * kQ8KBytes + 4 + 64 * p + 4 * c;
          int a, e;
          __builtin_memcpy(&a, x, 4);
          __builtin_memcpy(&e, x + 32, 4);
          Slo[t] = _mm256_add_epi16(Slo[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
          Shi[t] = _mm256_add_epi16(Shi[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(e)));
        }
      }
      // int16 pairs (sc, sc) per row lane for sub-blocks 2 p, 2 p + 1; (m_2p, m_2p+1)
      const __m256i src = p < 2 ? sc03 : sc47, msrc = p < 2 ? m03 : m47;
      const __m256i s0 = _mm256_shuffle_epi8(src, c0[p & 1]);
      const __m256i s1 = _mm256_shuffle_epi8(src, c1[p & 1]);
      const __m256i mm = _mm256_shuffle_epi8(msrc, cm[p & 1]);
      for (int t = 0; t < NV; ++t) {
        I[t] = _mm256_add_epi32(I[t], _mm256_madd_epi16(Slo[t], s0));
        I[t] = _mm256_add_epi32(I[t], _mm256_madd_epi16(Shi[t], s1));
        M[t] = _mm256_add_epi32(M[t], _mm256_madd_epi16(mm, _mm256_set1_epi32(bsum[t][p])));
      }
    }
    for (int t = 0; t < NV; ++t) {
      const __m256 dx = _mm256_set1_ps(ldf(xq[t] + b * kQ8KBytes));
      F[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[t]), _mm256_mul_ps(d, dx), F[t]);
      G[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M[t]), _mm256_mul_ps(dm, dx), G[t]);
    }
  }
  for (int t = 0; t < NV; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_sub_ps(F[t], G[t]));
}

void tiles(const uint8_t* g, int64_t K, const uint8_t* const* xq, int nv, float* out) {
  g_for_count<kTileInputs>(nv, [&](auto k) { tile_nv<decltype(k)::value>(g, K, xq, out); });
}

// int32 lanes v (values in [-128, 127]) to eight bytes at out.
inline void store8(__m256i v, uint8_t* out) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
}
inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The scalar reference's bytes: the same products, rounded half to even by vcvtps2dq.
void quant(int act, const float* x, int64_t K, uint8_t* out) {
  if (act == ggml_type::Q8_K) {
    for (int64_t k = 0; k < K; k += 256, x += 256, out += kQ8KBytes) {
      __m256 am = _mm256_setzero_ps();
      for (int i = 0; i < 32; ++i) am = _mm256_max_ps(am, abs8(_mm256_loadu_ps(x + 8 * i)));
      const float amax = hmax(am);
      __builtin_memset(out, 0, kQ8KBytes);
      if (amax == 0.f) continue;
      float max = 0.f;
      for (int i = 0; i < 32; ++i) {
        const int m = _mm256_movemask_ps(
            _mm256_cmp_ps(abs8(_mm256_loadu_ps(x + 8 * i)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (m) {
          max = x[8 * i + __builtin_ctz(static_cast<unsigned>(m))];
          break;
        }
      }
      const float iscale = -127.f / max;
      for (int i = 0; i < 32; ++i) {
        const __m256i v = _mm256_min_epi32(
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_set1_ps(iscale), _mm256_loadu_ps(x + 8 * i))),
            _mm256_set1_epi32(127));
        store8(v, out + 4 + 8 * i);
      }
      for (int s = 0; s < 16; ++s) {
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += static_cast<int8_t>(out[4 + 16 * s + j]);
        const int16_t b = static_cast<int16_t>(sum);
        __builtin_memcpy(out + 260 + 2 * s, &b, 2);
      }
      const float dd = 1.f / iscale;
      __builtin_memcpy(out, &dd, 4);
    }
    return;
  }
  for (int64_t k = 0; k < K; k += 32, x += 32, out += kQ8_0Bytes) {
    __m256 am = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) am = _mm256_max_ps(am, abs8(_mm256_loadu_ps(x + 8 * i)));
    const float amax = hmax(am);
    const float d = amax / 127.f;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    const uint16_t h = q_f32_to_f16(d);
    __builtin_memcpy(out, &h, 2);
    for (int i = 0; i < 4; ++i)
      store8(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(id))),
             out + 2 + 8 * i);
  }
}

}  // namespace
const QRowDotsFn kDots = qrows;
const QuantFn kQuant = quant;
const QTileDotsFn kTiles = tiles;
}  // namespace qdot_avx2
}  // namespace psr::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace psr::cpu {
QuantFn avx2_quant() { return qdot_avx2::kQuant; }
QRowDotsFn avx2_qdots() { return qdot_avx2::kDots; }
QTileDotsFn avx2_q4k_tiles() { return qdot_avx2::kTiles; }
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
QuantFn avx2_quant() { return nullptr; }
QRowDotsFn avx2_qdots() { return nullptr; }
QTileDotsFn avx2_q4k_tiles() { return nullptr; }
}  // namespace psr::cpu

#endif
