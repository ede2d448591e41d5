#pragma once
#include <new>
#include <string>

namespace psr {
// std::bad_alloc with a message (pybind11 turns it into MemoryError(what())).
class AllocError : public std::bad_alloc {
 public:
  explicit AllocError(std::string msg) : msg_(std::move(msg)) {}
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  std::string msg_;
};
}  // namespace psr
