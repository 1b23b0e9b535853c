// Fetching an http(s) image URL with libcurl, safely: only http and https;
// an allow-list of domains (a listed domain also admits its subdomains); the
// host resolved here and every resolved address checked (loopback, private,
// link-local, CGNAT, multicast and unspecified addresses are refused unless
// allow_private_addresses), then pinned for the connection (CURLOPT_RESOLVE),
// so a DNS answer cannot change between the check and the connect; redirects
// followed by hand, each hop checked the same way, at most max_redirects; one
// deadline for all hops; the body cut off at max_bytes. Errors are
// InvalidArgument (the client's URL) or DeadlineExceeded.
#ifndef TANDEM_ENGINE_MEDIA_URL_FETCHER_H_
#define TANDEM_ENGINE_MEDIA_URL_FETCHER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tandem::media {

struct FetchOptions {
  // Empty: no remote fetch at all. "*": any host (still subject to the
  // address checks). Unlike vLLM, whose --allowed-media-domains unset means
  // every domain: a gateway inside a cluster network should not fetch for
  // anyone by default.
  std::vector<std::string> allowed_domains;
  bool allow_private_addresses = false;
  int64_t max_bytes = 32 << 20;
  absl::Duration timeout = absl::Seconds(10);
  int max_redirects = 3;
};

struct FetchResult {
  std::string body;
  std::string content_type;  // as the server sent it (may be empty)
};

absl::StatusOr<FetchResult> FetchUrl(absl::string_view url,
                                     const FetchOptions& options);

// Whether `host` is one of `domains` or a subdomain of one (case-insensitive);
// "*" admits every host.
bool DomainAllowed(absl::string_view host, const std::vector<std::string>& domains);

// Whether a numeric address (IPv4 or IPv6 text) is public.
bool IsPublicAddress(absl::string_view address);

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_URL_FETCHER_H_
