// AVX-512 integer dots on quantized activations (qdot_avx512.inc), compiled twice: with
// VNNI (vpdpbusd) and without (AVX-512 BW's vpmaddubsw / vpmaddwd), each in its own target
// region and namespace, chosen at run time (cpu_has_vnni; Dot::q8_madd forces the second).
// The shared scalar helpers (ggml_dot.h, ggml_qdot.h) are included before either region, so
// they are compiled for the baseline target and inline into both.
#include <immintrin.h>

#include <cstdint>

#include "expert_gemv.h"
#include "ggml_dot.h"
#include "ggml_qdot.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if defined(__clang__)
#pragma clang attribute push(                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni")
#endif
namespace psr::cpu {
namespace qdot_vnni {
namespace {
#define PSR_QDOT_VNNI 1
#include "qdot_avx512.inc"
#undef PSR_QDOT_VNNI
}  // namespace
const QRowDotsFn kDots = qrows;
const QuantFn kQuant = quant;
}  // namespace qdot_vnni
}  // namespace psr::cpu
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
namespace psr::cpu {
namespace qdot_madd {
namespace {
#define PSR_QDOT_VNNI 0
#include "qdot_avx512.inc"
#undef PSR_QDOT_VNNI
}  // namespace
const QRowDotsFn kDots = qrows;
const QuantFn kQuant = quant;
}  // namespace qdot_madd
}  // namespace psr::cpu
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Outside the target regions: runs on any CPU (it only reads addresses).
namespace psr::cpu {
QuantFn avx512_quant() { return qdot_madd::kQuant; }  // AVX-512 F/BW only: either CPU
QRowDotsFn avx512_qdots(bool vnni) { return vnni ? qdot_vnni::kDots : qdot_madd::kDots; }
}  // namespace psr::cpu

#else  // no x86-64 target support in this compiler

namespace psr::cpu {
QuantFn avx512_quant() { return nullptr; }
QRowDotsFn avx512_qdots(bool) { return nullptr; }
}  // namespace psr::cpu

#endif
