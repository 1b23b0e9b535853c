// Incremental parser of K3 generated output (XTML) into OpenAI-style channels:
// `think` → reasoning_content, `response` → content, `tools` → tool_calls,
// for streaming (events as ids arrive) and, through the same code, for whole
// completions (ParseCompletion).
//
//   Feed(id) → structure id? (<|open|> <|close|> <|sep|> <|end_of_msg|> [EOS])
//                yes → flush text, open/close an element (header text between
//                      <|open|>/<|close|> and <|sep|>: `name key="value" ...`)
//                no  → token bytes → UTF-8 (held back until complete) → the
//                      open element: think / response text, tool argument
//   → events: channel start, reasoning/content deltas, tool call start,
//     argument deltas (a JSON object assembled from the typed `argument`
//     children), tool call end (complete arguments), message end, warnings.
//
// Element grammar (what the renderer writes for an assistant turn):
//   message > think | response | tools;  tools > call(tool, index);
//   call > argument(key, type) | json(type="object")
// Malformed output never fails: unknown elements, stray text, bad headers,
// mismatched closes and unterminated elements are reported as kWarning events
// and their text degrades to response content. Only the ids <|open|>,
// <|close|>, <|sep|> are structure: their spellings inside text are text.
#ifndef TANDEM_ENGINE_CHAT_STREAM_PARSER_H_
#define TANDEM_ENGINE_CHAT_STREAM_PARSER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/chat/chat_types.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::chat {

enum class Channel { kThink, kResponse, kTools };
absl::string_view ChannelName(Channel channel);

struct ChatEvent {
  enum class Type {
    kChannelStart,            // channel
    kReasoningDelta,          // text
    kContentDelta,            // text
    kToolCallStart,           // tool_index, tool_call_id, tool_name
    kToolCallArgumentsDelta,  // tool_index, text (a piece of the JSON object)
    kToolCallEnd,  // tool_index, tool_call_id, tool_name, text (all arguments)
    kMessageEnd,   // the assistant message closed or <|end_of_msg|> / [EOS]
    kWarning,      // text (what was malformed)
  };
  Type type;
  Channel channel = Channel::kResponse;
  std::string text;
  int tool_index = -1;  // 0-based, OpenAI's tool_calls[].index
  std::string tool_call_id;
  std::string tool_name;
};

enum class StructureToken { kOpen, kClose, kSep, kEndOfMsg };

class ChatStreamParser {
 public:
  // Where the prompt left the model.
  enum class Start {
    kThink,     // prompt ended `<|open|>think<|sep|>` (thinking on)
    kResponse,  // prompt ended `<|open|>response<|sep|>` (thinking off)
    kMessage,   // inside `<|open|>message role="assistant"<|sep|>`
    kTop,       // nothing open
  };
  struct Options {
    Start start = Start::kThink;
    // Tool call ids are prefix + 0-based index; give each request its own
    // prefix when ids must be unique beyond one message.
    std::string tool_call_id_prefix = "call_";
    // A tag header longer than this is not a header (warning; becomes text).
    size_t max_header_bytes = 4096;
  };
  // The start matching a rendering with `options` (add_generation_prompt,
  // thinking).
  static Start StartFor(const ChatOptions& options);

  // `tokenizer` (not owned, may be null when only FeedStructure/FeedText are
  // used) must outlive the parser.
  ChatStreamParser(const tokenizer::Tokenizer* tokenizer, Options options);

  // One generated id. InvalidArgument for an id outside the vocabulary (the
  // state is unchanged then). Special ids other than the structure tokens and
  // [EOS] are dropped with a warning.
  absl::Status Feed(int id, std::vector<ChatEvent>* events);
  // The same, split: a structure token, or raw text bytes (any split, even
  // inside a UTF-8 sequence; spelled-out markers in it are text).
  void FeedStructure(StructureToken token, std::vector<ChatEvent>* events);
  void FeedText(absl::string_view bytes, std::vector<ChatEvent>* events);
  // End of stream (stop or length): flushes held-back text and ends open tool
  // calls (warning "unterminated"). Idempotent.
  void Finish(std::vector<ChatEvent>* events);

  bool message_ended() const { return message_ended_; }

 private:
  enum class Kind {
    kMessage,
    kThink,
    kResponse,
    kTools,
    kCall,
    kArgument,
    kJson,
    kUnknown
  };
  struct Element {
    Kind kind;
    std::string name;
  };
  enum class Mode { kText, kOpenHeader, kCloseHeader };
  enum class ArgsMode { kNone, kTyped, kJson };

  static bool IsValidChild(Kind parent, absl::string_view name);
  void Warn(std::vector<ChatEvent>* events, std::string message);
  void FlushText(bool final, std::vector<ChatEvent>* events);
  void RouteText(std::string text, std::vector<ChatEvent>* events);
  void FlushStray(std::vector<ChatEvent>* events);
  void HandleOpen(std::string header, std::vector<ChatEvent>* events);
  void HandleClose(std::string header, std::vector<ChatEvent>* events);
  void Push(Kind kind, absl::string_view name,
            const std::vector<std::pair<std::string, std::string>>& attrs,
            std::vector<ChatEvent>* events);
  void Pop(std::vector<ChatEvent>* events);
  void AbandonHeader(std::vector<ChatEvent>* events);
  void EmitArgs(absl::string_view piece, std::vector<ChatEvent>* events);
  void EndMessage(std::vector<ChatEvent>* events);

  const tokenizer::Tokenizer* tokenizer_;  // not owned
  Options options_;
  std::vector<Element> stack_;
  Mode mode_ = Mode::kText;
  std::string header_;        // raw bytes of a tag header being read
  std::string pending_utf8_;  // text bytes not yet decided
  std::string stray_;         // text outside any text element, held to the next token
  bool message_ended_ = false;
  bool finished_ = false;
  bool warned_after_end_ = false;

  // The tool call being read.
  int next_call_index_ = 0;
  int call_index_ = -1;
  std::string call_id_;
  std::string call_name_;
  std::string call_args_;
  ArgsMode args_mode_ = ArgsMode::kNone;
  int arg_count_ = 0;
  // The argument being read.
  std::string arg_type_;
  bool arg_ignored_ = false;
  std::string arg_buffer_;  // non-string values and json blocks, until closed
};

// Accumulates events into an OpenAI-style completion.
struct ParsedToolCall {
  int index = 0;
  std::string id;
  std::string name;
  std::string arguments;  // a JSON object text
};
struct ParsedCompletion {
  std::string reasoning_content;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  std::vector<std::string> warnings;
  bool message_ended = false;

  void Apply(const ChatEvent& event);
};

// The whole generated output at once, through ChatStreamParser.
absl::StatusOr<ParsedCompletion> ParseCompletion(const tokenizer::Tokenizer& tokenizer,
                                                 absl::Span<const int> ids,
                                                 ChatStreamParser::Options options);

// `name key="value" ...` of a tag header, with &quot; and &amp; undone. False
// (with what was read so far) when the header is not well formed.
struct TagHeader {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attrs;
};
bool ParseTagHeader(absl::string_view header, TagHeader* out);

}  // namespace tandem::chat

#endif  // TANDEM_ENGINE_CHAT_STREAM_PARSER_H_
