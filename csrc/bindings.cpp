// Thin pybind11 bindings for psr::Store. Memory is exported as DLPack
// capsules (uint8, [rows, bytes]) that torch.from_dlpack views without a
// copy; each capsule keeps the store alive. The module never links torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "store.h"

namespace py = pybind11;

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
  std::shared_ptr<psr::Store> owner;
  int64_t shape[2];
  int64_t strides[2];
  DLManagedTensor t;
};

void export_deleter(DLManagedTensor* t) { delete static_cast<Export*>(t->manager_ctx); }

py::capsule to_dlpack(std::shared_ptr<psr::Store> store, void* data, int64_t rows, int64_t cols,
                      bool device_memory) {
  auto* e = new Export{std::move(store), {rows, cols}, {cols, 1}, {}};
  psr::Backend& b = e->owner->backend();
  e->t.dl_tensor.data = data;
  e->t.dl_tensor.device = {device_memory ? b.dlpack_device_type() : 1,
                           device_memory ? b.device_index() : 0};
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
  d["failed_copies"] = c.failed_copies;
  d["waits"] = c.waits;
  d["stalled_waits"] = c.stalled_waits;
  d["stall_s"] = static_cast<double>(c.stall_ns) * 1e-9;
  return d;
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

  m.def("cuda_compiled", &psr::cuda_compiled, "True if the CUDA backend was built");
  m.def("cuda_device_count", &psr::cuda_device_count, "CUDA devices usable at run time");
  m.def("cuda_runtime_version", &psr::cuda_runtime_version);
#ifdef PSR_CUDA_ARCHS
  m.attr("cuda_archs") = PSR_CUDA_ARCHS;
#else
  m.attr("cuda_archs") = "";
#endif

  py::class_<psr::Store, std::shared_ptr<psr::Store>>(m, "Store")
      .def(py::init([](const std::vector<std::tuple<int64_t, int64_t, int64_t>>& layers,
                       const std::string& dtype, int64_t itemsize, const std::string& backend,
                       int device, uint32_t copy_delay_us, uint64_t seed) {
             std::vector<psr::LayerSpec> specs;
             for (const auto& l : layers)
               specs.push_back({std::get<0>(l), std::get<1>(l), std::get<2>(l)});
             std::unique_ptr<psr::Backend> b;
             if (backend == "cpu") {
               b = psr::make_cpu_backend(copy_delay_us, seed);
             } else if (backend == "cuda") {
               if (copy_delay_us)
                 throw psr::StoreError("copy-delay fault injection is only available on the CPU backend");
               b = psr::make_cuda_backend(device);
             } else {
               throw std::invalid_argument("unknown backend '" + backend + "' (expected 'cpu' or 'cuda')");
             }
             return std::make_shared<psr::Store>(std::move(specs), dtype, itemsize, std::move(b));
           }),
           py::arg("layers"), py::arg("dtype"), py::arg("itemsize"), py::arg("backend") = "cpu",
           py::arg("device") = 0, py::arg("copy_delay_us") = 0, py::arg("seed") = 0,
           "layers: [(num_experts, num_slots, expert_bytes)] per MoE layer")
      .def_property_readonly("backend", [](psr::Store& s) { return s.backend().name(); })
      .def_property_readonly("device_index", [](psr::Store& s) { return s.backend().device_index(); })
      .def_property_readonly("num_layers", &psr::Store::num_layers)
      .def_property_readonly("dtype", &psr::Store::dtype)
      .def("spec",
           [](const psr::Store& s, int64_t l) {
             const auto& p = s.spec(l);
             return py::make_tuple(p.num_experts, p.num_slots, p.expert_bytes);
           })
      .def("register_expert", &psr::Store::register_expert, py::arg("layer"), py::arg("expert"),
           py::arg("dtype"), py::arg("parts"), py::call_guard<py::gil_scoped_release>(),
           "parts: [(address, nbytes)] copied back to back into the expert's host buffer")
      .def("is_registered", &psr::Store::is_registered)
      .def("load", &psr::Store::load, py::arg("layer"), py::arg("slots"), py::arg("experts"),
           py::call_guard<py::gil_scoped_release>())
      .def("acquire", &psr::Store::acquire, py::arg("layer"), py::arg("slots"),
           py::arg("experts") = std::vector<int64_t>{}, py::arg("stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("release", &psr::Store::release, py::arg("layer"), py::arg("slots"),
           py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("slot_experts", &psr::Store::slot_experts)
      .def("readers", &psr::Store::readers)
      .def("ready", &psr::Store::ready)
      .def("verify", &psr::Store::verify, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &psr::Store::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("counters", [](psr::Store& s) { return counters_dict(s.counters()); })
      .def("reset_counters", &psr::Store::reset_counters)
      .def("set_copy_delay",
           [](psr::Store& s, uint32_t us, uint64_t seed) { s.backend().set_copy_delay(us, seed); })
      .def("fail_next_copies", [](psr::Store& s, int64_t n) { s.backend().fail_next_copies(n); })
      .def("slab_dlpack",
           [](std::shared_ptr<psr::Store> s, int64_t l) {
             const auto& p = s->spec(l);
             void* ptr = s->slab_ptr(l);
             return to_dlpack(std::move(s), ptr, p.num_slots, p.expert_bytes, true);
           })
      .def("host_dlpack", [](std::shared_ptr<psr::Store> s, int64_t l) {
        const auto& p = s->spec(l);
        void* ptr = s->host_ptr(l);
        return to_dlpack(std::move(s), ptr, p.num_experts, p.expert_bytes, false);
      });
}
