// API key checks: `Authorization: Bearer KEY`, compared in constant time (the
// time taken does not depend on where the first differing byte is, nor on the
// length of the supplied key beyond reading it).
#ifndef TANDEM_GATEWAY_AUTH_H_
#define TANDEM_GATEWAY_AUTH_H_

#include "absl/strings/string_view.h"

namespace tandem::gateway {

// True when `a` and `b` are equal; every byte of the longer one is visited.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// True when `authorization` (the header value) is "Bearer <key>" (scheme
// case-insensitive, surrounding spaces allowed) with <key> equal to `api_key`.
// An empty `api_key` means no key is required: always true.
bool AuthorizationMatches(absl::string_view authorization, absl::string_view api_key);

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_AUTH_H_
