// Thin pybind11 bindings for psr::Store. Memory is exported as DLPack
// capsules (uint8, [rows, bytes]) that torch.from_dlpack views without a
// copy; each capsule keeps its buffer (not the store) alive, so a view stays
// valid after Store.close(). Every method that locks releases the GIL. The
// module never links torch. The CPU expert kernels (cpu/expert_gemv.h) take raw
// addresses of tensors the caller keeps alive and checked (psr.store).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>

#include "cpu/expert_gemv.h"
#include "store.h"

namespace py = pybind11;

namespace psr::cpu {
void bind_router(py::module_& m);  // cpu/router.cpp: the CPU decode step's cache `use`
void bind_norm(py::module_& m);    // cpu/norm.cpp: RMS norm rows
}  // namespace psr::cpu

namespace {

// DLPack ABI (dlpack.h, v0.x "dltensor" capsules), declared here to avoid a
// header dependency.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

struct Export {
  std::shared_ptr<void> buffer;
  int64_t shape[2];
  int64_t strides[2];
  DLManagedTensor t;
};

void export_deleter(DLManagedTensor* t) { delete static_cast<Export*>(t->manager_ctx); }

py::capsule to_dlpack(const psr::Store& store, std::shared_ptr<void> buffer, int64_t rows,
                      int64_t cols, bool device_memory) {
  auto* e = new Export{std::move(buffer), {rows, cols}, {cols, 1}, {}};
  e->t.dl_tensor.data = e->buffer.get();
  e->t.dl_tensor.device = {device_memory ? store.dlpack_device_type() : 1,
                           device_memory ? store.device_index() : 0};
  e->t.dl_tensor.ndim = 2;
  e->t.dl_tensor.dtype = {1 /* kDLUInt */, 8, 1};
  e->t.dl_tensor.shape = e->shape;
  e->t.dl_tensor.strides = e->strides;
  e->t.dl_tensor.byte_offset = 0;
  e->t.manager_ctx = e;
  e->t.deleter = export_deleter;
  return py::capsule(&e->t, "dltensor", [](PyObject* cap) {
    // Consumers rename the capsule to "used_dltensor"; free only if unused.
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      t->deleter(t);
    }
  });
}

py::dict counters_dict(const psr::Counters& c) {
  py::dict d;
  d["copies"] = c.copies;
  d["bytes_copied"] = c.bytes_copied;
  d["retried_copies"] = c.retried_copies;
  d["failed_copies"] = c.failed_copies;
  d["waits"] = c.waits;
  d["stalled_waits"] = c.stalled_waits;
  d["stall_s"] = static_cast<double>(c.stall_ns) * 1e-9;
  d["stall_pageable_s"] = static_cast<double>(c.stall_pageable_ns) * 1e-9;
  d["bytes_pinned"] = c.bytes_pinned;
  d["bytes_pageable"] = c.bytes_pageable;
  d["bytes_page_cache"] = c.bytes_page_cache;
  d["bytes_disk"] = c.bytes_disk;
  d["read_errors"] = c.read_errors;
  d["cpu_tasks"] = c.cpu_tasks;
  d["cpu_task_experts"] = c.cpu_task_experts;
  d["cpu_task_s"] = static_cast<double>(c.cpu_task_ns) * 1e-9;
  return d;
}

// csrc/cpu/expert_gemv.h's `Layout` as psr_kernels.rowformat.CpuLayout writes it: one
// integer per field, in this order (`cpu_layout_fields` names them for the table test).
struct LayoutField {
  const char* name;
  void (*set)(psr::cpu::Layout&, int64_t);
};
using L_ = psr::cpu::Layout;
constexpr LayoutField kLayoutFields[] = {
    {"fmt", [](L_& L, int64_t v) { L.fmt = static_cast<psr::cpu::Fmt>(v); }},
    {"hidden", [](L_& L, int64_t v) { L.hidden = v; }},
    {"ffn", [](L_& L, int64_t v) { L.ffn = v; }},
    {"gate", [](L_& L, int64_t v) { L.gate = v; }},
    {"up", [](L_& L, int64_t v) { L.up = v; }},
    {"down", [](L_& L, int64_t v) { L.down = v; }},
    {"gate_s", [](L_& L, int64_t v) { L.gate_s = v; }},
    {"up_s", [](L_& L, int64_t v) { L.up_s = v; }},
    {"down_s", [](L_& L, int64_t v) { L.down_s = v; }},
    {"rb_h", [](L_& L, int64_t v) { L.rb_h = v; }},
    {"rb_f", [](L_& L, int64_t v) { L.rb_f = v; }},
    {"group_h", [](L_& L, int64_t v) { L.group_h = v; }},
    {"group_f", [](L_& L, int64_t v) { L.group_f = v; }},
    {"row_bytes", [](L_& L, int64_t v) { L.row_bytes = v; }},
    // GGML blocks only: each part's type, up's row bytes
    {"t_gate", [](L_& L, int64_t v) { L.t_gate = static_cast<int>(v); }},
    {"t_up", [](L_& L, int64_t v) { L.t_up = static_cast<int>(v); }},
    {"t_down", [](L_& L, int64_t v) { L.t_down = static_cast<int>(v); }},
    {"rb_up", [](L_& L, int64_t v) { L.rb_up = v; }},
};
constexpr size_t kLayoutInts = 14;  // float / int8 / fp8 / int4; all 18 for GGML blocks

// The CPU kernels' layout from the 14 (float / int8 / fp8 / int4) or 18 (GGML) integers
// psr.store._cpu_layout writes.
psr::cpu::Layout cpu_layout(const std::vector<int64_t>& layout, const char* op) {
  if (layout.size() != kLayoutInts && layout.size() != std::size(kLayoutFields))
    throw std::invalid_argument(std::string(op) + ": layout must hold 14 (or 18) integers");
  psr::cpu::Layout L;
  for (size_t i = 0; i < layout.size(); ++i) kLayoutFields[i].set(L, layout[i]);
  return L;
}

// One AttentionCall from the bindings' addresses and sizes (cpu_attention, cpu_rope_attention).
psr::cpu::AttentionCall attention_call(uintptr_t q, int64_t tokens, int64_t q_heads, int64_t dk,
                                       int64_t dv, uintptr_t k, int k_fmt, int64_t k_sl,
                                       int64_t k_sh, uintptr_t v, int v_fmt, int64_t v_sl,
                                       int64_t v_sh, int64_t keys, int64_t kv_heads,
                                       int64_t q_start, int64_t window, float scale,
                                       uintptr_t sinks, uintptr_t y) {
  psr::cpu::AttentionCall c;
  c.q = reinterpret_cast<const float*>(q);
  c.tokens = tokens;
  c.q_heads = q_heads;
  c.dk = dk;
  c.dv = dv;
  c.k = reinterpret_cast<const uint8_t*>(k);
  c.v = reinterpret_cast<const uint8_t*>(v);
  c.k_fmt = static_cast<psr::cpu::Fmt>(k_fmt);
  c.v_fmt = static_cast<psr::cpu::Fmt>(v_fmt);
  c.k_sl = k_sl;
  c.k_sh = k_sh;
  c.v_sl = v_sl;
  c.v_sh = v_sh;
  c.keys = keys;
  c.kv_heads = kv_heads;
  c.q_start = q_start;
  c.window = window;
  c.scale = scale;
  c.sinks = reinterpret_cast<const float*>(sinks);
  c.y = reinterpret_cast<float*>(y);
  return c;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "psr expert store (C++): pinned host experts, device slot slab, async copy engine";
  static py::exception<psr::StoreError> store_error(m, "StoreError", PyExc_RuntimeError);
  static py::exception<psr::CopyError> copy_error(m, "CopyError", store_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const psr::CopyError& e) {
      py::set_error(copy_error, e.what());
    } catch (const psr::StoreError& e) {
      py::set_error(store_error, e.what());
    }
  });

  m.attr("max_copy_retries") = psr::Store::kMaxCopyRetries;
  m.def("cuda_compiled", &psr::cuda_compiled, "True if the CUDA backend was built");
  m.def("cuda_device_count", &psr::cuda_device_count, "CUDA devices usable at run time");
  m.def("cuda_runtime_version", &psr::cuda_runtime_version);
#ifdef PSR_CUDA_ARCHS
  m.attr("cuda_archs") = PSR_CUDA_ARCHS;
#else
  m.attr("cuda_archs") = "";
#endif

  using release_gil = py::call_guard<py::gil_scoped_release>;

  m.def(
      "cpu_isas",
      [] {
        std::vector<std::string> out;
        for (auto i : psr::cpu::supported_isas()) out.emplace_back(psr::cpu::isa_name(i));
        return out;
      },
      "ISA paths of the CPU expert kernels this CPU runs, best last");
  m.def("cpu_max_threads", &psr::cpu::max_threads, "hardware threads (the kernels' cap)");
  m.def(
      "cpu_layout_fields",
      [] {
        std::vector<std::string> out;
        for (const auto& f : kLayoutFields) out.emplace_back(f.name);
        return out;
      },
      "the CPU kernels' Layout fields, in the order cpu_expert_ffn's layout gives them");
  m.def(
      "cpu_formats",
      [] {
        std::vector<std::pair<std::string, int>> out;
        for (const auto& f : psr::cpu::kFmtTraits)
          out.emplace_back(f.name, static_cast<int>(f.fmt));
        return out;
      },
      "the CPU kernels' expert formats: (name, Fmt code)");
  m.def(
      "ggml_type_traits",
      [] {
        std::vector<std::tuple<std::string, int, int, int, int>> out;
        for (const auto& t : psr::cpu::kTypeTraits)
          out.emplace_back(t.name, t.id, t.block_len, t.block_bytes, t.vec_dot);
        return out;
      },
      "the CPU kernels' GGML block types: (name, type id, block_len, block_bytes, vec_dot)");
  m.def(
      "cpu_quantize_act",
      [](int act, uintptr_t x, int64_t n, uintptr_t out, const std::string& isa) {
        const int64_t rb = psr::cpu::act_row_bytes(act, n);
        if (rb < 0)
          throw std::invalid_argument("cpu_quantize_act: activation type " + std::to_string(act) +
                                      " is not Q8_K / Q8_0 or " + std::to_string(n) +
                                      " values are not whole blocks");
        const psr::cpu::Isa i = psr::cpu::isa_from_name(isa);
        psr::cpu::QuantFn q = i == psr::cpu::Isa::avx512 ? psr::cpu::avx512_quant()
                              : i == psr::cpu::Isa::avx2 ? psr::cpu::avx2_quant()
                                                         : nullptr;
        if (!q) q = psr::cpu::scalar_quant();
        q(act, reinterpret_cast<const float*>(x), n, reinterpret_cast<uint8_t*>(out));
      },
      py::arg("act"), py::arg("x"), py::arg("n"), py::arg("out"), py::arg("isa"), release_gil(),
      "One activation row quantized to Q8_K / Q8_0 (the q8 path's bytes) on ISA path `isa`");
  m.def("cpu_has_vnni", &psr::cpu::cpu_has_vnni, "whether this CPU has AVX-512 VNNI");
  m.def(
      "set_cpu_dot",
      [](const std::string& dot) { psr::cpu::set_default_dot(psr::cpu::dot_from_name(dot)); },
      "the process-wide dot path of calls without their own (the store's CPU hand-off)");
  m.def(
      "cpu_expert_ffn",
      [](const std::vector<int64_t>& layout, uintptr_t x, int64_t tokens, uintptr_t rows,
         int64_t num_rows, int64_t row_stride, uintptr_t ids, int id_bytes, int64_t k,
         uintptr_t table, int table_bytes, int64_t table_len, uintptr_t weights, uintptr_t y,
         int threads, const std::string& isa, int act, float alpha, float limit, bool skip_absent,
         const std::string& dot) {
        const psr::cpu::Layout L = cpu_layout(layout, "cpu_expert_ffn");
        psr::cpu::Call c;
        c.x = reinterpret_cast<const float*>(x);
        c.tokens = tokens;
        c.rows = reinterpret_cast<const uint8_t*>(rows);
        c.num_rows = num_rows;
        c.row_stride = row_stride;
        c.ids = reinterpret_cast<const void*>(ids);
        c.id_bytes = id_bytes;
        c.k = k;
        c.table = reinterpret_cast<const void*>(table);
        c.table_bytes = table_bytes;
        c.table_len = table_len;
        c.weights = reinterpret_cast<const float*>(weights);
        c.y = reinterpret_cast<float*>(y);
        c.act = static_cast<psr::cpu::Act>(act);
        c.alpha = alpha;
        c.limit = limit;
        c.skip_absent = skip_absent;
        const psr::cpu::Isa i = psr::cpu::isa_from_name(isa);
        c.dot = psr::cpu::dot_from_name(dot);
        psr::cpu::expert_ffn(L, c, threads, i);
      },
      py::arg("layout"), py::arg("x"), py::arg("tokens"), py::arg("rows"), py::arg("num_rows"),
      py::arg("row_stride"), py::arg("ids"), py::arg("id_bytes"), py::arg("k"), py::arg("table"),
      py::arg("table_bytes"), py::arg("table_len"), py::arg("weights"), py::arg("y"),
      py::arg("threads"), py::arg("isa"), py::arg("act"), py::arg("alpha"), py::arg("limit"),
      py::arg("skip_absent") = false, py::arg("dot") = "f32", release_gil(),
      "Routed experts of x read in place from packed rows (addresses of live, checked tensors)");
  m.def(
      "cpu_linear",
      [](uintptr_t x, int64_t tokens, int64_t in, uintptr_t w, int64_t out, int64_t w_stride,
         int fmt, int type, uintptr_t bias, uintptr_t y, int threads, const std::string& isa,
         const std::string& dot) {
        psr::cpu::LinearCall c;
        c.x = reinterpret_cast<const float*>(x);
        c.tokens = tokens;
        c.in = in;
        c.w = reinterpret_cast<const uint8_t*>(w);
        c.out = out;
        c.w_stride = w_stride;
        c.fmt = static_cast<psr::cpu::Fmt>(fmt);
        c.type = type;
        c.bias = reinterpret_cast<const float*>(bias);
        c.y = reinterpret_cast<float*>(y);
        const psr::cpu::Isa i = psr::cpu::isa_from_name(isa);
        c.dot = psr::cpu::dot_from_name(dot);
        psr::cpu::linear(c, threads, i);
      },
      py::arg("x"), py::arg("tokens"), py::arg("in_features"), py::arg("weight"),
      py::arg("out_features"), py::arg("row_stride"), py::arg("fmt"), py::arg("ggml_type"),
      py::arg("bias"), py::arg("y"), py::arg("threads"), py::arg("isa"), py::arg("dot") = "f32",
      release_gil(),
      "Batch-invariant dense linear y = x W^T (+ bias) from float or GGML rows (addresses of "
      "live, checked tensors)");
  m.def(
      "cpu_tile_q4k",
      [](uintptr_t src, int64_t stride, int64_t rows, int64_t k, uintptr_t dst) {
        psr::cpu::tile_q4k(reinterpret_cast<const uint8_t*>(src), stride, rows, k,
                           reinterpret_cast<uint8_t*>(dst));
      },
      py::arg("src"), py::arg("row_stride"), py::arg("rows"), py::arg("k"), py::arg("dst"),
      release_gil(),
      "Q4_K rows (rows a multiple of 8) into the CPU kernels' tiles of 8 (addresses of live, "
      "checked tensors)");
  m.def(
      "cpu_attention",
      [](uintptr_t q, int64_t tokens, int64_t q_heads, int64_t dk, uintptr_t k, int k_fmt,
         int64_t k_sl, int64_t k_sh, uintptr_t v, int v_fmt, int64_t v_sl, int64_t v_sh, int64_t dv,
         int64_t keys, int64_t kv_heads, int64_t q_start, int64_t window, float scale,
         uintptr_t sinks, uintptr_t y, int threads, const std::string& isa) {
        const psr::cpu::AttentionCall c =
            attention_call(q, tokens, q_heads, dk, dv, k, k_fmt, k_sl, k_sh, v, v_fmt, v_sl, v_sh,
                           keys, kv_heads, q_start, window, scale, sinks, y);
        psr::cpu::attention(c, threads, psr::cpu::isa_from_name(isa));
      },
      py::arg("q"), py::arg("tokens"), py::arg("q_heads"), py::arg("dk"), py::arg("k"),
      py::arg("k_fmt"), py::arg("k_sl"), py::arg("k_sh"), py::arg("v"), py::arg("v_fmt"),
      py::arg("v_sl"), py::arg("v_sh"), py::arg("dv"), py::arg("keys"), py::arg("kv_heads"),
      py::arg("q_start"), py::arg("window"), py::arg("scale"), py::arg("sinks"), py::arg("y"),
      py::arg("threads"), py::arg("isa"), release_gil(),
      "Row-invariant causal attention (window, sinks) from float k / v rows (addresses of "
      "live, checked tensors; strides in elements)");
  m.def(
      "cpu_rope_attention",
      [](int fmt, uintptr_t q_in, uintptr_t k_in, uintptr_t v_in, uintptr_t cos, uintptr_t sin,
         uintptr_t q, int64_t tokens, int64_t q_heads, int64_t dk, uintptr_t k, int64_t k_sl,
         int64_t k_sh, uintptr_t v, int64_t v_sl, int64_t v_sh, int64_t dv, int64_t kv_heads,
         int64_t q_start, int64_t window, float scale, uintptr_t sinks, uintptr_t y, int threads,
         const std::string& isa) {
        psr::cpu::RopeAttentionCall r;
        r.attn = attention_call(q, tokens, q_heads, dk, dv, k, fmt, k_sl, k_sh, v, fmt, v_sl, v_sh,
                                q_start + tokens, kv_heads, q_start, window, scale, sinks, y);
        r.fmt = static_cast<psr::cpu::Fmt>(fmt);
        r.q_in = reinterpret_cast<const void*>(q_in);
        r.k_in = reinterpret_cast<const void*>(k_in);
        r.v_in = reinterpret_cast<const void*>(v_in);
        r.cos = reinterpret_cast<const void*>(cos);
        r.sin = reinterpret_cast<const void*>(sin);
        psr::cpu::rope_attention(r, threads, psr::cpu::isa_from_name(isa));
      },
      py::arg("fmt"), py::arg("q_in"), py::arg("k_in"), py::arg("v_in"), py::arg("cos"),
      py::arg("sin"), py::arg("q"), py::arg("tokens"), py::arg("q_heads"), py::arg("dk"),
      py::arg("k"), py::arg("k_sl"), py::arg("k_sh"), py::arg("v"), py::arg("v_sl"),
      py::arg("v_sh"), py::arg("dv"), py::arg("kv_heads"), py::arg("q_start"), py::arg("window"),
      py::arg("scale"), py::arg("sinks"), py::arg("y"), py::arg("threads"), py::arg("isa"),
      release_gil(),
      "Rotary embedding of new queries and keys, keys and values written into a float32 / "
      "bfloat16 cache at q_start.., then row-invariant attention over it (addresses of live, "
      "checked tensors; strides in elements)");
  psr::cpu::bind_router(m);
  psr::cpu::bind_norm(m);
  m.def("cpu_triad", &psr::cpu::triad_bytes_per_s, py::arg("n"), py::arg("threads"),
        py::arg("reps"), release_gil(),
        "STREAM triad on the kernels' thread pool: best bytes/s (12 n bytes per pass)");
  py::class_<psr::Store, std::shared_ptr<psr::Store>>(m, "Store")
      .def(py::init([](const std::vector<std::tuple<int64_t, int64_t, int64_t>>& layers,
                       const std::string& dtype, int64_t itemsize, const std::string& backend,
                       int device, uint32_t copy_delay_us, uint64_t seed, int copy_retries,
                       const std::vector<int64_t>& held) {
             if (!held.empty() && held.size() != layers.size())
               throw std::invalid_argument("held: one count per layer");
             std::vector<psr::LayerSpec> specs;
             for (size_t i = 0; i < layers.size(); ++i) {
               const auto& l = layers[i];
               specs.push_back(
                   {std::get<0>(l), std::get<1>(l), std::get<2>(l), held.empty() ? -1 : held[i]});
             }
             std::unique_ptr<psr::Backend> b;
             if (backend == "cpu") {
               b = psr::make_cpu_backend(copy_delay_us, seed);
             } else if (backend == "cuda") {
               if (copy_delay_us)
                 throw psr::StoreError(
                     "copy-delay fault injection is only available on the CPU backend");
               b = psr::make_cuda_backend(device);
             } else {
               throw std::invalid_argument("unknown backend '" + backend +
                                           "' (expected 'cpu' or 'cuda')");
             }
             return std::make_shared<psr::Store>(std::move(specs), dtype, itemsize, std::move(b),
                                                 copy_retries);
           }),
           py::arg("layers"), py::arg("dtype"), py::arg("itemsize"), py::arg("backend") = "cpu",
           py::arg("device") = 0, py::arg("copy_delay_us") = 0, py::arg("seed") = 0,
           py::arg("copy_retries") = 2, py::arg("held") = std::vector<int64_t>{},
           "layers: [(num_experts, num_slots, expert_bytes)] per MoE layer; held: rows each "
           "layer keeps in host memory (empty: all)")
      .def_property_readonly("backend", &psr::Store::backend_name)
      .def_property_readonly("device_index", &psr::Store::device_index)
      .def_property_readonly("num_layers", &psr::Store::num_layers)
      .def_property_readonly("dtype", &psr::Store::dtype)
      .def_property_readonly("copy_retries", &psr::Store::copy_retries)
      .def_property_readonly("closed", py::cpp_function(&psr::Store::closed, release_gil()))
      .def(
          "spec",
          [](const psr::Store& s, int64_t l) {
            psr::LayerSpec p;
            {
              py::gil_scoped_release r;
              p = s.spec(l);
            }
            return py::make_tuple(p.num_experts, p.num_slots, p.expert_bytes);
          },
          py::arg("layer"))
      .def("register_expert", &psr::Store::register_expert, py::arg("layer"), py::arg("expert"),
           py::arg("dtype"), py::arg("parts"), release_gil(),
           "parts: [(address, nbytes)] copied back to back into the expert's host buffer")
      .def("is_registered", &psr::Store::is_registered, py::arg("layer"), py::arg("expert"),
           release_gil())
      .def("register_pageable", &psr::Store::register_pageable, py::arg("layer"), py::arg("expert"),
           py::arg("segments"), release_gil(),
           "segments: [(path, offset, nbytes, tensor)] of checkpoint files (path '': zeros)")
      .def("host_rows", &psr::Store::host_rows, py::arg("layer"), release_gil(),
           "per expert: its row in host memory, -1 for a pageable expert")
      .def("read_row", &psr::Store::read_row, py::arg("layer"), py::arg("expert"), py::arg("dst"),
           release_gil(), "read a pageable expert's row into dst")
      .def("enqueue_copies", &psr::Store::enqueue_copies, py::arg("layer"), py::arg("slots"),
           py::arg("experts"), release_gil())
      .def("acquire", &psr::Store::acquire, py::arg("layer"), py::arg("slots"),
           py::arg("experts") = std::vector<int64_t>{}, py::arg("stream") = 0, release_gil())
      .def("release", &psr::Store::release, py::arg("layer"), py::arg("slots"),
           py::arg("stream") = 0, release_gil())
      .def("gather", &psr::Store::gather, py::arg("layer"), py::arg("rows"), py::arg("count"),
           py::arg("max_rows"), py::arg("side"), py::arg("stream") = 0, release_gil(),
           "rows/count: device addresses of an int32 copy list [(slot, expert, kind)] and its "
           "count, read when the copy runs")
      .def("join", &psr::Store::join, py::arg("layer"), py::arg("stream") = 0, release_gil())
      .def("adopt_slots", &psr::Store::adopt_slots, py::arg("layer"), py::arg("experts"),
           py::arg("stream") = 0, release_gil())
      .def(
          "cpu_experts_setup",
          [](psr::Store& s, int64_t layer, const std::vector<int64_t>& layout, int threads, int act,
             float alpha, float limit, int x_dtype, int w_dtype, int id_bytes, int64_t top_k) {
            const psr::cpu::Layout L = cpu_layout(layout, "cpu_experts_setup");
            if (act < 0 || act > 1)
              throw std::invalid_argument("cpu_experts_setup: unknown activation code " +
                                          std::to_string(act));
            py::gil_scoped_release r;
            s.cpu_experts_setup(layer, L, threads, static_cast<psr::cpu::Act>(act), alpha, limit,
                                x_dtype, w_dtype, id_bytes, top_k);
          },
          py::arg("layer"), py::arg("layout"), py::arg("threads"), py::arg("act"), py::arg("alpha"),
          py::arg("limit"), py::arg("x_dtype"), py::arg("w_dtype"), py::arg("id_bytes"),
          py::arg("top_k"))
      .def("cpu_experts", &psr::Store::cpu_experts, py::arg("layer"), py::arg("x"), py::arg("ids"),
           py::arg("weights"), py::arg("list"), py::arg("y"), py::arg("stream") = 0, release_gil())
      .def("cpu_join", &psr::Store::cpu_join, py::arg("layer"), py::arg("stream") = 0,
           release_gil())
      .def("cpu_check", &psr::Store::cpu_check, release_gil())
      .def("slot_experts", &psr::Store::slot_experts, py::arg("layer"), release_gil())
      .def("readers", &psr::Store::readers, py::arg("layer"), release_gil())
      .def("ready", &psr::Store::ready, py::arg("layer"), release_gil())
      .def("verify", &psr::Store::verify, py::arg("layer"), py::arg("slot"), release_gil())
      .def("synchronize", &psr::Store::synchronize, release_gil())
      .def("counters",
           [](psr::Store& s) {
             psr::Counters c;
             {
               py::gil_scoped_release r;
               c = s.counters();
             }
             return counters_dict(c);
           })
      .def("reset_counters", &psr::Store::reset_counters, release_gil())
      .def("set_copy_delay", &psr::Store::set_copy_delay, py::arg("max_delay_us"),
           py::arg("seed") = 0, release_gil())
      .def("fail_next_copies", &psr::Store::fail_next_copies, py::arg("n"), release_gil())
      .def("close", &psr::Store::close, release_gil(),
           "Finish queued copies, stop the copy engine, drop the store's memory (views keep "
           "theirs). Idempotent.")
      .def(
          "slab_dlpack",
          [](const psr::Store& s, int64_t l) {
            std::shared_ptr<void> buf;
            psr::LayerSpec p;
            {
              py::gil_scoped_release r;
              p = s.spec(l);
              buf = s.slab_buffer(l);
            }
            return to_dlpack(s, std::move(buf), p.num_slots, p.expert_bytes, true);
          },
          py::arg("layer"))
      .def(
          "host_dlpack",
          [](const psr::Store& s, int64_t l) {
            std::shared_ptr<void> buf;
            psr::LayerSpec p;
            {
              py::gil_scoped_release r;
              p = s.spec(l);
              buf = s.host_buffer(l);
            }
            return to_dlpack(s, std::move(buf), p.num_held, p.expert_bytes, false);
          },
          py::arg("layer"));
}
