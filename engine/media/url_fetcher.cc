#include "engine/media/url_fetcher.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::media {
namespace {

struct CurlDeleter {
  void operator()(CURL* c) const { curl_easy_cleanup(c); }
};
struct UrlDeleter {
  void operator()(CURLU* u) const { curl_url_cleanup(u); }
};
struct ListDeleter {
  void operator()(curl_slist* l) const { curl_slist_free_all(l); }
};

struct Sink {
  std::string* body;
  int64_t max_bytes;
  bool too_big = false;
};

size_t Write(char* data, size_t size, size_t n, void* user) {
  auto* sink = static_cast<Sink*>(user);
  const size_t bytes = size * n;
  if (static_cast<int64_t>(sink->body->size() + bytes) > sink->max_bytes) {
    sink->too_big = true;
    return 0;  // aborts the transfer
  }
  sink->body->append(data, bytes);
  return bytes;
}

struct Target {
  std::string scheme;
  std::string host;
  int port = 0;
};

absl::StatusOr<Target> ParseTarget(const std::string& url) {
  std::unique_ptr<CURLU, UrlDeleter> u(curl_url());
  if (curl_url_set(u.get(), CURLUPART_URL, url.c_str(), 0) != CURLUE_OK) {
    return InvalidArgument("malformed URL");
  }
  Target t;
  char* part = nullptr;
  if (curl_url_get(u.get(), CURLUPART_SCHEME, &part, 0) == CURLUE_OK) {
    t.scheme = absl::AsciiStrToLower(part);
    curl_free(part);
  }
  if (t.scheme != "http" && t.scheme != "https") {
    return InvalidArgument("URL scheme '", t.scheme, "' is not http or https");
  }
  if (curl_url_get(u.get(), CURLUPART_HOST, &part, 0) != CURLUE_OK) {
    return InvalidArgument("URL has no host");
  }
  t.host = absl::AsciiStrToLower(part);
  curl_free(part);
  if (curl_url_get(u.get(), CURLUPART_PORT, &part, CURLU_DEFAULT_PORT) == CURLUE_OK) {
    t.port = std::atoi(part);
    curl_free(part);
  }
  return t;
}

// The host's addresses (IPv6 literals arrive in brackets).
absl::StatusOr<std::vector<std::string>> Resolve(const std::string& host) {
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &list) != 0 || list == nullptr) {
    return InvalidArgument("cannot resolve host '", host, "'");
  }
  std::vector<std::string> out;
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* src =
        a->ai_family == AF_INET
            ? static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (inet_ntop(a->ai_family, src, text, sizeof(text)) != nullptr)
      out.push_back(text);
  }
  freeaddrinfo(list);
  if (out.empty()) return InvalidArgument("cannot resolve host '", host, "'");
  return out;
}

bool PublicV4(const uint8_t b[4]) {
  if (b[0] == 0 || b[0] == 10 || b[0] == 127) return false;  // this, private, loopback
  if (b[0] == 169 && b[1] == 254) return false;              // link-local
  if (b[0] == 172 && (b[1] & 0xf0) == 16) return false;      // private
  if (b[0] == 192 && b[1] == 168) return false;              // private
  if (b[0] == 100 && (b[1] & 0xc0) == 64) return false;      // CGNAT
  if (b[0] == 192 && b[1] == 0 && (b[2] == 0 || b[2] == 2)) return false;
  if (b[0] == 198 && (b[1] & 0xfe) == 18) return false;  // benchmarking
  if (b[0] >= 224) return false;                         // multicast, reserved
  return true;
}

}  // namespace

bool IsPublicAddress(absl::string_view address) {
  const std::string text(address);
  uint8_t v4[4];
  if (inet_pton(AF_INET, text.c_str(), v4) == 1) return PublicV4(v4);
  uint8_t v6[16];
  if (inet_pton(AF_INET6, text.c_str(), v6) != 1) return false;
  static const uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(v6, kMapped, 12) == 0) return PublicV4(v6 + 12);
  bool zero_prefix = true;
  for (int i = 0; i < 15; ++i) zero_prefix = zero_prefix && v6[i] == 0;
  if (zero_prefix) return false;                              // :: and ::1
  if (v6[0] == 0xff) return false;                            // multicast
  if (v6[0] == 0xfe && (v6[1] & 0xc0) == 0x80) return false;  // link-local
  if ((v6[0] & 0xfe) == 0xfc) return false;                   // unique local
  if (v6[0] == 0x20 && v6[1] == 0x01 && v6[2] == 0x0d && v6[3] == 0xb8) return false;
  if (v6[0] == 0x00 && v6[1] == 0x64 && v6[2] == 0xff && v6[3] == 0x9b) {
    return PublicV4(v6 + 12);  // NAT64
  }
  return true;
}

bool DomainAllowed(absl::string_view host, const std::vector<std::string>& domains) {
  const std::string h = absl::AsciiStrToLower(host);
  for (const std::string& d : domains) {
    const std::string domain = absl::AsciiStrToLower(d);
    if (domain.empty()) continue;
    if (domain == "*" || h == domain) return true;
    if (h.size() > domain.size() && absl::EndsWith(h, domain) &&
        h[h.size() - domain.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

absl::StatusOr<FetchResult> FetchUrl(absl::string_view url_in,
                                     const FetchOptions& options) {
  static const bool kInit = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == 0; }();
  if (!kInit) return absl::InternalError("curl_global_init failed");
  if (options.allowed_domains.empty()) {
    return InvalidArgument(
        "remote image URLs are disabled (no --allowed_media_domains)");
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  std::string url(url_in);
  for (int hop = 0;; ++hop) {
    TANDEM_ASSIGN_OR_RETURN(Target target, ParseTarget(url));
    if (!DomainAllowed(target.host, options.allowed_domains)) {
      return InvalidArgument("host '", target.host,
                             "' is not in --allowed_media_domains");
    }
    TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> addresses, Resolve(target.host));
    std::string pinned;
    for (const std::string& a : addresses) {
      if (!options.allow_private_addresses && !IsPublicAddress(a)) {
        return InvalidArgument("host '", target.host, "' resolves to ", a,
                               ", a private, loopback or link-local address");
      }
      if (pinned.empty()) pinned = a;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("image URL fetch timed out");
    }
    std::unique_ptr<CURL, CurlDeleter> curl(curl_easy_init());
    if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
    std::string host = target.host;
    if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
    const std::string resolve_entry = absl::StrCat(
        host, ":", target.port, ":",
        pinned.find(':') != std::string::npos ? "[" + pinned + "]" : pinned);
    std::unique_ptr<curl_slist, ListDeleter> resolve(
        curl_slist_append(nullptr, resolve_entry.c_str()));
    FetchResult result;
    Sink sink{&result.body, options.max_bytes};
    char error[CURL_ERROR_SIZE] = {};
    CURL* c = curl.get();
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_RESOLVE, resolve.get());
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(
        c, CURLOPT_TIMEOUT_MS,
        static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
    curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE,
                     static_cast<curl_off_t>(options.max_bytes));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, Write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "tandem-gateway");
    const CURLcode code = curl_easy_perform(c);
    if (sink.too_big || code == CURLE_FILESIZE_EXCEEDED) {
      return InvalidArgument("image at URL is over the limit of ", options.max_bytes,
                             " bytes");
    }
    if (code == CURLE_OPERATION_TIMEDOUT) {
      return absl::DeadlineExceededError(absl::StrCat(
          "image URL fetch timed out after ", absl::FormatDuration(options.timeout)));
    }
    if (code != CURLE_OK) {
      return InvalidArgument("cannot fetch image URL: ",
                             error[0] ? error : curl_easy_strerror(code));
    }
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    if (status >= 300 && status < 400) {
      char* location = nullptr;
      curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &location);
      if (location == nullptr) {
        return InvalidArgument("image URL redirect (", status, ") without a Location");
      }
      if (hop >= options.max_redirects) {
        return InvalidArgument("image URL redirected more than ", options.max_redirects,
                               " times");
      }
      url = location;
      continue;
    }
    if (status != 200) {
      return InvalidArgument("image URL answered HTTP ", status);
    }
    char* type = nullptr;
    curl_easy_getinfo(c, CURLINFO_CONTENT_TYPE, &type);
    if (type != nullptr) result.content_type = type;
    return result;
  }
}

}  // namespace tandem::media
