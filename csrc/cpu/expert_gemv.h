// CPU expert kernels: the batch-1 (and small-T) routed expert FFN read in place from
// packed expert rows (the store's slab or host rows), for every expert format psr holds.
//
//   y[t] = sum_j w[t, j] * down_j( act(gate_j x[t], up_j x[t]) ),  expert j in row slot[t, j]
//
// Rows are never gathered: each thread reads the routed experts' rows where they live.
// Two phases, each split statically over a small persistent thread pool:
//   1. gate/up: items (expert row, block of F rows) -> h[t, j, :] (fp32) for every (t, j)
//      routed to that row, tokens looped inside each quad of rows (read once, then from L1);
//   2. down:    items (chunk of tokens, block of H rows), tokens inside each quad of rows,
//      each summing its experts in order j = 0..k-1.
// Every output element is one call of the format's row dot product on the same inputs,
// summed by one thread in a fixed order: results are bit-identical run to run, for any
// thread count and whatever other tokens share the call (batch invariant: a token's
// output equals its T = 1 output), for a given ISA path.
//
// Vector paths (AVX2+FMA+F16C, AVX-512 F/BW/VL) are compiled with target pragmas in
// their own files and chosen at run time by CPU feature detection; a portable scalar
// path runs everywhere. Arithmetic: fp32 (weights widened or dequantized on the fly,
// scales applied once per row or group to the raw codes' partial dot product).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace psr::cpu {

// The format tables below mirror psr_kernels/rowformat.py's field for field (the
// bindings expose them; tests/store/test_format_tables.py checks the two agree).

// Expert weight formats (psr_kernels.quant's byte layouts for the quantized ones).
// ggml: GGUF's block types per part (t_gate, t_up, t_down: GGML type ids, below).
enum class Fmt : int { f32 = 0, bf16 = 1, f16 = 2, int8 = 3, fp8 = 4, int4 = 5, ggml = 6 };
struct FmtTraits {
  const char* name;  // rowformat.py's: a float dtype's name, a quantized format's, "ggml"
  Fmt fmt;
};
inline constexpr FmtTraits kFmtTraits[] = {
    {"float32", Fmt::f32}, {"bfloat16", Fmt::bf16}, {"float16", Fmt::f16}, {"int8", Fmt::int8},
    {"fp8", Fmt::fp8},     {"int4", Fmt::int4},     {"ggml", Fmt::ggml},
};

// GGML block types: ggml.h's `enum ggml_type` ids, psr's own from 200 on (FP8_B128: an
// fp32 tile scale, then 128 e4m3 codes). Traits as llama.cpp's type_traits: a row of K
// inputs is K / block_len blocks of block_bytes bytes (float types: one element a block).
namespace ggml_type {
constexpr int F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10,
              Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18,
              IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, BF16 = 30,
              MXFP4 = 39, FP8_B128 = 200, Q4_K_X8 = 201;
constexpr int Q8_K = 15;  // activations only (a vec_dot type): no weight kernels
}  // namespace ggml_type
struct TypeTraits {
  const char* name;
  int id;
  int block_len;    // elements per block (QK)
  int block_bytes;  // bytes per block (BS)
  // The activations' block type on the integer-dot path (llama.cpp's vec_dot_type:
  // ggml_qdot.h): Q8_K / Q8_0, or F32 where the type has no integer kernels.
  int vec_dot = ggml_type::F32;
};
inline constexpr TypeTraits kTypeTraits[] = {
    {"F32", ggml_type::F32, 1, 4},
    {"F16", ggml_type::F16, 1, 2},
    {"Q4_0", ggml_type::Q4_0, 32, 18},
    {"Q4_1", ggml_type::Q4_1, 32, 20},
    {"Q5_0", ggml_type::Q5_0, 32, 22},
    {"Q5_1", ggml_type::Q5_1, 32, 24},
    {"Q8_0", ggml_type::Q8_0, 32, 34, ggml_type::Q8_0},
    {"Q2_K", ggml_type::Q2_K, 256, 84},
    {"Q3_K", ggml_type::Q3_K, 256, 110},
    {"Q4_K", ggml_type::Q4_K, 256, 144, ggml_type::Q8_K},
    {"Q5_K", ggml_type::Q5_K, 256, 176, ggml_type::Q8_K},
    {"Q6_K", ggml_type::Q6_K, 256, 210, ggml_type::Q8_K},
    {"IQ2_XXS", ggml_type::IQ2_XXS, 256, 66},
    {"IQ2_XS", ggml_type::IQ2_XS, 256, 74},
    {"IQ3_XXS", ggml_type::IQ3_XXS, 256, 98},
    {"IQ1_S", ggml_type::IQ1_S, 256, 50},
    {"IQ4_NL", ggml_type::IQ4_NL, 32, 18},
    {"IQ3_S", ggml_type::IQ3_S, 256, 110},
    {"IQ2_S", ggml_type::IQ2_S, 256, 82},
    {"IQ4_XS", ggml_type::IQ4_XS, 256, 136},
    {"IQ1_M", ggml_type::IQ1_M, 256, 56},
    {"BF16", ggml_type::BF16, 1, 2},
    {"MXFP4", ggml_type::MXFP4, 32, 17},
    {"FP8_B128", ggml_type::FP8_B128, 128, 132},
    // Q4_K rows in tiles of 8 (tile_q4k below): a matrix's rows come 8 at a time, each tile
    // the 8 rows' bytes permuted, so a row of K inputs still takes K / 256 * 144 bytes.
    {"Q4_K_X8", ggml_type::Q4_K_X8, 256, 144, ggml_type::Q8_K},
};
// The traits of type id `id`, or nullptr for a type the kernels do not compute.
constexpr const TypeTraits* type_traits(int id) {
  for (const TypeTraits& t : kTypeTraits)
    if (t.id == id) return &t;
  return nullptr;
}
// Types whose rows come in tiles of kTileRows (a matrix of them: rows a multiple of 8).
constexpr bool is_tiled_type(int id) { return id == ggml_type::Q4_K_X8; }
constexpr bool is_float_type(int id) {
  const TypeTraits* t = type_traits(id);
  return t != nullptr && t->block_len == 1;
}
// Activations between the projections; more kinds can be added here.
//   swiglu:     h = silu(g) * u
//   swiglu_oai: gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit),
//               h = (u + 1) * g * sigmoid(alpha * g)
enum class Act : int { swiglu = 0, swiglu_oai = 1 };
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };
// How GGML rows with a vec_dot type meet their activations: f32 (activations as given,
// blocks decoded to fp32) or q8 (activations quantized once per call to the vec_dot type,
// integer block dots: ggml_qdot.h); q8_madd is q8 with AVX-512's vpmaddubsw / vpmaddwd in
// place of VNNI's vpdpbusd (the same integers, so the same bits: for tests on VNNI CPUs);
// best is q8 for the block types where it is measured faster (q8_by_default), f32 for the rest.
enum class Dot : int { f32 = 0, q8 = 1, q8_madd = 2, best = 3 };
// The process-wide dot path (psr.store.set_cpu_dot): what a Call / LinearCall built without
// an explicit `dot` uses, the store's CPU hand-off included, so a decode token's CPU experts
// take the same path as the same rows computed from Python (batch, prefill).
Dot default_dot();
void set_default_dot(Dot d);
// The block types whose integer dots beat their fp32 path on `isa` (measured side by side,
// bench/cpu_qdot.py, bench/results/llamacpp/vnni/): the K-quants on AVX-512 and AVX2, Q8_0
// on AVX2 only (on AVX-512 its fp32 GEMM stays ahead); the scalar path: none.
// Tiles: q8 on every path (their own kernels are integer dots; on the f32 path a tile is
// untiled to rows first).
constexpr bool q8_by_default(int type, Isa isa) {
  const bool k = type == ggml_type::Q4_K || type == ggml_type::Q5_K || type == ggml_type::Q6_K;
  return is_tiled_type(type) || (isa == Isa::avx512 && k) ||
         (isa == Isa::avx2 && (k || type == ggml_type::Q8_0));
}

// Where one expert's parts sit in its row (bytes from the row start). Float formats:
// gate [F, H], up [F, H], down [H, F] of `itemsize`-byte elements, rows of H (F) elements.
// Quantized: codes rows of rb_h (rb_f) bytes, fp32 scales [F, H / group_h], [H, F / group_f].
struct Layout {
  Fmt fmt = Fmt::f32;
  int64_t hidden = 0;  // H
  int64_t ffn = 0;     // F
  int64_t gate = 0, up = 0, down = 0;
  int64_t gate_s = 0, up_s = 0, down_s = 0;  // quantized only
  int64_t rb_h = 0, rb_f = 0;                // bytes per gate/up row, per down row
  int64_t group_h = 0, group_f = 0;          // scale groups (elements); = H, F for int8/fp8
  int64_t row_bytes = 0;                     // bytes one expert occupies
  int t_gate = 0, t_up = 0, t_down = 0;      // ggml: each part's block type
  int64_t rb_up = 0;                         // ggml: bytes per up row (rb_h: gate's)
};

struct Call {
  const float* x = nullptr;       // [T, H] fp32, contiguous
  int64_t tokens = 0;             // T
  const uint8_t* rows = nullptr;  // row r at rows + r * row_stride
  int64_t num_rows = 0;
  int64_t row_stride = 0;     // bytes
  const void* ids = nullptr;  // [T, k] int32 or int64 (id_bytes): slots, or expert ids
  int id_bytes = 8;
  int64_t k = 0;
  const void* table = nullptr;  // optional [table_len] expert -> row (int32/int64)
  int table_bytes = 4;
  int64_t table_len = 0;
  // With a table: an expert whose row is -1 is absent (computed elsewhere, e.g. its CPU
  // part of a split) and contributes nothing, weight included; otherwise -1 is an error.
  bool skip_absent = false;
  const float* weights = nullptr;  // [T, k] fp32 gate weights
  float* y = nullptr;              // [T, H] fp32 out
  Act act = Act::swiglu;
  float alpha = 1.702f, limit = 7.0f;  // swiglu_oai
  Dot dot = default_dot();
};

// Validates the layout, the call and every routed row (std::invalid_argument /
// std::out_of_range with a one-line message), then computes y. Thread-safe (calls are
// serialised on the pool). threads in [1, hardware threads].
void expert_ffn(const Layout& lay, const Call& call, int threads, Isa isa);

// A dense linear layer y[t, n] = dot(W[n, :], x[t, :]) (+ bias[n]) with W's rows in a
// float format (Fmt f32 / bf16 / f16) or GGML blocks (Fmt ggml, `type`; Q4_K_X8: N a
// multiple of 8, rows contiguous). Items are blocks
// of N rows; the tokens loop inside each quad of rows (a row read once for all T tokens).
// Each y[t, n] is one row dot product, so rows are bit-identical for any T, any co-rows
// and any thread count (for a given ISA path).
struct LinearCall {
  const float* x = nullptr;     // [T, K] fp32, contiguous
  int64_t tokens = 0;           // T
  int64_t in = 0;               // K
  const uint8_t* w = nullptr;   // row n at w + n * w_stride
  int64_t out = 0;              // N
  int64_t w_stride = 0;         // bytes
  Fmt fmt = Fmt::f32;           // f32, bf16, f16 or ggml
  int type = 0;                 // ggml: the block type
  const float* bias = nullptr;  // optional [N] fp32
  float* y = nullptr;           // [T, N] fp32 out
  Dot dot = default_dot();
};
void linear(const LinearCall& call, int threads, Isa isa);

// Causal (optionally sliding-window, optionally sink) attention, row-invariant by
// construction (attention.cpp): query t at absolute position p = q_start + t attends keys
// j in (p - window, p] (window 0: [0, p]); each (t, head) output is computed by one thread
// from the keys <= p only, in an order that depends on p alone: scores are the path's row
// dots (DotFn / DotsFn on k rows, the query as the input), their max, exp(s - max) (ExpFn)
// summed in 8 partial lanes from the window's first key (then the sink's term), the
// weighted V sum accumulated in key order (WsumFn), then divided by the sum. So a row's
// output is bit-identical whatever T, L, q_start split, other rows or thread count (for a
// given ISA path).
struct AttentionCall {
  const float* q = nullptr;  // [T, Hq, Dk] fp32, contiguous
  int64_t tokens = 0;        // T
  int64_t q_heads = 0;       // Hq (a multiple of Hkv: head h reads kv head h / (Hq / Hkv))
  int64_t dk = 0, dv = 0;
  const uint8_t* k = nullptr;  // key j of kv head g at k + (j * k_sl + g * k_sh) elements
  const uint8_t* v = nullptr;  // value j of kv head g at v + (j * v_sl + g * v_sh) elements
  Fmt k_fmt = Fmt::f32, v_fmt = Fmt::f32;  // f32 / bf16 / f16
  int64_t k_sl = 0, k_sh = 0, v_sl = 0, v_sh = 0;
  int64_t keys = 0;      // L >= q_start + T
  int64_t kv_heads = 0;  // Hkv
  int64_t q_start = 0;
  int64_t window = 0;  // 0: none
  float scale = 1.f;
  const float* sinks = nullptr;  // optional [Hq] fp32 logits (no value)
  float* y = nullptr;            // [T, Hq, Dv] fp32 out
};
void attention(const AttentionCall& call, int threads, Isa isa);
// A decode layer's attention after its projections, in one call: transformers' rotary
// embedding (rotate_half form: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to `fmt` as torch's elementwise ops round them, so the bits are the module's) of
// the T new queries and keys, the keys and values written into the cache at positions
// q_start .. q_start + T - 1 (`call.k` / `call.v` in `fmt`, their strides), then `attention`
// over keys [0, q_start + T). `call.q` is the roped queries' fp32 buffer [T, Hq, Dk]
// (written here).
struct RopeAttentionCall {
  AttentionCall attn;
  Fmt fmt = Fmt::f32;          // the new rows', cos / sin's and the cache's: f32 or bf16
  const void* q_in = nullptr;  // [T, Hq, Dk], contiguous
  const void* k_in = nullptr;  // [T, Hkv, Dk]
  const void* v_in = nullptr;  // [T, Hkv, Dv]
  const void* cos = nullptr;   // [T, Dk] (Dk even)
  const void* sin = nullptr;
};
void rope_attention(const RopeAttentionCall& call, int threads, Isa isa);
// The weighted sum of n rows: out[h * os + e] = sum_{j < n} a[h * as + j] * v_j[e] for
// e < dv, h < na <= kRowInputs (v_j at v + j * vs bytes, widened from its format). Each
// element is accumulated from 0 in key order j = 0, 1, ..., one multiply-add a key (fused
// on the vector paths), so its bits never depend on lanes, blocking or the other heads.
// `resume`: accumulate from out's values instead of 0, so calls over consecutive key blocks
// give the one call's bits (an fp32 accumulator is stored and reloaded exactly).
using WsumFn = void (*)(const uint8_t* v, int64_t vs, int64_t n, int64_t dv, const float* a,
                        int64_t as, int na, float* out, int64_t os, bool resume);
// x[i] = exp(x[i] - m) for i < n, elementwise (an element's value never depends on its
// neighbours or its lane): the scalar path's is std::exp, the vector paths' one polynomial.
using ExpFn = void (*)(float* x, int64_t n, float m);
// The vector paths' exp (Cephes' expf): x = k ln2 + r (ln2 in two parts), e^r ~ 1 + r +
// r^2 P(r) with P's coefficients highest first, times 2^k; 0 under kExpMin.
inline constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f,
                       kExpLn2Lo = -2.12194440e-4f, kExpMin = -87.3f;
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
ExpFn scalar_exp();
ExpFn avx2_exp();    // nullptr where not compiled
ExpFn avx512_exp();  // nullptr where not compiled
WsumFn scalar_wsum(Fmt f);
WsumFn avx2_wsum(Fmt f);    // nullptr where not compiled
WsumFn avx512_wsum(Fmt f);  // nullptr where not compiled
// fn over [0, n) split in `threads` contiguous parts on the kernels' pool, one call at a
// time (threads checked against [1, max_threads()]).
void parallel_run(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn);

// ISA paths this CPU runs, best last (scalar always).
std::vector<Isa> supported_isas();
Isa best_isa();
const char* isa_name(Isa isa);
Isa isa_from_name(const std::string& name);  // "auto" = best_isa()

// STREAM triad a[i] = b[i] + s * c[i] over n floats on the same pool: best bytes/s
// (3 * 4 * n bytes per pass) of `reps` passes.
double triad_bytes_per_s(int64_t n, int threads, int reps);

int max_threads();

// --- per-ISA row kernels (expert_gemv_*.cpp) -------------------------------------------
// Inputs a several-input kernel takes at once (the tokens sharing a weight row).
constexpr int kRowInputs = 4;
// out[r] = sum_{i < n} w_r[i] * v[i] for four rows r (raw codes for quantized formats).
// int4: n counts bytes; byte i holds elements 2i (low nibble, times v[i]) and 2i + 1
// (high nibble, times v2[i]). Rows may repeat; nothing past w_r + (bytes of n) is read.
using DotFn = void (*)(const uint8_t* const w[4], int64_t n, const float* v, const float* v2,
                       float out[4]);
// Four rows against nv <= kRowInputs inputs: out[4 t + r] = DotFn's out[r] of the same path
// on v[t] alone, bit for bit, each chunk of the rows loaded and widened once for all of
// them (f32 / bf16 / f16 / int8 / fp8; nullptr where a path has none: the caller loops).
using DotsFn = void (*)(const uint8_t* const w[4], int64_t n, const float* const* v, int nv,
                        float* out);
DotsFn avx2_dots(Fmt f);    // nullptr where not compiled or for int4
DotsFn avx512_dots(Fmt f);  // nullptr where not compiled or for int4
// The inputs a call of avx2_dots takes best when there are more than kRowInputs (it
// takes up to kRowInputs): AVX2's 16 registers hold 4 rows x 3 inputs of accumulators
// (AVX-512's 32 hold kRowInputs). Measured on Zen 3, BF16 / F16 / F32 4096 x 2048, 6-32
// inputs: 12-30% faster than fours; four inputs alone are no slower in one call.
constexpr int kAvx2DotsInputs = 3;
// int4 with several scale groups: out[r] = sum_g s_r[g] * (partial dot of group g), the
// group sums kept in vector lanes (one horizontal sum per row). gbytes: bytes per group.
using GroupDotFn = void (*)(const uint8_t* const w[4], int64_t ng, int64_t gbytes, const float* v,
                            const float* v2, const float* const s[4], float out[4]);
GroupDotFn avx512_int4_groups();  // nullptr where not compiled
// GGML block rows: sum_k w[k] v[k] over one row of K inputs of block type `type`.
using BlockRowDotFn = float (*)(int type, const uint8_t* row, int64_t K, const float* v);
BlockRowDotFn scalar_ggml_dot();
BlockRowDotFn avx2_ggml_dot();    // nullptr where not compiled
BlockRowDotFn avx512_ggml_dot();  // nullptr where not compiled
// One row against nv <= kRowInputs inputs: out[t] = the BlockRowDotFn of the same path on
// v[t] alone, bit for bit, the row's blocks decoded once for all of them (the tokens of a
// batch sharing a weight row). nullptr where a path has none (the caller loops).
using BlockRowDotsFn = void (*)(int type, const uint8_t* row, int64_t K, const float* const* v,
                                int nv, float* out);
BlockRowDotsFn avx2_ggml_dots();    // nullptr where not compiled
BlockRowDotsFn avx512_ggml_dots();  // nullptr where not compiled
// The tiled GEMM of GGML rows (the block types of g_several_inputs): out[u][r] = the
// path's BlockRowDotFn of row r (at w + r * stride, r < nr) with v[u] (u < nv), bit for
// bit, each row's blocks decoded once per tile of inputs (not once per kRowInputs) and 4
// rows x 4 inputs computed a step. scratch: gemm_scratch_floats(K) floats. nullptr where a
// path has none (the caller runs the row dots: the same bits).
using BlockGemmFn = void (*)(int type, const uint8_t* w, int64_t stride, int64_t K, int64_t nr,
                             const float* const* v, int64_t nv, float* const* out, float* scratch);
BlockGemmFn avx512_ggml_gemm();  // nullptr where not compiled
inline int64_t gemm_scratch_floats(int64_t K) { return 4 * K + 4 * (K / 32); }
int64_t ggml_row_bytes(int type, int64_t K);  // -1: unknown type or K not whole blocks

// --- integer dots on quantized activations (ggml_qdot.h) --------------------------------
// "auto" (Dot::best), "f32", "q8", "q8_madd".
Dot dot_from_name(const std::string& name);
const char* dot_name(Dot d);
bool cpu_has_vnni();
// Bytes of a row of K activations in block type `act` (Q8_K / Q8_0); -1: K not whole blocks.
int64_t act_row_bytes(int act, int64_t K);
// One activation row x[K] quantized to `act` (ggml_qdot.h's rules; every path the same bytes).
using QuantFn = void (*)(int act, const float* x, int64_t K, uint8_t* out);
// Quantized inputs a row kernel takes at once (the weight row's blocks decoded once for them).
constexpr int kQInputs = 8;
// One row of `type` (a vec_dot type's weights) against nv <= kQInputs quantized rows:
// out[t] = the same path's result for xq[t] alone, bit for bit.
using QRowDotsFn = void (*)(int type, const uint8_t* row, int64_t K, const uint8_t* const* xq,
                            int nv, float* out);
QuantFn scalar_quant();
QRowDotsFn scalar_qdots();
QuantFn avx2_quant();                // nullptr where not compiled
QRowDotsFn avx2_qdots();             // nullptr where not compiled
QuantFn avx512_quant();              // nullptr where not compiled
QRowDotsFn avx512_qdots(bool vnni);  // nullptr where not compiled
// --- Q4_K rows interleaved by eights (llama.cpp's repacked GEMV idea, psr's own order) ---
// A tile is 8 consecutive rows of a Q4_K matrix with their super-block b's 8 x 144 bytes
// at b * 1152, permuted so that one 32-byte load holds the same 4 codes of all 8 rows:
//   +0 d[8] fp16, +16 dmin[8] fp16, +32 u0[8], +64 u1[8], +96 u2[8] (row r's 12 scale
//   bytes as three 4-byte words), +128 qs[pair p][chunk c][row r][4] = row r's qs[32 p + 4 c..].
// A row's dot then keeps its sums in its own vector lane: the scales, mins and fp32 steps
// of 8 rows in one instruction each (one row a lane, no horizontal sums): on AVX2 1.67x
// the row-at-a-time kernel from cache, less where memory bounds it
// (bench/results/cpu/tiles_avx2.md).
constexpr int kTileRows = 8;
constexpr int kTileInputs = 4;              // quantized inputs a tile kernel takes at once
constexpr int64_t kQ4KTileBytes = 8 * 144;  // one super-block of a tile
// rows (row r at src + r * stride, rows a multiple of 8, K of whole super-blocks) into
// rows / 8 tiles at dst (rows * K / 256 * 144 bytes).
void tile_q4k(const uint8_t* src, int64_t stride, int64_t rows, int64_t K, uint8_t* dst);
// The inverse for one tile: its 8 rows of K inputs, contiguous, at rows8 (8 x K / 256 x 144).
void untile_q4k(const uint8_t* tile, int64_t K, uint8_t* rows8);
// One tile against nv <= kTileInputs Q8_K rows: out[8 t + r] = row r with input t; every
// path the same fp32 steps (a lane's), so the same bits, for any nv and co-inputs.
using QTileDotsFn = void (*)(const uint8_t* tile, int64_t K, const uint8_t* const* xq, int nv,
                             float* out);
QTileDotsFn scalar_q4k_tiles();
QTileDotsFn avx2_q4k_tiles();  // nullptr where not compiled
DotFn scalar_dot(Fmt f);
DotFn avx2_dot(Fmt f);    // nullptr where not compiled
DotFn avx512_dot(Fmt f);  // nullptr where not compiled

// The row dot of `f` on path `isa` (DotFn; the scalar one where a path has none) and its
// several-input form (nullptr: none), after checking this CPU runs `isa`.
DotFn row_dot(Isa isa, Fmt f);
DotsFn row_dots(Isa isa, Fmt f);
// Scalar decoders shared by the paths' tails.
float bf16_to_f32(uint16_t b);
float f16_to_f32(uint16_t h);
float fp8_e4m3_to_f32(uint8_t c);

}  // namespace psr::cpu
