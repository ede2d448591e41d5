// RMS norm rows on the CPU (issue 39: transformers' RMSNorm is ~7 torch ops, ~50 us a call
// at batch 1, 4-5 calls per decoder layer). y = w * (x * 1 / sqrt(mean(x^2) + eps)) in fp32,
// as transformers' Llama-style RMS norms compute it for fp32 inputs. Each row is reduced by
// the same fixed-order loop (kLanes partial sums, then the lanes in order), so a row's bits
// depend on the row alone: any number of rows, any row stride, any CPU (no ISA dispatch:
// the compiler vectorises the lanes without reordering them).
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace py = pybind11;

namespace psr::cpu {
namespace {

constexpr int kLanes = 16;

void rms_norm(const float* x, int64_t rows, int64_t n, int64_t x_stride, const float* w, float eps,
              float* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    float lane[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lane[l] += xr[i + l] * xr[i + l];
    for (int l = 0; i < n; ++i, ++l) lane[l] += xr[i] * xr[i];
    float sum = 0.0f;
    for (float v : lane) sum += v;
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

}  // namespace

void bind_norm(py::module_& m) {
  m.def(
      "cpu_rms_norm",
      [](uintptr_t x, int64_t rows, int64_t n, int64_t x_stride, uintptr_t w, float eps,
         uintptr_t y, int64_t y_stride) {
        if (rows < 0 || n < 1 || x_stride < n || y_stride < n)
          throw std::invalid_argument("cpu_rms_norm: rows >= 0, n >= 1, strides >= n");
        if (rows > 0 && (!x || !w || !y)) throw std::invalid_argument("cpu_rms_norm: null address");
        py::gil_scoped_release release;
        rms_norm(reinterpret_cast<const float*>(x), rows, n, x_stride,
                 reinterpret_cast<const float*>(w), eps, reinterpret_cast<float*>(y), y_stride);
      },
      py::arg("x"), py::arg("rows"), py::arg("n"), py::arg("x_stride"), py::arg("weight"),
      py::arg("eps"), py::arg("y"), py::arg("y_stride"),
      "RMS norm of float32 rows, each by one fixed-order loop (addresses of live, checked "
      "tensors; psr.store.cpu_rms_norm)");
}

}  // namespace psr::cpu
