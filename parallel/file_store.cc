#include "parallel/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace tandem::parallel {
namespace {

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Unavailable("write ", path, ": ", std::strerror(errno));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Reads the whole file; NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound(path);
    return Unavailable("open ", path, ": ", std::strerror(errno));
  }
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return Unavailable("read ", path, ": ", std::strerror(errno));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {}

std::string FileStore::PathOf(absl::string_view key) const {
  std::string name;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      name.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&name, "%%%02X", c);
    }
  }
  // "." and ".." would name directories; a leading dot also hides temporaries.
  if (name.empty() || name[0] == '.') name = absl::StrCat("%", name);
  return absl::StrCat(dir_, "/", name);
}

absl::Status FileStore::Set(absl::string_view key, absl::string_view value) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return Unavailable("create directory ", dir_, ": ", ec.message());
  static std::atomic<uint64_t> counter{0};
  const std::string path = PathOf(key);
  const std::string tmp =
      absl::StrCat(dir_, "/.tmp.", ::getpid(), ".", counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Unavailable("open ", tmp, ": ", std::strerror(errno));
  absl::Status written = WriteAll(fd, value, tmp);
  ::close(fd);
  if (!written.ok()) {
    ::unlink(tmp.c_str());
    return written;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Unavailable("rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key,
                                           absl::Duration timeout) {
  const std::string path = PathOf(key);
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    absl::StatusOr<std::string> value = ReadFile(path);
    if (value.ok() || !absl::IsNotFound(value.status())) return value;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return DeadlineExceeded("rendezvous key '", key, "' (", path, ") not set within ",
                              absl::FormatDuration(timeout));
    }
    // Polling the file system: there is nothing to wait on across processes
    // that works on every shared file system.
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, absl::Milliseconds(20));
  }
}

}  // namespace tandem::parallel
