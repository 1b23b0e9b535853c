// A command-line client of tandem.v1.Router/Generate: sends one request, streams
// the text deltas to stdout as they arrive and prints TTFT and tokens/s to stderr.
// With --json it prints one JSON object on stdout instead, in the schema of the
// local engine/runtime generate binary (kJsonSchema below; `./tandem generate
// --help`). Flags may be hyphenated (--max-tokens 8). Exits 1 with the gRPC
// status on error.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/flag_names.h"
#include "common/init.h"
#include "common/tls/tls_flags.h"
#include "nlohmann/json.hpp"
#include "proto/router.grpc.pb.h"

ABSL_FLAG(std::string, router, "127.0.0.1:50051", "host:port of the router.");
ABSL_FLAG(std::string, prompt, "", "Prompt text (sent as prompt_text).");
ABSL_FLAG(std::string, prompt_ids, "", "Prompt token ids, comma-separated (1,2,3).");
ABSL_FLAG(std::string, model, "", "Model id; empty: the only served model.");
ABSL_FLAG(int, max_tokens, 64, "Most tokens to generate.");
ABSL_FLAG(double, temperature, 0, "Sampling temperature; 0 is greedy.");
ABSL_FLAG(double, top_p, 1, "Nucleus sampling threshold; 1 disables it.");
ABSL_FLAG(int64_t, seed, -1, "Sampling seed; negative: the router draws one.");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past end-of-sequence tokens.");
ABSL_FLAG(bool, json, false, "Print one JSON object on stdout instead of the text.");
ABSL_FLAG(double, timeout_s, 120, "Deadline of the whole call.");

namespace {

using Clock = std::chrono::steady_clock;

// The --json object; engine/runtime/generate_main.cc prints the same keys.
constexpr char kJsonSchema[] =
    "--json prints one object: {\"request_id\": the router's id, \"token_ids\":\n"
    "[generated ids], \"text\", \"finish_reason\": \"stop\" | \"length\" | ...,\n"
    "\"prompt_tokens\", \"completion_tokens\", \"seed\" (the one used; null when\n"
    "greedy), \"ttft_s\", \"total_s\", \"prefill_tokens_per_s\" (prompt\n"
    "tokens / TTFT), \"decode_tokens_per_s\" (tokens after the first / time after\n"
    "the first)}";

// FINISH_REASON_LENGTH -> "length" (the OpenAI spelling); "" when unspecified.
std::string FinishReasonName(tandem::v1::FinishReason r) {
  if (r == tandem::v1::FINISH_REASON_UNSPECIFIED) return "";
  return absl::AsciiStrToLower(
      absl::StripPrefix(tandem::v1::FinishReason_Name(r), "FINISH_REASON_"));
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN_CODE";
}

}  // namespace

int main(int argc, char** argv) {
  tandem::NormalizeFlagNames(argc, argv);
  tandem::InitProgram(
      argc, argv, "generate_client",
      absl::StrCat("Streams one Generate call of a Tandem router.\n"
                   "usage: generate_client [--router=HOST:PORT] (--prompt=TEXT | "
                   "--prompt_ids=1,2,3)\n"
                   "       [--max_tokens=N] [--temperature=T] [--top_p=P] [--seed=S] "
                   "[--json]\n"
                   "Flags may be hyphenated (--max-tokens N).\n",
                   kJsonSchema));
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string prompt_ids = absl::GetFlag(FLAGS_prompt_ids);
  if (prompt.empty() == prompt_ids.empty()) {
    fprintf(stderr, "generate_client: give exactly one of --prompt and --prompt_ids\n");
    return 2;
  }
  tandem::v1::GenerateRequest req;
  req.set_model(absl::GetFlag(FLAGS_model));
  if (!prompt.empty()) {
    req.set_prompt_text(prompt);
  } else {
    for (absl::string_view part : absl::StrSplit(prompt_ids, ',', absl::SkipEmpty())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id)) {
        fprintf(stderr, "generate_client: bad token id '%s' in --prompt_ids\n",
                std::string(part).c_str());
        return 2;
      }
      req.mutable_prompt_token_ids()->add_ids(id);
    }
  }
  req.mutable_stop()->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  req.mutable_stop()->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  req.mutable_sampling()->set_temperature(
      static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  req.mutable_sampling()->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  if (absl::GetFlag(FLAGS_seed) >= 0) {
    req.mutable_sampling()->set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));
  }
  req.set_return_text(true);
  const bool json = absl::GetFlag(FLAGS_json);

  // --tls_ca/--tls_cert/--tls_key: a router serving mTLS (./tandem up --tls).
  auto creds = tandem::tls::GrpcCredentialsFromFlags();
  if (!creds.ok()) {
    fprintf(stderr, "generate_client: %s\n", creds.status().ToString().c_str());
    return 2;
  }
  auto stub = tandem::v1::Router::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_router), creds->channel));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(
                       static_cast<int64_t>(absl::GetFlag(FLAGS_timeout_s) * 1000)));
  const Clock::time_point start = Clock::now();
  std::optional<Clock::time_point> first;
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse m;
  std::vector<int32_t> tokens;
  std::string text, finish_reason, request_id;
  tandem::v1::Usage usage;
  std::optional<uint64_t> seed;
  while (reader->Read(&m)) {
    if (!first && m.token_ids_size() > 0) first = Clock::now();
    tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
    text += m.text();
    if (!json && !m.text().empty()) {
      fwrite(m.text().data(), 1, m.text().size(), stdout);
      fflush(stdout);
    }
    if (!m.request_id().empty()) request_id = m.request_id();
    if (m.has_seed()) seed = m.seed();
    if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
      finish_reason = FinishReasonName(m.finish_reason());
    }
    if (m.has_usage()) usage = m.usage();
  }
  const grpc::Status status = reader->Finish();
  const Clock::time_point end = Clock::now();
  if (!json && !text.empty()) fputc('\n', stdout);
  if (!status.ok()) {
    fprintf(stderr, "generate_client: %s: %s\n", CodeName(status.error_code()),
            status.error_message().c_str());
    return 1;
  }
  const double ttft = first ? Seconds(*first - start) : Seconds(end - start);
  const double total = Seconds(end - start);
  // Decode rate: tokens after the first over the time after the first.
  const double decode_s = first ? Seconds(end - *first) : 0;
  const double tps =
      tokens.size() > 1 && decode_s > 0 ? (tokens.size() - 1) / decode_s : 0;
  if (json) {
    const double prefill_tps = ttft > 0 ? usage.prompt_tokens() / ttft : 0;
    nlohmann::ordered_json j = {{"request_id", request_id},
                                {"token_ids", tokens},
                                {"text", text},
                                {"finish_reason", finish_reason},
                                {"prompt_tokens", usage.prompt_tokens()},
                                {"completion_tokens", usage.completion_tokens()},
                                {"seed", nullptr},
                                {"ttft_s", ttft},
                                {"total_s", total},
                                {"prefill_tokens_per_s", prefill_tps},
                                {"decode_tokens_per_s", tps}};
    if (seed) j["seed"] = *seed;
    // Invalid UTF-8 cannot appear (the router never splits a character), but
    // replace rather than throw if it ever does.
    printf("%s\n",
           j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  fprintf(stderr,
          "generate_client: %zu tokens, finish %s, TTFT %.1f ms, %.1f tokens/s, "
          "total %.3f s\n",
          tokens.size(), finish_reason.c_str(), ttft * 1000, tps, total);
  return 0;
}
