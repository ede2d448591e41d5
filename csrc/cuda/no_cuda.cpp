// Stubs linked when the CUDA backend is not built (PSR_SKIP_CUDA_BUILD=1 or no nvcc).
#include "../store.h"

namespace psr {
bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
int cuda_runtime_version() { return 0; }
std::unique_ptr<Backend> make_cuda_backend(int) {
  throw StoreError("psr was built without the CUDA backend (no nvcc, or PSR_SKIP_CUDA_BUILD=1)");
}
}  // namespace psr
