// Round trips of the first-version protos, and the generated gRPC stubs over a real
// in-process server (callback API) with the standard health service.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"

namespace tandem {
namespace {

using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;

GenerateRequest MakeRequest() {
  GenerateRequest req;
  req.set_request_id("req-1");
  req.set_model("kimi-k3");
  for (int id : {163587, 19180, 11, 2695, 163589}) {
    req.mutable_prompt_token_ids()->add_ids(id);
  }
  req.mutable_sampling()->set_temperature(0.7f);
  req.mutable_sampling()->set_top_p(0.9f);
  req.mutable_sampling()->set_seed(0);  // explicit zero seed must survive
  req.mutable_stop()->set_max_tokens(64);
  req.mutable_stop()->add_stop_strings("\n\n");
  req.set_deadline_unix_ms(1796040000000);
  return req;
}

TEST(ProtoTest, GenerateRequestRoundTrip) {
  GenerateRequest req = MakeRequest();
  std::string wire;
  ASSERT_TRUE(req.SerializeToString(&wire));
  GenerateRequest back;
  ASSERT_TRUE(back.ParseFromString(wire));
  EXPECT_EQ(back.request_id(), "req-1");
  ASSERT_EQ(back.prompt_case(), GenerateRequest::kPromptTokenIds);
  EXPECT_EQ(back.prompt_token_ids().ids_size(), 5);
  EXPECT_EQ(back.prompt_token_ids().ids(0), 163587);
  EXPECT_TRUE(back.sampling().has_seed());  // presence survives even for 0
  EXPECT_EQ(back.sampling().seed(), 0u);
  EXPECT_FLOAT_EQ(back.sampling().temperature(), 0.7f);
  EXPECT_EQ(back.stop().stop_strings(0), "\n\n");
  EXPECT_EQ(back.SerializeAsString(), wire);
}

TEST(ProtoTest, UnsetSeedIsAbsent) {
  GenerateRequest req;
  req.set_prompt_text("hi");
  GenerateRequest back;
  ASSERT_TRUE(back.ParseFromString(req.SerializeAsString()));
  EXPECT_FALSE(back.sampling().has_seed());
  EXPECT_EQ(back.prompt_case(), GenerateRequest::kPromptText);
}

TEST(ProtoTest, KvTargetRoundTrip) {
  tandem::v1::KvTarget t;
  t.set_request_id("req-9");
  t.set_decode_worker_id("decode-0");
  auto* rank = t.add_ranks();
  rank->set_transfer_descriptor(std::string("\x00\x01\xff", 3));
  rank->set_transfer_address("127.0.0.1:4000");
  for (int b : {7, 3, 11}) rank->add_block_ids(b);
  rank->set_state_slot(2);
  rank->mutable_layout()->set_block_size(64);
  rank->mutable_layout()->set_mla_token_bytes(1152);
  rank->mutable_layout()->set_kda_state_bytes(6291456);
  t.set_lease_expiry_unix_ms(123);
  tandem::v1::KvTarget back;
  ASSERT_TRUE(back.ParseFromString(t.SerializeAsString()));
  EXPECT_EQ(back.ranks(0).transfer_descriptor(), std::string("\x00\x01\xff", 3));
  EXPECT_EQ(back.ranks(0).block_ids(2), 11);
  EXPECT_EQ(back.ranks(0).layout().kda_state_bytes(), 6291456);

  tandem::v1::StateChecksums c;
  c.add_mla_layer(0xFFFFFFFFFFFFFFFFull);
  c.set_total(0x0123456789ABCDEFull);
  tandem::v1::StateChecksums cb;
  ASSERT_TRUE(cb.ParseFromString(c.SerializeAsString()));
  EXPECT_EQ(cb.mla_layer(0), 0xFFFFFFFFFFFFFFFFull);
  EXPECT_EQ(cb.total(), 0x0123456789ABCDEFull);
}

TEST(ProtoTest, UnknownBytesFailToParse) {
  GenerateRequest back;
  EXPECT_FALSE(back.ParseFromString(std::string("\xff\xff\xff\xff", 4)));
}

// A Router that streams each prompt token back as one generated token.
class EchoRouter final : public tandem::v1::Router::CallbackService {
  grpc::ServerWriteReactor<GenerateResponse>* Generate(
      grpc::CallbackServerContext* ctx, const GenerateRequest* req) override {
    class Reactor : public grpc::ServerWriteReactor<GenerateResponse> {
     public:
      explicit Reactor(const GenerateRequest* req) : req_(req) { Next(); }
      void OnWriteDone(bool ok) override {
        if (!ok) return Finish(grpc::Status(grpc::StatusCode::UNKNOWN, "write"));
        Next();
      }
      void OnDone() override { delete this; }

     private:
      void Next() {
        const auto& ids = req_->prompt_token_ids().ids();
        if (i_ == ids.size()) return Finish(grpc::Status::OK);
        resp_.Clear();
        resp_.set_request_id(req_->request_id());
        resp_.add_token_ids(ids[i_]);
        if (++i_ == ids.size()) {
          resp_.set_finish_reason(tandem::v1::FINISH_REASON_STOP);
          resp_.mutable_usage()->set_completion_tokens(ids.size());
        }
        StartWrite(&resp_);
      }
      const GenerateRequest* req_;
      GenerateResponse resp_;
      int i_ = 0;
    };
    return new Reactor(req);
  }
};

TEST(ProtoTest, GeneratedStubsStreamOverRealServerWithHealth) {
  grpc::EnableDefaultHealthCheckService(true);
  EchoRouter service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials());

  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext hctx;
  hctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest hreq;
  grpc::health::v1::HealthCheckResponse hresp;
  ASSERT_TRUE(health->Check(&hctx, hreq, &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  auto stub = tandem::v1::Router::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  GenerateRequest req = MakeRequest();
  auto reader = stub->Generate(&ctx, req);
  GenerateResponse resp;
  std::vector<int> got;
  tandem::v1::FinishReason last = tandem::v1::FINISH_REASON_UNSPECIFIED;
  while (reader->Read(&resp)) {
    EXPECT_EQ(resp.request_id(), "req-1");
    for (int id : resp.token_ids()) got.push_back(id);
    last = resp.finish_reason();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(got, std::vector<int>({163587, 19180, 11, 2695, 163589}));
  EXPECT_EQ(last, tandem::v1::FINISH_REASON_STOP);

  // ListModels is not implemented by EchoRouter: the client gets UNIMPLEMENTED.
  grpc::ClientContext lctx;
  lctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  tandem::v1::ListModelsResponse lresp;
  EXPECT_EQ(stub->ListModels(&lctx, {}, &lresp).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace tandem
