#include "common/logging.h"

#include <atomic>
#include <memory>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace tandem::log {
namespace {

struct State {
  absl::Mutex mu;
  Options options ABSL_GUARDED_BY(mu);
  std::shared_ptr<spdlog::logger> logger ABSL_GUARDED_BY(mu);
};

State& GetState() {
  static State* state = new State();
  return *state;
}

std::atomic<int> g_min_level{static_cast<int>(Level::kInfo)};

const char* LevelName(Level level) {
  switch (level) {
    case Level::kDebug:
      return "debug";
    case Level::kInfo:
      return "info";
    case Level::kWarning:
      return "warning";
    case Level::kError:
      return "error";
  }
  return "info";
}

char LevelLetter(Level level) { return "DIWE"[static_cast<int>(level)]; }

// Escapes a string for a JSON string literal.
void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", c);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// A text-format value is quoted when it is empty or holds a space, quote or '='.
void AppendTextValue(std::string* out, absl::string_view v) {
  bool quote = v.empty() || v.find_first_of(" \"=\t\n") != absl::string_view::npos;
  if (!quote) {
    out->append(v.data(), v.size());
    return;
  }
  AppendJsonString(out, v);
}

absl::string_view Basename(absl::string_view path) {
  size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

void Init(const Options& options) {
  State& st = GetState();
  absl::MutexLock lock(&st.mu);
  st.options = options;
  if (st.logger == nullptr) {
    st.logger = std::make_shared<spdlog::logger>(
        "tandem", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    st.logger->set_pattern("%v");
    st.logger->set_level(spdlog::level::trace);
    st.logger->flush_on(spdlog::level::trace);
  }
  g_min_level.store(static_cast<int>(options.min_level));
}

bool ParseLevel(absl::string_view s, Level* out) {
  if (s == "debug")
    *out = Level::kDebug;
  else if (s == "info")
    *out = Level::kInfo;
  else if (s == "warning")
    *out = Level::kWarning;
  else if (s == "error")
    *out = Level::kError;
  else
    return false;
  return true;
}

bool ParseFormat(absl::string_view s, Format* out) {
  if (s == "text")
    *out = Format::kText;
  else if (s == "json")
    *out = Format::kJson;
  else
    return false;
  return true;
}

bool Enabled(Level level) {
  return static_cast<int>(level) >= g_min_level.load(std::memory_order_relaxed);
}

std::string FormatEvent(Format format, absl::string_view process, Level level,
                        absl::string_view src, absl::string_view msg,
                        const std::vector<std::pair<std::string, std::string>>& kv,
                        const std::vector<bool>& kv_is_number) {
  std::string ts =
      absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  std::string out;
  if (format == Format::kJson) {
    out = "{\"ts\":";
    AppendJsonString(&out, ts);
    out.append(",\"level\":");
    AppendJsonString(&out, LevelName(level));
    out.append(",\"proc\":");
    AppendJsonString(&out, process);
    out.append(",\"src\":");
    AppendJsonString(&out, src);
    out.append(",\"msg\":");
    AppendJsonString(&out, msg);
    for (size_t i = 0; i < kv.size(); ++i) {
      out.push_back(',');
      AppendJsonString(&out, kv[i].first);
      out.push_back(':');
      if (i < kv_is_number.size() && kv_is_number[i]) {
        out.append(kv[i].second);
      } else {
        AppendJsonString(&out, kv[i].second);
      }
    }
    out.push_back('}');
    return out;
  }
  absl::StrAppend(&out, ts, " ", std::string(1, LevelLetter(level)), " ", process, " ",
                  src, "] ", msg);
  for (const auto& [k, v] : kv) {
    absl::StrAppend(&out, " ", k, "=");
    AppendTextValue(&out, v);
  }
  return out;
}

Event::Event(Level level, absl::string_view file, int line, absl::string_view msg)
    : enabled_(Enabled(level)), level_(level) {
  if (enabled_) {
    src_ = absl::StrCat(Basename(file), ":", line);
    msg_ = std::string(msg);
  }
}

Event& Event::Kv(absl::string_view key, absl::string_view value) {
  if (enabled_) {
    kv_.emplace_back(std::string(key), std::string(value));
    is_number_.push_back(false);
  }
  return *this;
}

Event::~Event() {
  if (!enabled_) return;
  State& st = GetState();
  Options options;
  std::shared_ptr<spdlog::logger> logger;
  {
    absl::MutexLock lock(&st.mu);
    options = st.options;
    logger = st.logger;
  }
  std::string line =
      FormatEvent(options.format, options.process, level_, src_, msg_, kv_, is_number_);
  if (logger == nullptr) {
    // Before Init(): still say it, on stderr.
    fprintf(stderr, "%s\n", line.c_str());
    return;
  }
  logger->info(line);
}

}  // namespace tandem::log
