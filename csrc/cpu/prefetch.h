// Software prefetch for the row kernels (one home for every ISA's file): kAhead bytes ahead
// of the block being read, `lines` cache lines. The rows stream from memory and one
// thread's hardware prefetch alone leaves the kernels waiting on it (measured: up to 2x on
// Q6_K rows with AVX-512's fp32 dots; 1.1-1.3x on AVX2's integer dots). A prefetch is a
// hint that never faults and returns nothing, so one that lands past a row's end, or its
// mapping's, is harmless, and no output bit depends on it.
#pragma once

#include <xmmintrin.h>

#include <cstdint>

namespace psr::cpu {

constexpr uintptr_t kAhead = 1024;
template <uintptr_t Ahead = kAhead>
inline void ahead(const uint8_t* p, int lines) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + Ahead;
  for (int i = 0; i < lines; ++i)
    _mm_prefetch(reinterpret_cast<const char*>(at + 64 * static_cast<uintptr_t>(i)), _MM_HINT_T0);
}

}  // namespace psr::cpu
