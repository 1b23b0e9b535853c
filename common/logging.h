// Structured logging on spdlog. One line per event: a message plus key=value
// fields (text) or one JSON object (json), so a request id can be followed across
// processes with grep or a log pipeline.
//
//   TLOG(INFO, "kv transfer done").Kv("request_id", id).Kv("bytes", n);
//
// text: 2026-11-30T12:00:00.123456Z I prefill kvtransfer.cc:88] kv transfer done
// request_id=req-1 bytes=42 json:
// {"ts":"2026-11-30T12:00:00.123456Z","level":"info","proc":"prefill","src":"kvtransfer.cc:88","msg":"kv
// transfer done","request_id":"req-1","bytes":42}
#ifndef TANDEM_COMMON_LOGGING_H_
#define TANDEM_COMMON_LOGGING_H_

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace tandem::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class Format { kText, kJson };

struct Options {
  std::string process = "tandem";  // shown on every line ("router", "prefill-0", ...)
  Format format = Format::kText;
  Level min_level = Level::kInfo;
};

// Configures the process logger (stderr). Safe to call more than once.
void Init(const Options& options);
// Parses "debug|info|warning|error" / "text|json"; false on anything else.
bool ParseLevel(absl::string_view s, Level* out);
bool ParseFormat(absl::string_view s, Format* out);
bool Enabled(Level level);

// Formats one event the way Init() configured; exposed for tests.
std::string FormatEvent(Format format, absl::string_view process, Level level,
                        absl::string_view src, absl::string_view msg,
                        const std::vector<std::pair<std::string, std::string>>& kv,
                        const std::vector<bool>& kv_is_number);

// One log event; emitted when it goes out of scope.
class Event {
 public:
  Event(Level level, absl::string_view file, int line, absl::string_view msg);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  Event& Kv(absl::string_view key, absl::string_view value);
  Event& Kv(absl::string_view key, const char* value) {
    return Kv(key, absl::string_view(value));
  }
  Event& Kv(absl::string_view key, const std::string& value) {
    return Kv(key, absl::string_view(value));
  }
  Event& Kv(absl::string_view key, const absl::Status& status) {
    return Kv(key, status.ToString());
  }
  Event& Kv(absl::string_view key, bool value) {
    return Kv(key, absl::string_view(value ? "true" : "false"));
  }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  Event& Kv(absl::string_view key, T value) {
    if (enabled_) {
      kv_.emplace_back(std::string(key), absl::StrCat(value));
      is_number_.push_back(true);
    }
    return *this;
  }

 private:
  bool enabled_;
  Level level_;
  std::string src_;
  std::string msg_;
  std::vector<std::pair<std::string, std::string>> kv_;
  std::vector<bool> is_number_;
};

}  // namespace tandem::log

#define TANDEM_LOG_LEVEL_DEBUG ::tandem::log::Level::kDebug
#define TANDEM_LOG_LEVEL_INFO ::tandem::log::Level::kInfo
#define TANDEM_LOG_LEVEL_WARNING ::tandem::log::Level::kWarning
#define TANDEM_LOG_LEVEL_ERROR ::tandem::log::Level::kError
#define TLOG(level, msg) \
  ::tandem::log::Event(TANDEM_LOG_LEVEL_##level, __FILE__, __LINE__, (msg))

#endif  // TANDEM_COMMON_LOGGING_H_
