// //tools:generate_client against a real cluster (router + prefill + decode
// processes): its --json output carries the same tokens as a direct Generate call
// of the same request, text prompts are accepted, and errors exit non-zero with
// the gRPC status.
#include <sys/wait.h>

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

ClientRun RunClient(const std::vector<std::string>& flags, const std::string& log) {
  std::vector<std::string> argv = {testing::RunfilePath("tools/generate_client")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  ClientRun run;
  auto proc = testing::Subprocess::Start(argv, log);
  if (!proc.ok()) return run;
  auto status = proc->Wait(absl::Seconds(60));
  run.output = proc->ReadLog();
  if (status.ok() && WIFEXITED(*status)) run.exit_code = WEXITSTATUS(*status);
  return run;
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
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), want.tokens);
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

}  // namespace
}  // namespace tandem
