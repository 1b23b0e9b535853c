// The wire constraint (tandem.v1.StructuredOutput) of a chat or completions
// request: the grammar the client asked for, and for chat the K3 framing
// around it, in token ids (engine/sampling/structured_output.h runs it).
//
// Completions: the whole output matches the grammar and ends with a stop token.
//
// Chat, a response constraint (response_format / structured_outputs /
// guided_*), K3 writes `<|open|>response<|sep|>BODY<|close|>response<|sep|>
// <|close|>message<|sep|><|end_of_msg|>`:
//   thinking off: the prompt ends `<|open|>response<|sep|>`: BODY matches the
//     grammar; where it may end, `<|close|>` (the terminator) replaces the stop
//     tokens; then `response<|sep|><|close|>message<|sep|><|end_of_msg|>` is
//     forced.
//   thinking on: the prompt ends `<|open|>think<|sep|>`: the reasoning is free
//     (no stop token, no `<|open|>`/`<|sep|>`) until the model writes `<|close|>`;
//     then `think<|sep|><|open|>response<|sep|>` is forced and BODY as above.
// Chat, tool_choice "required" with several tools: the response is empty and
// the tools channel holds one or more calls (at most kMaxRequiredToolCalls),
// each `<|open|>call tool="NAME" index="N"<|sep|><|open|>json type="object"
// <|sep|>ARGS<|close|>json<|sep|><|close|>call<|sep|>` with NAME one of the
// tools, N the call's index and ARGS valid against that tool's parameters,
// then `<|close|>tools<|sep|><|close|>message<|sep|>`: one KIND_TOOL_CALLS
// grammar, with <|end_of_msg|> as its terminator (no suffix)
// (engine/grammar/tool_calls.h; the structure tokens are part of it), after the forced
// [reasoning framing and]
// `<|close|>response<|sep|><|open|>tools<|sep|>`.
// Chat, tool_choice naming a function (or "required" with one tool): the
// response is empty and the tools channel holds one call whose arguments are a
// `json type="object"` element (stream_parser passes its body through as
// `function.arguments`, verbatim), constrained by the function's parameters:
//   [reasoning as above, then `think<|sep|><|open|>response<|sep|>`]
//   `<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="NAME"
//   index="1"<|sep|><|open|>json type="object"<|sep|>` ARGS `<|close|>json<|sep|>
//   <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>`.
#ifndef TANDEM_GATEWAY_STRUCTURED_OUTPUT_H_
#define TANDEM_GATEWAY_STRUCTURED_OUTPUT_H_

#include <optional>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/request_parser.h"
#include "proto/common.pb.h"

namespace tandem::gateway {

// tool_choice "required" with several tools: calls per response at most.
inline constexpr int kMaxRequiredToolCalls = 8;

// Completions: the constraint of `fields.structured`, if any.
absl::StatusOr<std::optional<tandem::v1::StructuredOutput>> CompletionConstraint(
    const GenerationFields& fields);

// Chat: the response or tool-call constraint, framed for the K3 format.
// InvalidArgument when a response constraint is combined with a forced tool
// call, or (tool_choice "required" with several tools) for a tool name holding
// '<|' or '{index}'.
absl::StatusOr<std::optional<tandem::v1::StructuredOutput>> ChatConstraint(
    const ChatCompletionRequest& request, const tokenizer::Tokenizer& tokenizer);

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_STRUCTURED_OUTPUT_H_
