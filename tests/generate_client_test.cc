// //tools:generate_client against a real cluster (router + prefill + decode
// processes): its --json output carries the same tokens as a direct Generate call
// of the same request, text prompts are accepted, and errors exit non-zero with
// the gRPC status. `./tandem generate --json` prints one schema in both of its
// modes: the client's object through a router and the local
// //engine/runtime:generate binary's have the same keys and the same greedy
// token_ids for the same raw prompt; both accept hyphenated flags.
#include <sys/wait.h>

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

struct ClientRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

ClientRun RunBinary(const std::string& binary, const std::vector<std::string>& flags,
                    const std::string& log) {
  std::vector<std::string> argv = {testing::RunfilePath(binary)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  ClientRun run;
  auto proc = testing::Subprocess::Start(argv, log);
  if (!proc.ok()) return run;
  auto status = proc->Wait(absl::Seconds(60));
  run.output = proc->ReadLog();
  if (status.ok() && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
  return run;
}

ClientRun RunClient(const std::vector<std::string>& flags, const std::string& log) {
  return RunBinary("tools/generate_client", flags, log);
}

// The --json keys both modes print (the schema of `./tandem generate --help`).
const std::set<std::string> kSchema = {"request_id",
                                       "token_ids",
                                       "text",
                                       "finish_reason",
                                       "prompt_tokens",
                                       "completion_tokens",
                                       "seed",
                                       "ttft_s",
                                       "total_s",
                                       "prefill_tokens_per_s",
                                       "decode_tokens_per_s"};

std::set<std::string> Keys(const nlohmann::json& j) {
  std::set<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.insert(it.key());
  return keys;
}

// The JSON object line of --json output.
nlohmann::json JsonLine(const std::string& output) {
  size_t pos = 0;
  while (pos < output.size()) {
    size_t end = output.find('\n', pos);
    if (end == std::string::npos) end = output.size();
    if (output[pos] == '{') return nlohmann::json::parse(output.substr(pos, end - pos));
    pos = end + 1;
  }
  return nlohmann::json();
}

TEST(GenerateClientTest, StreamsTheRoutersTokensAndReportsErrors) {
  testing::ProcessCluster c;
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4), "");
  const std::string router = "--router=127.0.0.1:" + std::to_string(c.router_port());
  const std::string tmp = std::getenv("TEST_TMPDIR");

  // Seeded sampling from ids: the same tokens as the same request made directly.
  tandem::v1::GenerateRequest req = testing::MakeRequest(0, 0, 7, 0.7f);
  for (int id : {11, 22, 33, 44}) req.mutable_prompt_token_ids()->add_ids(id);
  req.mutable_sampling()->set_seed(5);
  req.mutable_sampling()->set_top_p(0.9f);
  testing::StreamResult want = c.Generate(req);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ClientRun ids = RunClient({router, "--prompt_ids=11, 22,33,44", "--max_tokens=7",
                             "--temperature=0.7", "--top_p=0.9", "--seed=5", "--json"},
                            tmp + "/client_ids.log");
  ASSERT_EQ(ids.exit_code, 0) << ids.output;
  nlohmann::json j = JsonLine(ids.output);
  ASSERT_TRUE(j.is_object()) << ids.output;
  EXPECT_EQ(Keys(j), kSchema) << ids.output;
  EXPECT_EQ(j["token_ids"].get<std::vector<int32_t>>(), want.tokens);
  EXPECT_EQ(j["request_id"].get<std::string>().rfind("req-", 0), 0u) << ids.output;
  EXPECT_EQ(j["finish_reason"].get<std::string>(), "length") << ids.output;
  EXPECT_EQ(j["seed"].get<uint64_t>(), 5u);
  EXPECT_EQ(j["prompt_tokens"].get<int>(), 4);
  EXPECT_EQ(j["completion_tokens"].get<int>(), static_cast<int>(want.tokens.size()));
  EXPECT_GT(j["ttft_s"].get<double>(), 0);
  EXPECT_NE(ids.output.find("TTFT"), std::string::npos) << ids.output;

  // A text prompt streams text; the summary line counts the tokens.
  ClientRun text =
      RunClient({router, "--prompt=Hello world", "--max_tokens=5", "--ignore_eos"},
                tmp + "/client_text.log");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("generate_client: 5 tokens"), std::string::npos)
      << text.output;

  // Errors: the status code and message, exit 1; bad flags exit 2.
  ClientRun bad = RunClient({router, "--prompt_ids=1,2,999999999", "--max_tokens=3"},
                            tmp + "/client_bad.log");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("INVALID_ARGUMENT"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("999999999"), std::string::npos) << bad.output;
  ClientRun both =
      RunClient({router, "--prompt=x", "--prompt_ids=1"}, tmp + "/client_both.log");
  EXPECT_EQ(both.exit_code, 2) << both.output;
}

TEST(GenerateClientTest, LocalAndRouterModesPrintOneSchema) {
  testing::ProcessCluster c;
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4), "");
  const std::string tmp = std::getenv("TEST_TMPDIR");

  // Greedy, the same raw text prompt (the router tokenises prompt_text as plain
  // text: generate's --raw), hyphenated flags with separate values in both.
  ClientRun remote =
      RunClient({"--router", "127.0.0.1:" + std::to_string(c.router_port()), "--prompt",
                 "Hello there", "--max-tokens", "6", "--ignore-eos", "--json"},
                tmp + "/remote.log");
  ASSERT_EQ(remote.exit_code, 0) << remote.output;
  ClientRun local = RunBinary(
      "engine/runtime/generate",
      {"--model", testing::RunfilePath(testing::kTinyModel), "--prompt", "Hello there",
       "--raw", "--max-tokens", "6", "--json", "--log-level", "warning"},
      tmp + "/local.log");
  ASSERT_EQ(local.exit_code, 0) << local.output;

  const nlohmann::json r = JsonLine(remote.output), l = JsonLine(local.output);
  ASSERT_TRUE(r.is_object()) << remote.output;
  ASSERT_TRUE(l.is_object()) << local.output;
  EXPECT_EQ(Keys(r), kSchema) << remote.output;
  EXPECT_EQ(Keys(l), kSchema) << local.output;
  const auto r_ids = r["token_ids"].get<std::vector<int32_t>>();
  EXPECT_EQ(r_ids.size(), 6u) << remote.output;
  EXPECT_EQ(l["token_ids"].get<std::vector<int32_t>>(), r_ids)
      << "local " << local.output << "\nrouter " << remote.output;
  EXPECT_EQ(l["text"], r["text"]);
  EXPECT_EQ(l["prompt_tokens"], r["prompt_tokens"]);
  EXPECT_EQ(l["completion_tokens"], r["completion_tokens"]);
  EXPECT_EQ(l["finish_reason"].get<std::string>(), "length");
  EXPECT_EQ(r["finish_reason"].get<std::string>(), "length");
  // Only the router has a request id; greedy decoding uses no seed; every other
  // key has the same type.
  EXPECT_TRUE(l["request_id"].is_null());
  EXPECT_TRUE(r["request_id"].is_string());
  EXPECT_TRUE(l["seed"].is_null()) << local.output;
  EXPECT_TRUE(r["seed"].is_null()) << remote.output;
  for (const std::string& key : kSchema) {
    if (key == "request_id" || key == "seed") continue;
    EXPECT_EQ(l[key].is_number(), r[key].is_number()) << key;
    EXPECT_EQ(l[key].is_string(), r[key].is_string()) << key;
  }

  // Both binaries document the schema and the hyphenated spelling in --help.
  for (const std::string& bin : {"tools/generate_client", "engine/runtime/generate"}) {
    ClientRun help = RunBinary(bin, {"--help"}, tmp + "/help.log");
    EXPECT_NE(help.output.find("token_ids"), std::string::npos) << bin << help.output;
    EXPECT_NE(help.output.find("--max-tokens"), std::string::npos)
        << bin << help.output;
  }
}

}  // namespace
}  // namespace tandem
