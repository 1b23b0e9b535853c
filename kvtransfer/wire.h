// Little-endian integers in byte strings, for the wire formats kvtransfer
// writes and parses (the descriptor, its extensions).
#ifndef TANDEM_KVTRANSFER_WIRE_H_
#define TANDEM_KVTRANSFER_WIRE_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace tandem::kvtransfer {

// Appends the low `bytes` bytes of `v`, least significant first.
inline void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Reads `bytes` bytes from the front of `*in` into `*v` and drops them; false
// (nothing read) when fewer remain.
inline bool GetLe(absl::string_view* in, int bytes, uint64_t* v) {
  if (in->size() < static_cast<size_t>(bytes)) return false;
  uint64_t r = 0;
  for (int i = 0; i < bytes; ++i) {
    r |= static_cast<uint64_t>(static_cast<uint8_t>((*in)[i])) << (8 * i);
  }
  in->remove_prefix(bytes);
  *v = r;
  return true;
}

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_WIRE_H_
