// The K3 chat format ("XTML") renderer: OpenAI-style messages → segments →
// token ids, byte for byte as the release's encoding_k3.py build_chat_segments
// and tokenization_kimi.py _encode_chat_segments (README.md in this folder).
//
//   RenderChat(messages, tools, options) → [Segment{kMarkup|kText, text}]
//   EncodeChat(tokenizer, segments)      → ids (each segment BPE-encoded alone)
//   RenderText(segments)                 → the prompt as one string (debugging)
//
// Security: every caller-supplied byte (message text, reasoning, tool
// arguments, names, attribute values, tool schemas) lands in a kText segment,
// which is encoded as ordinary text, so "<|open|>" written by a user is plain
// BPE and can never become a structure token. Only kMarkup segments, written
// by the renderer itself, may turn structure spellings into their ids.
#ifndef TANDEM_ENGINE_CHAT_RENDERER_H_
#define TANDEM_ENGINE_CHAT_RENDERER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/chat/chat_types.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::chat {

inline constexpr absl::string_view kOpenToken = "<|open|>";
inline constexpr absl::string_view kCloseToken = "<|close|>";
inline constexpr absl::string_view kSepToken = "<|sep|>";
inline constexpr absl::string_view kEndOfMsgToken = "<|end_of_msg|>";
// Image input (VISION.md section 3).
inline constexpr absl::string_view kMediaBeginToken = "<|media_begin|>";
inline constexpr absl::string_view kMediaContentToken = "<|media_content|>";
inline constexpr absl::string_view kMediaEndToken = "<|media_end|>";
inline constexpr absl::string_view kMediaPadToken = "<|media_pad|>";
inline constexpr int kMediaBeginId = 163602;
inline constexpr int kMediaContentId = 163603;
inline constexpr int kMediaEndId = 163604;
inline constexpr int kMediaPadId = 163605;  // media_placeholder_token_id

struct Segment {
  enum class Kind {
    // Written by the renderer: a structure token (<|open|> <|close|> <|sep|>
    // <|end_of_msg|>) or markup text (tag names, ` role`, `="`, `"`).
    kMarkup,
    // Caller data: content, reasoning, argument values, attribute values,
    // system-note bodies. Encoded as ordinary text.
    kText,
    // An image's placeholder run: text is <|media_pad|> repeated once per
    // merged patch; encoded as that many kMediaPadId.
    kMediaPad,
  };
  Kind kind;
  std::string text;

  friend bool operator==(const Segment& a, const Segment& b) {
    return a.kind == b.kind && a.text == b.text;
  }
};

// InvalidArgument for what the reference rejects: a tool message whose tool
// name cannot be resolved, tool-call arguments that are JSON but not an
// object, a tool call without a name. Unimplemented for an image part not
// preprocessed (num_tokens 0). Each image is written in place as
// <|media_begin|> "image {W}x{H}" <|media_content|> <|media_pad|> x N
// <|media_end|>.
absl::StatusOr<std::vector<Segment>> RenderChat(
    const std::vector<ChatMessage>& messages, const std::vector<ToolDeclaration>& tools,
    const ChatOptions& options);

// Encodes each segment on its own: kMarkup with the four structure spellings
// (and, as a whole segment, the media begin/content/end spellings) allowed as
// special ids, kText as ordinary text, kMediaPad as pad ids.
absl::StatusOr<std::vector<int>> EncodeChat(const tokenizer::Tokenizer& tokenizer,
                                            absl::Span<const Segment> segments);

// The segments' texts concatenated: the prompt as a string.
std::string RenderText(absl::Span<const Segment> segments);
// One line per segment: `M "<|open|>"` / `T "Hello"` (C-escaped).
std::string SegmentsDebugString(absl::Span<const Segment> segments);

// Attribute-value escaping of the reference: `&` → `&amp;`, then `"` → `&quot;`.
std::string EscapeAttributeValue(absl::string_view value);

}  // namespace tandem::chat

#endif  // TANDEM_ENGINE_CHAT_RENDERER_H_
