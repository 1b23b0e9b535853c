// Image input through the disaggregated cluster in one process: a chat prompt
// with a base64 PNG data URL is prepared as the gateway does (PrepareImages,
// RenderChat, EncodeChat, LocatePlaceholders), sent to the router with
// GenerateRequest.images, prefilled on a prefill worker that runs the tiny
// checkpoint's vision tower, and decoded on a decode worker that only receives
// the state.
//   - a 200-equivalent completion; usage.prompt_tokens counts the image's
//     <|media_pad|> tokens
//   - greedy: the tokens equal one engine's run with the tower's rows; the
//     same image twice gives the same tokens, another image others
//   - no prefill worker: UNAVAILABLE naming it (never colocated)
//   - a content hash the prefill worker's preprocessing disagrees with, and
//     placeholders outside the prompt: INVALID_ARGUMENT
#include <grpcpp/grpcpp.h>
#include <png.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "decode/decode_service.h"
#include "engine/chat/chat_types.h"
#include "engine/chat/renderer.h"
#include "engine/media/chat_images.h"
#include "engine/media/decode.h"
#include "engine/media/preprocess.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/vision/vision_tower.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/loopback_agent.h"
#include "metrics/registry.h"
#include "prefill/prefill_service.h"
#include "router/handoff.h"
#include "router/router_service.h"
#include "router/worker_registry.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem {
namespace {

using engine::testing::TinyWeights;
using ::testing::HasSubstr;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* t =
      tokenizer::Tokenizer::Load(engine::testing::kTinyCheckpointDir)->release();
  return *t;
}

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(service);
  auto server = b.BuildAndStart();
  *address = "127.0.0.1:" + std::to_string(port);
  return server;
}

engine::EngineOptions Options(int block_size, int tp = 1) {
  engine::EngineOptions o;
  o.block_size = block_size;
  o.num_slots = 4;
  o.max_context_tokens = 4096;  // a 1920x1080 image is 2691 tokens
  o.max_tokens_per_step = 256;
  if (tp > 1) {  // CPU ranks as threads, as a worker's --tp runs them
    static const model::Checkpoint* tiny =
        model::Checkpoint::Open(engine::testing::kTinyCheckpointDir)->release();
    o.tp.tp_size = tp;
    o.tp.backend = "cpu";
    o.tp.threads_per_rank = 1;
    o.tp.timeout = absl::Seconds(30);
    o.tp_checkpoint = tiny;
  }
  return o;
}

// Every rank's cache of a (TP) engine, rank order.
std::vector<engine::KvCache*> RankCaches(engine::Engine& e) {
  std::vector<engine::KvCache*> caches;
  for (int r = 0; r < e.executor().tp_size(); ++r)
    caches.push_back(&e.executor().cache(r));
  return caches;
}

// A width x height RGB PNG whose pixels follow `seed` (libpng's simplified
// write API).
std::string Png(int width, int height, int seed) {
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
      p[0] = static_cast<uint8_t>((x * 7 + seed * 31) & 255);
      p[1] = static_cast<uint8_t>((y * 5 + seed * 97) & 255);
      p[2] = static_cast<uint8_t>(((x ^ y) * 3 + seed * 13) & 255);
    }
  }
  png_image image = {};
  image.version = PNG_IMAGE_VERSION;
  image.width = width;
  image.height = height;
  image.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  EXPECT_TRUE(
      png_image_write_to_memory(&image, nullptr, &size, 0, rgb.data(), 0, nullptr));
  std::string out(size, '\0');
  EXPECT_TRUE(
      png_image_write_to_memory(&image, out.data(), &size, 0, rgb.data(), 0, nullptr));
  out.resize(size);
  return out;
}

// The weights for an engine on `backend`: the host's, or placed on its device.
const engine::ModelWeights* WeightsFor(kernels::Backend& backend,
                                       std::unique_ptr<engine::ModelWeights>* placed) {
  if (backend.device().name() == "host") return &TinyWeights();
  *placed = engine::testing::TinyWeightsOn(backend);
  return placed->get();
}

// The prefill worker with the tiny checkpoint's vision tower; `tp` ranks (the
// tower runs once per request, on the service's encoder thread). The engine
// and the tower each get a backend of the kind named, as prefill_main gives
// them.
struct PrefillNode {
  // `towers`: vision towers on backends of their own (a device worker's one
  // per rank), their encoder threads taking requests from one queue.
  explicit PrefillNode(int tp = 1, const char* backend_name = "cpu", int towers = 1) {
    backend = engine::testing::MakeBackend(backend_name);
    tower_backend = engine::testing::MakeBackend(backend_name);
    ckpt = *model::Checkpoint::Open(engine::testing::kTinyCheckpointDir);
    auto t = vision::VisionTower::Load(*ckpt, tower_backend.get());
    EXPECT_TRUE(t.ok()) << t.status();
    tower = *std::move(t);
    auto e = engine::Engine::Create(tp > 1 ? nullptr : WeightsFor(*backend, &weights),
                                    backend.get(), &Tok(), Options(16, tp));
    EXPECT_TRUE(e.ok()) << e.status();
    caches = RankCaches(**e);
    loop = std::make_unique<worker::EngineLoop>(std::move(*e));
    prefill::PrefillServiceOptions o;
    o.worker_id = "prefill-0";
    o.vision = {tower.get()};
    for (int t = 1; t < towers; ++t) {
      extra_backends.push_back(engine::testing::MakeBackend(backend_name));
      auto more = vision::VisionTower::Load(*ckpt, extra_backends.back().get());
      EXPECT_TRUE(more.ok()) << more.status();
      extra_towers.push_back(*std::move(more));
      o.vision.push_back(extra_towers.back().get());
    }
    service = *prefill::PrefillService::Create(loop.get(), caches, &agent, &metrics, o);
    server = Serve(service.get(), &address);
  }
  ~PrefillNode() {
    server->Shutdown(In(5));
    service->StopEncoding();
    loop.reset();
  }
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<kernels::Backend> tower_backend;
  std::unique_ptr<engine::ModelWeights> weights;
  std::unique_ptr<model::Checkpoint> ckpt;
  std::unique_ptr<vision::VisionTower> tower;
  std::vector<std::unique_ptr<kernels::Backend>> extra_backends;
  std::vector<std::unique_ptr<vision::VisionTower>> extra_towers;
  std::vector<engine::KvCache*> caches;
  kvtransfer::LoopbackAgent agent;
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<prefill::PrefillService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

struct DecodeNode {
  // prefix_caching: as decode_main runs it (landed prompts cached, blocks
  // announced).
  explicit DecodeNode(bool prefix_caching = false, int tp = 1,
                      const char* backend_name = "cpu") {
    backend = engine::testing::MakeBackend(backend_name);
    engine::EngineOptions eo = Options(8, tp);
    eo.prefix_caching.enabled = prefix_caching;
    eo.prefix_caching.announce_blocks = prefix_caching;
    auto e = engine::Engine::Create(tp > 1 ? nullptr : WeightsFor(*backend, &weights),
                                    backend.get(), &Tok(), eo);
    EXPECT_TRUE(e.ok()) << e.status();
    engine = e->get();
    loop = std::make_unique<worker::EngineLoop>(std::move(*e));
    decode::DecodeServiceOptions o;
    o.worker_id = "decode-0";
    o.unlanded_quarantine = absl::Milliseconds(300);
    service = *decode::DecodeService::Create(loop.get(), RankCaches(*engine), &agent,
                                             &metrics, o);
    server = Serve(service.get(), &address);
  }
  ~DecodeNode() {
    server->Shutdown(In(5));
    service->Stop();
    loop.reset();
    service.reset();
  }
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<engine::ModelWeights> weights;
  engine::Engine* engine = nullptr;  // owned by the loop
  kvtransfer::LoopbackAgent agent;
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<decode::DecodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

struct Result {
  std::vector<int32_t> tokens;
  tandem::v1::FinishReason finish = tandem::v1::FINISH_REASON_UNSPECIFIED;
  int prompt_tokens = 0;
  grpc::Status status;
};

// What the gateway sends for one user message: `text` after a PNG image.
tandem::v1::GenerateRequest ChatRequest(const std::string& png,
                                        const std::string& text) {
  std::vector<chat::ChatMessage> messages(1);
  messages[0].content = {text};
  chat::ImagePart part;
  part.position = 0;
  part.where = "messages[0].content[0]";
  part.url = "data:image/png;base64," + absl::Base64Escape(png);
  messages[0].images = {part};
  tandem::v1::GenerateRequest req;
  auto images = media::PrepareImages(&messages, {});
  EXPECT_TRUE(images.ok()) << images.status();
  auto segments = chat::RenderChat(messages, {}, {});
  EXPECT_TRUE(segments.ok()) << segments.status();
  auto ids = chat::EncodeChat(Tok(), *segments);
  EXPECT_TRUE(ids.ok()) << ids.status();
  absl::Status located = media::LocatePlaceholders(*ids, &*images);
  EXPECT_TRUE(located.ok()) << located;
  for (int id : *ids) req.mutable_prompt_token_ids()->add_ids(id);
  for (const auto& im : *images) *req.add_images() = im;
  req.mutable_stop()->set_max_tokens(8);
  req.mutable_stop()->set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(0);
  return req;
}

// The same prompt on one engine, the image's rows from the tower directly
// (what a colocated run would compute): greedy, `max_tokens`.
std::vector<int32_t> OneEngine(const tandem::v1::GenerateRequest& req,
                               vision::VisionTower* tower, int max_tokens) {
  std::vector<int32_t> tokens;
  std::vector<engine::MediaInput> media;
  for (const tandem::v1::ImageInput& im : req.images()) {
    auto decoded = media::DecodeImage(im.data(), im.mime_type());
    EXPECT_TRUE(decoded.ok()) << decoded.status();
    auto patched = media::Preprocess(*decoded);
    EXPECT_TRUE(patched.ok()) << patched.status();
    auto rows = tower->Encode({&*patched});
    EXPECT_TRUE(rows.ok()) << rows.status();
    media.push_back({.position = im.placeholder_start(),
                     .rows = patched->num_tokens(),
                     .content_hash = patched->content_hash,
                     .embeddings = std::make_shared<const std::vector<float>>(*rows)});
  }
  auto backend = engine::testing::MakeBackend("cpu");
  auto e = engine::Engine::Create(&TinyWeights(), backend.get(), nullptr, Options(16));
  EXPECT_TRUE(e.ok()) << e.status();
  engine::SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  std::vector<int32_t> prompt(req.prompt_token_ids().ids().begin(),
                              req.prompt_token_ids().ids().end());
  absl::Status s = (*e)->AddRequest(1, prompt, p, "", std::move(media));
  EXPECT_TRUE(s.ok()) << s;
  for (int step = 0; (*e)->HasWork() && step < 1000; ++step) {
    auto res = (*e)->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const engine::RequestOutput& out : *res) {
      tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
    }
  }
  return tokens;
}

class ClusterImageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    router::HandoffOptions ho;
    ho.max_context_tokens = 4096;
    handoff_ = std::make_unique<router::Handoff>(&workers_, &handoff_metrics_, ho);
    served_.info.set_id("kimi-k3");
    served_.info.set_vocab_size(TinyWeights().config.text.vocab_size);
    served_.info.set_max_context_tokens(4096);
    served_.fingerprint = "fp";
    router_ = std::make_unique<router::RouterService>(
        served_, &workers_, &router_metrics_, handoff_.get(),
        router::RouterServiceOptions{}, &Tok());
    router_server_ = Serve(router_.get(), &router_address_);
    router_stub_ = tandem::v1::Router::NewStub(
        grpc::CreateChannel(router_address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { router_server_->Shutdown(In(5)); }

  // current: registered as this build's workers do (prefill workers write
  // after held rows, decode workers read ReserveRequest.images); otherwise as
  // workers older than both.
  void Register(const std::string& id, tandem::v1::WorkerRole role,
                const std::string& address, bool current = false, int tp = 1) {
    tandem::v1::RegisterRequest r;
    r.set_tp_size(tp);
    r.set_worker_id(id);
    r.set_role(role);
    r.set_grpc_address(address);
    r.set_model_fingerprint("fp");
    r.set_writes_after_held_prefix(current && role == tandem::v1::WORKER_ROLE_PREFILL);
    r.set_reserves_with_images(current && role == tandem::v1::WORKER_ROLE_DECODE);
    ASSERT_TRUE(workers_.Register(r).ok());
  }

  Result Generate(const tandem::v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    auto reader = router_stub_->Generate(&ctx, req);
    Result r;
    tandem::v1::GenerateResponse m;
    while (reader->Read(&m)) {
      r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
      if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
        r.finish = m.finish_reason();
        r.prompt_tokens = m.usage().prompt_tokens();
      }
    }
    r.status = reader->Finish();
    return r;
  }

  FakeClock clock_;
  router::WorkerRegistry workers_{&clock_, absl::Hours(1)};
  metrics::Registry metric_registry_;
  router::RouterMetrics router_metrics_{&metric_registry_};
  router::HandoffMetrics handoff_metrics_{&metric_registry_};
  std::unique_ptr<router::Handoff> handoff_;
  model::ServedModel served_;
  std::unique_ptr<router::RouterService> router_;
  std::unique_ptr<grpc::Server> router_server_;
  std::unique_ptr<tandem::v1::Router::Stub> router_stub_;
  std::string router_address_;
};

TEST_F(ClusterImageTest, ImagePromptIsPrefilledWithTheTowerAndDecoded) {
  PrefillNode prefill;
  DecodeNode decode;
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);

  const std::string a = Png(112, 84, 1);  // grid 6x8 -> 12 image tokens
  const std::string b = Png(112, 84, 2);
  tandem::v1::GenerateRequest ra = ChatRequest(a, "What is in this picture?");
  ASSERT_EQ(ra.images_size(), 1);
  EXPECT_EQ(ra.images(0).num_tokens(), 12);
  const int64_t pad = TinyWeights().config.media_placeholder_token_id;
  const auto& ids = ra.prompt_token_ids().ids();
  EXPECT_EQ(std::count(ids.begin(), ids.end(), pad), 12);

  Result first = Generate(ra);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.tokens.size(), 8u);
  EXPECT_EQ(first.finish, tandem::v1::FINISH_REASON_LENGTH);
  // usage.prompt_tokens: the text and the image's 12 <|media_pad|> tokens.
  EXPECT_EQ(first.prompt_tokens, ids.size());

  // The disaggregated hand-off computes what one engine computes with the
  // tower's rows (the prefill worker's tower, a colocated run's input).
  EXPECT_EQ(first.tokens, OneEngine(ra, prefill.tower.get(), 8));

  Result again = Generate(ra);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.tokens, first.tokens);

  Result other = Generate(ChatRequest(b, "What is in this picture?"));
  ASSERT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_NE(other.tokens, first.tokens);
  EXPECT_EQ(handoff_metrics_.paths->Add({{"path", "disaggregated"}}).Value(), 3);
  EXPECT_EQ(handoff_metrics_.paths->Add({{"path", "colocated"}}).Value(), 0);
}

// Tensor parallelism on both sides (CPU ranks as threads, as `--tp 2` runs
// them): the prefill worker's tower encodes the image once, every prefill rank
// writes its rows, rank r's state goes to decode rank r, and the tokens are
// one TP 1 engine's.
TEST_F(ClusterImageTest, ImagePromptWithTensorParallelWorkersGivesTheTp1Tokens) {
  PrefillNode prefill(/*tp=*/2);
  DecodeNode decode(/*prefix_caching=*/true, /*tp=*/2);
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address,
           /*current=*/true, /*tp=*/2);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address,
           /*current=*/true, /*tp=*/2);
  const tandem::v1::GenerateRequest ra =
      ChatRequest(Png(112, 84, 1), "What is in this picture?");
  const tandem::v1::GenerateRequest rb =
      ChatRequest(Png(112, 84, 2), "What is in this picture?");
  const std::vector<int32_t> want_a = OneEngine(ra, prefill.tower.get(), 8);
  const std::vector<int32_t> want_b = OneEngine(rb, prefill.tower.get(), 8);
  ASSERT_NE(want_a, want_b);
  for (const auto& [req, want] :
       {std::pair{&ra, &want_a}, std::pair{&rb, &want_b}, std::pair{&ra, &want_a}}) {
    Result r = Generate(*req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, *want);
  }
  EXPECT_EQ(handoff_metrics_.paths->Add({{"path", "disaggregated"}}).Value(), 3);
}

// Both workers on a GPU backend (the emulator): the prefill worker's tower runs
// from device memory on a backend of its own, the engines' weights, caches and
// activations are device memory, and the tokens are one CPU engine's with the
// CPU tower's rows (the tower within 1e-5 of it, vision_tower_test; the
// engine's logits within 1e-3, gpu_engine_test: neither moves these argmaxes).
TEST_F(ClusterImageTest, ImagePromptOnDeviceWorkersGivesTheCpuTokens) {
  PrefillNode prefill(/*tp=*/1, "cuda_sim");
  DecodeNode decode(/*prefix_caching=*/false, /*tp=*/1, "cuda_sim");
  ASSERT_NE(prefill.tower_backend, nullptr);
  EXPECT_GT(prefill.tower->weight_device_bytes(), 0);
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);
  const tandem::v1::GenerateRequest req =
      ChatRequest(Png(112, 84, 1), "What is in this picture?");
  auto cpu = kernels::CreateBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  auto cpu_tower = vision::VisionTower::Load(*prefill.ckpt, cpu->get());
  ASSERT_TRUE(cpu_tower.ok()) << cpu_tower.status();
  const std::vector<int32_t> want = OneEngine(req, cpu_tower->get(), 4);
  tandem::v1::GenerateRequest four = req;
  four.mutable_stop()->set_max_tokens(4);
  Result r = Generate(four);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, want);
}

// A decode-side prefix hit for an image prompt (issue 17): the decode worker
// caches the landed prompt under keys with the image's hash mixed in, so the
// same prompt again shares its rows (only the rest crosses), and the tokens
// stay those of one engine; another image shares only the blocks before its
// placeholders. With a decode worker older than ReserveRequest.images nothing
// is shared.
TEST_F(ClusterImageTest, AnImagePromptAgainSharesTheDecodeWorkersRowsOfTheSameImage) {
  for (bool current : {true, false}) {
    SCOPED_TRACE(::testing::Message() << "current decode worker " << current);
    PrefillNode prefill;
    DecodeNode decode(/*prefix_caching=*/true);
    Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address, true);
    Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address, current);
    // A longer question, so the prompt has several full blocks of 8 after the
    // image.
    const std::string question =
        "Describe every object in this picture, its colour, its position and what "
        "it might be used for, in as much detail as you can.";
    const tandem::v1::GenerateRequest ra = ChatRequest(Png(112, 84, 1), question);
    const tandem::v1::GenerateRequest rb = ChatRequest(Png(112, 84, 2), question);
    ASSERT_EQ(ra.images_size(), 1);
    const int64_t n = ra.prompt_token_ids().ids_size();
    const int64_t image_at = ra.images(0).placeholder_start();
    ASSERT_GT(n - image_at - 12, 16);
    auto held = [&] { return decode.loop->stats().prefix.reserve_hit_tokens; };

    Result first = Generate(ra);
    ASSERT_TRUE(first.status.ok()) << first.status.error_message();
    EXPECT_EQ(first.tokens, OneEngine(ra, prefill.tower.get(), 8));
    EXPECT_EQ(held(), 0);
    Result again = Generate(ra);
    ASSERT_TRUE(again.status.ok()) << again.status.error_message();
    EXPECT_EQ(again.tokens, first.tokens);
    // Every full block of 8 of the landed prompt (the reservation holds the
    // prompt's n positions; the first generated token's comes later).
    const int64_t whole = current ? n / 8 * 8 : 0;
    EXPECT_EQ(held(), whole);
    Result other = Generate(rb);
    ASSERT_TRUE(other.status.ok()) << other.status.error_message();
    EXPECT_EQ(other.tokens, OneEngine(rb, prefill.tower.get(), 8));
    EXPECT_EQ(held(), whole + (current ? image_at / 8 * 8 : 0));
  }
}

// The tower runs on the prefill worker's encoder thread, not the engine's: a
// text prompt sent while a large image is being encoded is prefilled (and
// decoded) meanwhile, and finishes first. A client that goes away while its
// images are encoded ends the prefill CANCELLED without the engine seeing it.
TEST_F(ClusterImageTest, EncodingImagesHoldsBackNoOtherPrefill) {
  PrefillNode prefill;
  DecodeNode decode;
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);
  // 1920x1080: 10764 patches, seconds of the tiny tower on the CPU.
  const tandem::v1::GenerateRequest big =
      ChatRequest(Png(1920, 1080, 3), "Describe this picture.");
  tandem::v1::GenerateRequest text;
  const auto ids = Tok().Encode("Hello there, how are you today?");
  ASSERT_TRUE(ids.ok()) << ids.status();
  for (int id : *ids) text.mutable_prompt_token_ids()->add_ids(id);
  text.mutable_stop()->set_max_tokens(4);
  text.mutable_stop()->set_ignore_eos(true);
  text.mutable_sampling()->set_temperature(0);

  absl::Time big_done, text_done;
  Result big_result;
  std::thread image([&] {
    big_result = Generate(big);
    big_done = absl::Now();
  });
  // The image reaches the tower (decoded, preprocessed again, queued).
  metrics::Histogram* encode =
      &prefill.metrics.vision_encode_seconds->Add({{"tower", "0"}});
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Time text_sent = absl::Now();
  const Result t = Generate(text);
  text_done = absl::Now();
  image.join();
  // The text request's whole life against the tower's time for the image: on
  // the engine thread it would have waited for the rest of the encoding.
  const double text_s = absl::ToDoubleSeconds(text_done - text_sent);
  std::printf("tower %.3f s for the image; the text request %.3f s meanwhile\n",
              encode->Sum(), text_s);
  EXPECT_LT(text_s, 0.5 * encode->Sum());
  ASSERT_TRUE(t.status.ok()) << t.status.error_message();
  ASSERT_TRUE(big_result.status.ok()) << big_result.status.error_message();
  EXPECT_EQ(t.tokens.size(), 4u);
  EXPECT_EQ(big_result.tokens.size(), 8u);
  EXPECT_LT(text_done, big_done) << "the text prompt waited for the image's tower";
  EXPECT_EQ(encode->Count(), 1u);

  // Cancelled while encoding: the client's deadline passes during the tower.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
  auto reader = router_stub_->Generate(&ctx, big);
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  auto cancelled = [&] {
    return prefill.metrics.requests->Add({{"rpc", "Prefill"}, {"outcome", "cancelled"}})
        .Value();
  };
  // The tower finishes the image first (a call is not interrupted: seconds
  // here, 25 s under ASan), then the job sees the cancel.
  for (int i = 0; i < 2400 && cancelled() < 1; ++i)
    absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(cancelled(), 1);
  // Encoded (or, cancelled before its turn, not), then never added to the engine.
  EXPECT_LE(encode->Count(), 2u);
  // The worker serves on.
  const Result again = Generate(text);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.tokens, t.tokens);
}

// Several towers (a device worker has one per TP rank's GPU): requests' images
// are spread over them, each tower's encoder thread taking the next request, so
// two image prompts sent together are encoded at once, one on each tower; the
// tokens are those of one engine.
TEST_F(ClusterImageTest, ImagePromptsSpreadOverTheTowers) {
  PrefillNode prefill(/*tp=*/1, "cpu", /*towers=*/2);
  DecodeNode decode;
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);
  // 1024x1024: 5476 patches, a second or so of the tiny tower each.
  const tandem::v1::GenerateRequest a = ChatRequest(Png(1024, 1024, 4), "What is it?");
  const tandem::v1::GenerateRequest b = ChatRequest(Png(1024, 1024, 5), "What is it?");
  Result ra, rb;
  std::thread ta([&] { ra = Generate(a); });
  std::thread tb([&] { rb = Generate(b); });
  ta.join();
  tb.join();
  ASSERT_TRUE(ra.status.ok()) << ra.status.error_message();
  ASSERT_TRUE(rb.status.ok()) << rb.status.error_message();
  auto count = [&](const char* t) {
    return prefill.metrics.vision_encode_seconds->Add({{"tower", t}}).Count();
  };
  EXPECT_EQ(count("0"), 1u);
  EXPECT_EQ(count("1"), 1u);
  EXPECT_EQ(ra.tokens, OneEngine(a, prefill.tower.get(), 8));
  EXPECT_EQ(rb.tokens, OneEngine(b, prefill.tower.get(), 8));
}

TEST_F(ClusterImageTest, WithoutAPrefillWorkerAnImagePromptIsRefused) {
  DecodeNode decode;
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);
  Result r = Generate(ChatRequest(Png(56, 56, 1), "Describe."));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r.status.error_message(), HasSubstr("prefill worker"));
}

TEST_F(ClusterImageTest, BadImageInputsAreInvalidArgument) {
  PrefillNode prefill;
  DecodeNode decode;
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address);
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address);
  tandem::v1::GenerateRequest good = ChatRequest(Png(56, 56, 3), "Describe.");

  tandem::v1::GenerateRequest hash = good;
  hash.mutable_images(0)->set_content_hash(good.images(0).content_hash() ^ 1);
  Result r = Generate(hash);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("images[0]"));

  tandem::v1::GenerateRequest outside = good;
  outside.mutable_images(0)->set_placeholder_start(good.prompt_token_ids().ids_size());
  r = Generate(outside);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("not inside the prompt"));

  // The cluster still serves the good one after the refusals.
  r = Generate(good);
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
}

}  // namespace
}  // namespace tandem
