// GGML block rows (GGUF's experts as the file holds them, psr_kernels.ggml) on the CPU: one
// row's dot product with an fp32 vector, each block dequantized into registers-sized scratch
// and multiplied in sixteen independent lanes (no reassociation: the same sum in the same
// order on every path, which the compiler vectorises for the target of the file that
// includes this header). Included inside a target pragma region by each ISA's file and
// once plainly by the scalar one: everything here has internal linkage.
//
// Types: expert_gemv.h's `ggml_type` ids and `kTypeTraits` (FP8_B128 is psr's own). A file that
// defines PSR_GGML_F16C (and includes <immintrin.h>) decodes the blocks' f16 scales with F16C.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "expert_gemv.h"
#include "ggml_tables.h"

namespace psr::cpu {
namespace {

inline float g_h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(PSR_GGML_F16C)
  return _cvtsh_ss(h);  // the AVX files' target has F16C: one instruction, inlined
#else
  return f16_to_f32(h);
#endif
}

inline float g_e8m0(int e) {  // 2^(e - 127), e = 0 the subnormal 2^-127
  const uint32_t bits = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr float kFp4[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                            -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline void g_k_scale_min(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// v times -1 where `bit` is set: a multiply, not a branch (random signs mispredict).
inline float g_signed(float v, int bit) { return v * (1.f - 2.f * static_cast<float>(bit)); }

// IQ2_XXS (G = 8 values a grid row, mul 1/4) / IQ3_XXS (G = 4, mul 1/2): per sub-block of
// 32 a u32 of 4 x 7 sign-index bits and a 4-bit scale; grid indices one byte each.
template <int G>  // a constant, so the grid offsets fold
inline void g_iq_xxs(const uint8_t* b, const uint8_t* qs, const uint8_t* aux, const int8_t* grid,
                     float mul, float* out) {
  const float d = g_h2f(b);
  for (int ib = 0; ib < 8; ++ib) {
    uint32_t a;
    std::memcpy(&a, aux + (G == 8 ? 8 : 4) * ib, 4);  // IQ2_XXS: after its 4 indices
    const float db = d * (0.5f + static_cast<float>(a >> 28)) * mul;
    for (int g = 0; g < 4; ++g) {
      const uint8_t sb = kKsigns[(a >> (7 * g)) & 127];
      for (int j = 0; j < 8; ++j) {
        const int q = G == 8 ? qs[8 * ib + g] : qs[8 * ib + 2 * g + j / 4];
        const float v = db * static_cast<float>(grid[q * G + j % G]);
        out[32 * ib + 8 * g + j] = g_signed(v, (sb >> j) & 1);
      }
    }
  }
}

// IQ2_XS / IQ2_S: a 4-bit scale per 16, grid rows of 8 from 9 / 10 index bits, signs per 8.
inline void g_iq2_row(float db, const int8_t* grid_row, int signs, float* out) {
  for (int j = 0; j < 8; ++j) {
    const float v = db * static_cast<float>(grid_row[j]);
    out[j] = g_signed(v, (signs >> j) & 1);
  }
}

// IQ1_S / IQ1_M: dl (grid + delta), the delta's sign per row of 8.
inline void g_iq1_row(float dl, int q, bool neg, float* out) {
  const float delta = static_cast<float>(kIq1Delta8[0]) / 8.f;
  for (int j = 0; j < 8; ++j)
    out[j] = dl * (static_cast<float>(kIq1S[8 * q + j]) + (neg ? -delta : delta));
}

// Dequantize one block of `type` into out[QK]; returns QK.
inline int g_dequant(int type, const uint8_t* __restrict b, float* __restrict out) {
  switch (type) {
    case ggml_type::Q8_0: {
      const float d = g_h2f(b);
      for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
      return 32;
    }
    case ggml_type::Q4_0:
    case ggml_type::Q4_1: {
      const float d = g_h2f(b);
      const float m = type == ggml_type::Q4_1 ? g_h2f(b + 2) : 0.f;
      const uint8_t* qs = b + (type == ggml_type::Q4_1 ? 4 : 2);
      const float off = type == ggml_type::Q4_0 ? -8.f : 0.f;
      for (int i = 0; i < 16; ++i) {
        out[i] = d * (static_cast<float>(qs[i] & 0xF) + off) + m;
        out[i + 16] = d * (static_cast<float>(qs[i] >> 4) + off) + m;
      }
      return 32;
    }
    case ggml_type::Q5_0:
    case ggml_type::Q5_1: {
      const float d = g_h2f(b);
      const float m = type == ggml_type::Q5_1 ? g_h2f(b + 2) : 0.f;
      const uint8_t* hp = b + (type == ggml_type::Q5_1 ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, hp, 4);
      const uint8_t* qs = hp + 4;
      const float off = type == ggml_type::Q5_0 ? -16.f : 0.f;
      for (int i = 0; i < 16; ++i) {
        const int lo = (qs[i] & 0xF) | (((qh >> i) & 1) << 4);
        const int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        out[i] = d * (static_cast<float>(lo) + off) + m;
        out[i + 16] = d * (static_cast<float>(hi) + off) + m;
      }
      return 32;
    }
    case ggml_type::MXFP4: {
      const float s = g_e8m0(b[0]);
      for (int i = 0; i < 16; ++i) {
        out[i] = kFp4[b[1 + i] & 0xF] * s;
        out[i + 16] = kFp4[b[1 + i] >> 4] * s;
      }
      return 32;
    }
    case ggml_type::Q4_K:
    case ggml_type::Q5_K: {
      const float d = g_h2f(b), dmin = g_h2f(b + 2);
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (type == ggml_type::Q4_K ? 16 : 48);
      for (int j = 0; j < 4; ++j) {
        int s1, m1, s2, m2;
        g_k_scale_min(2 * j, sc, &s1, &m1);
        g_k_scale_min(2 * j + 1, sc, &s2, &m2);
        const float d1 = d * static_cast<float>(s1), c1 = dmin * static_cast<float>(m1);
        const float d2 = d * static_cast<float>(s2), c2 = dmin * static_cast<float>(m2);
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
          if (type == ggml_type::Q5_K) {
            lo += ((qh[l] >> (2 * j)) & 1) << 4;
            hi += ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          out[64 * j + l] = d1 * static_cast<float>(lo) - c1;
          out[64 * j + 32 + l] = d2 * static_cast<float>(hi) - c2;
        }
      }
      return 256;
    }
    case ggml_type::Q6_K: {  // per half, four runs of 32 (contiguous: the compiler vectorises them)
      const float d = g_h2f(b + 208);
      for (int n = 0; n < 2; ++n) {
        const uint8_t* __restrict qh = b + 128 + 32 * n;
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * n);
        for (int g = 0; g < 4; ++g) {
          const uint8_t* __restrict ql = b + 64 * n + 32 * (g & 1);
          const int shift = g < 2 ? 0 : 4;
          const float s0 = d * static_cast<float>(sc[2 * g]);
          const float s1 = d * static_cast<float>(sc[2 * g + 1]);
          float* __restrict o = out + 128 * n + 32 * g;
          for (int l = 0; l < 32; ++l) {
            const int q = (((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
            o[l] = (l < 16 ? s0 : s1) * static_cast<float>(q);
          }
        }
      }
      return 256;
    }
    case ggml_type::Q2_K: {  // scales[16] (sc | mn << 4), qs[64], d, dmin: 16 sub-blocks of 16
      const float d = g_h2f(b + 80), dmin = g_h2f(b + 82);
      for (int s = 0; s < 16; ++s) {  // elements 16 s.. : bits 2 j of qs[32 n + l]
        const int n = s / 8, j = (s % 8) / 2, l0 = 16 * (s % 2);
        const float dl = d * static_cast<float>(b[s] & 0xF);
        const float ml = dmin * static_cast<float>(b[s] >> 4);
        const uint8_t* __restrict q = b + 16 + 32 * n + l0;
        for (int l = 0; l < 16; ++l)
          out[16 * s + l] = dl * static_cast<float>((q[l] >> (2 * j)) & 3) - ml;
      }
      return 256;
    }
    case ggml_type::Q3_K: {  // hmask[32], qs[64], scales[12] (6 bits, offset 32), d
      const float d = g_h2f(b + 108);
      const uint8_t* sc = b + 96;
      for (int s = 0; s < 16; ++s) {
        const int n = s / 8, j = (s % 8) / 2, l0 = 16 * (s % 2), hb = s / 2;
        const int lo = (sc[s % 8] >> (4 * (s / 8))) & 0xF;
        const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const float dl = d * static_cast<float>((lo | (hi << 4)) - 32);
        const uint8_t* __restrict q = b + 32 + 32 * n + l0;
        const uint8_t* __restrict hm = b + l0;
        for (int l = 0; l < 16; ++l) {  // a clear high bit subtracts 4
          const int v = ((q[l] >> (2 * j)) & 3) - (((hm[l] >> hb) & 1) ? 0 : 4);
          out[16 * s + l] = dl * static_cast<float>(v);
        }
      }
      return 256;
    }
    case ggml_type::IQ4_NL: {  // d, then nibbles indexing gguf-py's 16 levels
      const float d = g_h2f(b);
      for (int i = 0; i < 16; ++i) {
        out[i] = d * static_cast<float>(kIq4Levels[b[2 + i] & 0xF]);
        out[i + 16] = d * static_cast<float>(kIq4Levels[b[2 + i] >> 4]);
      }
      return 32;
    }
    case ggml_type::IQ4_XS: {  // d, scales_h (u16), scales_l[4], 8 sub-blocks of IQ4_NL nibbles
      const float d = g_h2f(b);
      const int sh = b[2] | (b[3] << 8);
      for (int s = 0; s < 8; ++s) {
        const int lo = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF, hi = (sh >> (2 * s)) & 3;
        const float dl = d * static_cast<float>((lo | (hi << 4)) - 32);
        const uint8_t* qs = b + 8 + 16 * s;
        for (int l = 0; l < 16; ++l) {
          out[32 * s + l] = dl * static_cast<float>(kIq4Levels[qs[l] & 0xF]);
          out[32 * s + 16 + l] = dl * static_cast<float>(kIq4Levels[qs[l] >> 4]);
        }
      }
      return 256;
    }
    case ggml_type::IQ2_XXS:
      g_iq_xxs<8>(b, b + 2, b + 6, kIq2Xxs, 0.25f, out);
      return 256;
    case ggml_type::IQ3_XXS:
      g_iq_xxs<4>(b, b + 2, b + 66, kIq3Xxs, 0.5f, out);
      return 256;
    case ggml_type::IQ2_XS:   // d, qs[32] u16 (9-bit grid index, 7-bit sign index), scales[8]
    case ggml_type::IQ2_S: {  // d, qs[32], signs[32], qh[8] (2 bits a row), scales[8]
      const bool xs = type == ggml_type::IQ2_XS;
      const float d = g_h2f(b);
      const uint8_t* sc = b + (xs ? 66 : 74);
      for (int t = 0; t < 32; ++t) {  // rows of 8
        const int s = t / 2;
        const float db =
            d * (0.5f + static_cast<float>((sc[s / 2] >> (4 * (s % 2))) & 0xF)) * 0.25f;
        if (xs) {
          const int q = b[2 + 2 * t] | (b[3 + 2 * t] << 8);
          g_iq2_row(db, kIq2Xs + 8 * (q & 511), kKsigns[q >> 9], out + 8 * t);
        } else {
          const int q = b[2 + t] | (((b[66 + t / 4] >> (2 * (t % 4))) & 3) << 8);
          g_iq2_row(db, kIq2S + 8 * q, b[34 + t], out + 8 * t);
        }
      }
      return 256;
    }
    case ggml_type::IQ3_S: {  // d, qs[64], qh[8] (a bit a row), signs[32], scales[4]
      const float d = g_h2f(b);
      for (int i = 0; i < 256; ++i) {
        const int ib = i / 32, t = i / 4;
        const float db =
            d * static_cast<float>(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF));
        const int q = b[2 + t] | (((b[66 + t / 8] >> (t % 8)) & 1) << 8);
        const float v = db * static_cast<float>(kIq3S[4 * q + i % 4]);
        out[i] = g_signed(v, (b[74 + i / 8] >> (i % 8)) & 1);
      }
      return 256;
    }
    case ggml_type::IQ1_S: {  // d, qs[32], qh[8] u16 (3 index bits a row, scale, delta sign)
      const float d = g_h2f(b);
      for (int ib = 0; ib < 8; ++ib) {
        const int qh = b[34 + 2 * ib] | (b[35 + 2 * ib] << 8);
        const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
        for (int r = 0; r < 4; ++r) {
          const int t = 4 * ib + r;
          g_iq1_row(dl, b[2 + t] | (((qh >> (3 * r)) & 7) << 8), (qh & 0x8000) != 0, out + 8 * t);
        }
      }
      return 256;
    }
    case ggml_type::IQ1_M: {  // qs[32], qh[16], 4 u16 scales whose top nibbles hold d
      uint16_t sc[4];
      std::memcpy(sc, b + 48, 8);
      const uint16_t bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) |
                                                  ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000));
      uint8_t dh[2];
      std::memcpy(dh, &bits, 2);
      const float d = g_h2f(dh);
      for (int t = 0; t < 32; ++t) {
        const int s = t / 2;
        const float dl = d * static_cast<float>(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1);
        const int h = b[32 + t / 2] >> (4 * (t % 2));
        g_iq1_row(dl, b[t] | ((h & 7) << 8), (h & 8) != 0, out + 8 * t);
      }
      return 256;
    }
    case ggml_type::FP8_B128: {  // fp32 tile scale, then 128 e4m3 codes
      float s;
      std::memcpy(&s, b, 4);
      for (int i = 0; i < 128; ++i) out[i] = s * fp8_e4m3_to_f32(b[4 + i]);
      return 128;
    }
    default:
      return 0;
  }
}

// The block types an ISA path decodes once for several inputs (its ggml_rows_nv<NV>; the
// others run their one-input dot per input).
inline bool g_several_inputs(int type) {
  return type == ggml_type::Q8_0 || type == ggml_type::Q4_K || type == ggml_type::Q5_K ||
         type == ggml_type::Q6_K;
}

// f(std::integral_constant<int, NV>{}) with NV = min(nv, Max), nv >= 1: a several-input
// kernel instantiated per input count (its loops over the inputs then unroll).
template <int Max, class Fn>
inline void g_for_count(int nv, Fn&& f) {
  if constexpr (Max > 1) {
    if (nv < Max) return g_for_count<Max - 1>(nv, f);
  }
  f(std::integral_constant<int, Max>{});
}
template <class Fn>
inline void g_for_inputs(int nv, Fn&& f) {  // nv in [1, kRowInputs]
  g_for_count<kRowInputs>(nv, f);
}

// Bytes of one block of `type` (0: unknown); float types count 32-element chunks.
inline int g_block_bytes(int type) {
  const TypeTraits* t = type_traits(type);
  if (t == nullptr) return 0;
  return t->block_len == 1 ? 32 * t->block_bytes : t->block_bytes;
}

inline int g_block_len(int type) {
  const TypeTraits* t = type_traits(type);
  if (t == nullptr) return 0;
  return t->block_len == 1 ? 32 : t->block_len;
}

inline int g_float_chunk(int type, const uint8_t* __restrict p, float* __restrict out) {
  for (int i = 0; i < 32; ++i) {
    if (type == ggml_type::F32) {
      std::memcpy(&out[i], p + 4 * i, 4);
    } else {
      if (type == ggml_type::F16) {
        out[i] = g_h2f(p + 2 * i);
      } else {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
    }
  }
  return 32;
}

// sum_k w[k] v[k] over a row of K inputs (a whole number of blocks: checked by the caller).
inline float g_row_dot(int type, const uint8_t* row, int64_t K, const float* v) {
  const int qk = g_block_len(type), bs = g_block_bytes(type);
  alignas(64) float w[256];
  float lanes[16] = {0.f};
  const bool flt = is_float_type(type);
  int64_t k0 = 0;
  if (type ==
      ggml_type::Q8_0) {  // Q8_0: the scale once per block, codes widened in the lanes (no scratch)
    for (; k0 < K; k0 += 32, row += 34) {
      const float d = g_h2f(row);
      const int8_t* __restrict q = reinterpret_cast<const int8_t*>(row + 2);
      for (int i = 0; i < 32; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += d * static_cast<float>(q[i + l]) * v[k0 + i + l];
    }
  }
  for (; k0 + qk <= K; k0 += qk, row += bs) {
    if (flt) {
      g_float_chunk(type, row, w);
    } else {
      g_dequant(type, row, w);
    }
    for (int i = 0; i < qk; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += w[i + l] * v[k0 + i + l];
  }
  if (flt && k0 < K) {  // a float row's last partial chunk, element by element
    const int isz = type == ggml_type::F32 ? 4 : 2;
    for (int64_t i = 0; k0 + i < K; ++i) {
      float f;
      if (type == ggml_type::F32) {
        std::memcpy(&f, row + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, row + isz * i, 2);
        f = type == ggml_type::F16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      lanes[i % 16] += f * v[k0 + i];
    }
  }
  float acc = 0.f;
  for (int l = 0; l < 16; ++l) acc += lanes[l];
  return acc;
}

}  // namespace
}  // namespace psr::cpu
