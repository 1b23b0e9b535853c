// libFuzzer harness for ParseDescriptor: raw bytes, and the same bytes with the
// length field and checksum repaired so the fuzzer reaches the body parser. Any
// descriptor that parses must re-serialise to the repaired input exactly.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvtransfer/descriptor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tandem::kvtransfer::ParseDescriptor;
  using tandem::kvtransfer::SerializeDescriptor;
  std::string raw(reinterpret_cast<const char*>(data), size);
  (void)ParseDescriptor(raw);
  if (size < 28) return 0;
  std::string fixed = raw;
  fixed.replace(0, 4, "TKVD");
  const uint64_t total = fixed.size();
  for (int i = 0; i < 4; ++i)
    fixed[8 + i] = static_cast<char>((total >> (8 * i)) & 0xff);
  const uint64_t sum = XXH3_64bits(fixed.data(), fixed.size() - 8);
  for (int i = 0; i < 8; ++i)
    fixed[fixed.size() - 8 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  auto parsed = ParseDescriptor(fixed);
  if (parsed.ok() && SerializeDescriptor(*parsed) != fixed) std::abort();
  return 0;
}
