// The pageable reader: checkpoint files opened once and mapped read-only (`FileSet`), rows
// registered as file segments and read with pread (see store.h).
#include "store.h"

#include "alloc_error.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <sstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace psr {

// --- FileSet -------------------------------------------------------------------

FileSet::~FileSet() {
  for (File& f : files_) {
    if (f.map) munmap(f.map, f.size);
    if (f.fd >= 0) ::close(f.fd);
  }
}

int32_t FileSet::add(const std::string& path) {
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < files_.size(); ++i)
    if (files_[i].path == path) return static_cast<int32_t>(i);
  File f;
  f.path = path;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0)
    throw StoreError("cannot open checkpoint file " + path + ": " + std::strerror(errno));
  struct stat st{};
  if (fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(f.fd);
    throw StoreError("checkpoint file " + path + " is not a regular file" +
                     (err ? std::string(": ") + std::strerror(err) : std::string()));
  }
  f.size = static_cast<uint64_t>(st.st_size);
  if (f.size > 0) {
    f.map = mmap(nullptr, f.size, PROT_READ, MAP_SHARED, f.fd, 0);
    if (f.map == MAP_FAILED) {
      const int err = errno;
      ::close(f.fd);
      throw StoreError("cannot memory-map checkpoint file " + path + " (its filesystem may not " +
                       "support mmap): " + std::strerror(err));
    }
  }
  files_.push_back(f);
  return static_cast<int32_t>(files_.size() - 1);
}

uint64_t FileSet::size(int32_t file) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(file)).size;
}

const std::string& FileSet::path(int32_t file) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(file)).path;
}

namespace {
const uint64_t kPage = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));

// Resident bytes of [off, off + n) of a mapped file (pages counted partially at the ends).
uint64_t resident_bytes(void* map, uint64_t size, uint64_t off, uint64_t n) {
  if (!map || n == 0 || off >= size) return 0;
  const uint64_t end = std::min(off + n, size);
  const uint64_t first = off / kPage, last = (end + kPage - 1) / kPage;
  std::vector<unsigned char> vec(last - first);
  char* base = static_cast<char*>(map) + first * kPage;
  if (mincore(base, (last - first) * kPage, vec.data()) != 0) return 0;
  uint64_t r = 0;
  for (uint64_t p = first; p < last; ++p) {
    if (!(vec[p - first] & 1)) continue;
    const uint64_t a = std::max(off, p * kPage), b = std::min(end, (p + 1) * kPage);
    r += b - a;
  }
  return r;
}
}  // namespace

FileSet::File FileSet::file(int32_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  return files_.at(static_cast<size_t>(i));
}

uint64_t FileSet::resident(const PageableRow& row) const {
  uint64_t r = 0;
  for (const Segment& s : row) {
    if (s.file < 0) continue;
    const File f = file(s.file);
    r += resident_bytes(f.map, f.size, s.offset, s.bytes);
  }
  return r;
}

void FileSet::readahead(const PageableRow& row) const {
  for (const Segment& s : row)
    if (s.file >= 0)
      posix_fadvise(file(s.file).fd, static_cast<off_t>(s.offset), static_cast<off_t>(s.bytes),
                    POSIX_FADV_WILLNEED);
}

std::string FileSet::read(const PageableRow& row, void* dst, TierBytes& t, int64_t given) const {
  char* out = static_cast<char*>(dst);
  uint64_t total = 0, cached = given >= 0 ? static_cast<uint64_t>(given) : 0;
  for (const Segment& s : row) {
    if (s.file < 0) {
      std::memset(out, 0, s.bytes);
      out += s.bytes;
      continue;
    }
    const File f = file(s.file);
    if (given < 0) cached += resident_bytes(f.map, f.size, s.offset, s.bytes);
    uint64_t done = 0;
    while (done < s.bytes) {
      const ssize_t n =
          pread(f.fd, out + done, s.bytes - done, static_cast<off_t>(s.offset + done));
      if (n > 0) {
        done += static_cast<uint64_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      std::ostringstream m;
      m << "reading " << f.path << " tensor '" << s.tensor << "' (bytes " << s.offset << ".."
        << s.offset + s.bytes << "): "
        << (n == 0 ? "the file ends at byte " + std::to_string(s.offset + done) + " (truncated?)"
                   : std::string(std::strerror(errno)));
      t.read_errors += 1;
      return m.str();
    }
    out += s.bytes;
    total += s.bytes;
  }
  t.pageable += total;
  t.page_cache += cached;
  t.disk += total - cached;
  return "";
}

void Store::register_pageable(
    int64_t layer, int64_t expert,
    const std::vector<std::tuple<std::string, uint64_t, uint64_t, std::string>>& segs) {
  auto live = hold_open("register_pageable");
  // Files are opened before the lock (a slow filesystem does not block copies).
  PageableRow row;
  uint64_t total = 0;
  for (const auto& sg : segs) {
    Segment s;
    s.offset = std::get<1>(sg);
    s.bytes = std::get<2>(sg);
    s.tensor = std::get<3>(sg);
    if (!std::get<0>(sg).empty()) {
      s.file = files_.add(std::get<0>(sg));
      const uint64_t size = files_.size(s.file);
      if (s.offset > size || s.bytes > size - s.offset)
        throw StoreError("tensor '" + s.tensor + "' of layer " + std::to_string(layer) +
                         " expert " + std::to_string(expert) + " needs bytes up to " +
                         std::to_string(s.offset + s.bytes) + " of " + std::get<0>(sg) +
                         ", which holds " + std::to_string(size) + " (truncated?)");
    }
    total += s.bytes;
    row.push_back(std::move(s));
  }
  std::lock_guard<std::mutex> g(mu_);
  Layer& L = layer_at(layer);
  check_expert(L, layer, expert);
  if (total != static_cast<uint64_t>(L.spec.expert_bytes))
    throw std::invalid_argument("size mismatch registering layer " + std::to_string(layer) +
                                " expert " + std::to_string(expert) + " as pageable: expected " +
                                std::to_string(L.spec.expert_bytes) + " bytes, got " +
                                std::to_string(total));
  const size_t ei = static_cast<size_t>(expert);
  if (L.host_row[ei] >= 0)
    throw StoreError("layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
                     " is held in host memory; it cannot become pageable");
  for (const Slot& s : L.slots)
    if (s.loaded && s.expert == expert) {
      backend_->synchronize();
      break;
    }
  if (L.pageable[ei].empty()) L.num_pageable += 1;
  L.pageable[ei] = std::move(row);
  L.registered[ei] = true;
}

void Store::read_row(int64_t layer, int64_t expert, uintptr_t dst) {
  auto live = hold_open("read_row");
  const PageableRow* row = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    const Layer& L = layer_at(layer);
    if (expert < 0 || expert >= L.spec.num_experts ||
        L.pageable[static_cast<size_t>(expert)].empty())
      throw StoreError("read_row: layer " + std::to_string(layer) + " expert " +
                       std::to_string(expert) + " is not a pageable expert");
    row = &L.pageable[static_cast<size_t>(expert)];
  }
  if (!dst) throw std::invalid_argument("read_row: null destination");
  // Registration happens before decoding: the row is not rewritten while it is read.
  const std::string err = files_.read(*row, reinterpret_cast<void*>(dst), tiers_);
  if (!err.empty())
    throw CopyError("layer " + std::to_string(layer) + " expert " + std::to_string(expert) + ": " +
                    err);
}

}  // namespace psr
