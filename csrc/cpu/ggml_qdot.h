// Integer dot products of GGML weight rows with Q8-quantized activations: llama.cpp's
// `vec_dot_type` path. An activation row is quantized once per call to its weights'
// vec_dot type (TypeTraits::vec_dot: Q8_K for the K-quants, Q8_0 for Q8_0) and reused by
// every weight row; a block's dot is then an exact integer sum, scaled once in fp32.
//
//   Q8_K (256 values): float d, int8 qs[256], int16 bsums[16] (sums of each 16 qs). As
//        llama.cpp's quantize_row_q8_K: max = the first value of largest magnitude,
//        iscale = -127 / max, q = min(127, round_half_even(iscale x)), d = 1 / iscale;
//        an all-zero block is d = 0, zeros.
//   Q8_0 (32 values): fp16 d, int8 qs[32]. As llama.cpp's x86 quantize_row_q8_0:
//        d = amax / 127 (stored as fp16, round to nearest even), q = round_half_even(x *
//        (127 / amax)) (0 for an all-zero block).
//
// This header holds the scalar reference (the scalar ISA path: compiled only in its
// translation unit, so the compiler never vectorises its integer loops into another
// target's instructions); qdot_avx512.inc holds the AVX-512 kernels. Every path computes an
// output by one fixed sequence of operations whatever the other inputs of a call, so a row
// is bit-identical for any T, tiling and thread count (for a given path).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "expert_gemv.h"
#include "ggml_dot.h"

namespace psr::cpu {

constexpr int kQ8KBytes = 292;  // a Q8_K block: 4 + 256 + 2 * 16
constexpr int kQ8_0Bytes = 34;  // a Q8_0 block: 2 + 32

// fp32 -> fp16 bits, round to nearest even (as F16C's vcvtps2ph and torch's .half()).
inline uint16_t q_f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (x < 0x38800000u) {  // a subnormal half: round(|f| 2^24), exact scaling
    float a;
    std::memcpy(&a, &x, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  }
  return static_cast<uint16_t>(sign | ((x - 0x38000000u + 0x0FFFu + ((x >> 13) & 1u)) >> 13));
}

namespace {

namespace qref {

inline float h2f(const uint8_t* p) { return g_h2f(p); }

// One Q8_K block of x[256] into out[292].
inline void quant_q8_k(const float* x, uint8_t* out) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 256; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  std::memset(out, 0, kQ8KBytes);
  if (amax == 0.f) return;
  const float iscale = -127.f / max;
  int8_t* qs = reinterpret_cast<int8_t*>(out + 4);
  for (int j = 0; j < 256; ++j) {
    const float p = iscale * x[j];
    const int v = static_cast<int>(std::nearbyint(p));
    qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
  }
  for (int s = 0; s < 16; ++s) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += qs[16 * s + j];
    const int16_t b = static_cast<int16_t>(sum);
    std::memcpy(out + 260 + 2 * s, &b, 2);
  }
  const float d = 1.f / iscale;
  std::memcpy(out, &d, 4);
}

// One Q8_0 block of x[32] into out[34].
inline void quant_q8_0(const float* x, uint8_t* out) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  const uint16_t h = q_f32_to_f16(d);
  std::memcpy(out, &h, 2);
  for (int j = 0; j < 32; ++j) {
    const float p = x[j] * id;
    out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(p)));
  }
}

// A row of K values (whole blocks of `act`: checked by the caller) into out.
inline void quant_row(int act, const float* x, int64_t K, uint8_t* out) {
  if (act == ggml_type::Q8_K) {
    for (int64_t k = 0; k < K; k += 256, out += kQ8KBytes) quant_q8_k(x + k, out);
  } else {
    for (int64_t k = 0; k < K; k += 32, out += kQ8_0Bytes) quant_q8_0(x + k, out);
  }
}

// One weight row of `type` against one quantized row xq: the (super-)blocks' exact integer
// sums, each scaled and added to one fp32 accumulator in block order.
inline float qdot(int type, const uint8_t* w, int64_t K, const uint8_t* xq) {
  float acc = 0.f;
  switch (type) {
    case ggml_type::Q8_0:
      for (int64_t k = 0; k < K; k += 32, w += 34, xq += kQ8_0Bytes) {
        int isum = 0;
        for (int j = 0; j < 32; ++j)
          isum += static_cast<int8_t>(w[2 + j]) * static_cast<int8_t>(xq[2 + j]);
        const float dd = h2f(w) * h2f(xq);
        acc += dd * static_cast<float>(isum);
      }
      return acc;
    case ggml_type::Q4_K:
    case ggml_type::Q5_K:  // Q5_K: Q4_K's plus a fifth bit, bit j of qh[l] for sub-block j
      for (int64_t k = 0; k < K;
           k += 256, w += type == ggml_type::Q4_K ? 144 : 176, xq += kQ8KBytes) {
        float dx;
        std::memcpy(&dx, xq, 4);
        const int8_t* q8 = reinterpret_cast<const int8_t*>(xq + 4);
        int16_t bs[16];
        std::memcpy(bs, xq + 260, 32);
        const bool five = type == ggml_type::Q5_K;
        const uint8_t* qh = w + 16;
        const uint8_t* qs = w + (five ? 48 : 16);
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          g_k_scale_min(j, w + 4, &sc, &m);
          int s = 0;
          for (int l = 0; l < 32; ++l) {
            int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 0xF;
            if (five) q += ((qh[l] >> j) & 1) << 4;
            s += q * q8[32 * j + l];
          }
          isum += sc * s;
          msum += m * (bs[2 * j] + bs[2 * j + 1]);
        }
        const float dd = dx * h2f(w), dm = dx * h2f(w + 2);
        acc += dd * static_cast<float>(isum);
        acc -= dm * static_cast<float>(msum);
      }
      return acc;
    case ggml_type::Q6_K:
      for (int64_t k = 0; k < K; k += 256, w += 210, xq += kQ8KBytes) {
        float dx;
        std::memcpy(&dx, xq, 4);
        const int8_t* q8 = reinterpret_cast<const int8_t*>(xq + 4);
        int16_t bs[16];
        std::memcpy(bs, xq + 260, 32);
        const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
        int isum = 0;
        for (int s = 0; s < 16; ++s) {  // sub-block s: elements 16 s.., half n, run g
          const int n = s / 8, g = (s % 8) / 2, l0 = 16 * (s % 2);
          const uint8_t* ql = w + 64 * n + 32 * (g & 1);
          const uint8_t* qh = w + 128 + 32 * n;
          int part = 0;
          for (int l = l0; l < l0 + 16; ++l) {
            const int q = ((ql[l] >> (g < 2 ? 0 : 4)) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4);
            part += q * q8[16 * s + l - l0];
          }
          isum += sc[s] * (part - 32 * bs[s]);
        }
        const float dd = dx * h2f(w + 208);
        acc += dd * static_cast<float>(isum);
      }
      return acc;
    default:
      return 0.f;  // no vec_dot type: never called
  }
}

// One Q4_K tile (expert_gemv.h's tile_q4k layout) against a Q8_K row xq: out[r] for its
// 8 rows, each a vector path's lane: exact integer sums per super-block, then
// F = fma(I, d dx, F), G = fma(M, dmin dx, G) in block order, out = F - G.
inline void q4k_tile(const uint8_t* g, int64_t K, const uint8_t* xq, float out[8]) {
  float F[8] = {}, G[8] = {};
  for (int64_t b = 0; b < K / 256; ++b, g += 8 * 144, xq += kQ8KBytes) {
    float dx;
    std::memcpy(&dx, xq, 4);
    const int8_t* q8 = reinterpret_cast<const int8_t*>(xq + 4);
    int16_t bs[16];
    std::memcpy(bs, xq + 260, 32);
    for (int r = 0; r < 8; ++r) {
      uint8_t sc12[12];
      for (int w = 0; w < 3; ++w) std::memcpy(sc12 + 4 * w, g + 32 + 32 * w + 4 * r, 4);
      int isum = 0, msum = 0;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        g_k_scale_min(j, sc12, &sc, &m);
        int s = 0;
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = g[128 + 256 * (j / 2) + 32 * (l / 4) + 4 * r + l % 4];
          s += (j % 2 ? byte >> 4 : byte & 0xF) * q8[32 * j + l];
        }
        isum += sc * s;
        msum += m * static_cast<int16_t>(bs[2 * j] + bs[2 * j + 1]);
      }
      F[r] = std::fma(static_cast<float>(isum), h2f(g + 2 * r) * dx, F[r]);
      G[r] = std::fma(static_cast<float>(msum), h2f(g + 16 + 2 * r) * dx, G[r]);
    }
  }
  for (int r = 0; r < 8; ++r) out[r] = F[r] - G[r];
}

}  // namespace qref
}  // namespace
}  // namespace psr::cpu
