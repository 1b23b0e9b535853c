#include "engine/media/chat_images.h"

#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "engine/chat/renderer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::media {
namespace {

using ::testing::HasSubstr;

std::string Read(const std::string& name) {
  std::ifstream in("engine/media/testdata/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << name;
  return ss.str();
}

std::string DataUrl(const std::string& mime, const std::string& bytes) {
  return "data:" + mime + ";base64," + absl::Base64Escape(bytes);
}

chat::ImagePart Part(std::string url, std::string where, size_t position = 0) {
  chat::ImagePart part;
  part.url = std::move(url);
  part.where = std::move(where);
  part.position = position;
  return part;
}

TEST(ParseDataUrl, Forms) {
  auto ok = ParseDataUrl("data:image/PNG;base64,aGVsbG8=", 100);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->mime, "image/png");
  EXPECT_EQ(ok->bytes, "hello");
  EXPECT_EQ(ParseDataUrl("data:;base64,aGVsbG8", 100)->bytes, "hello");
  EXPECT_FALSE(ParseDataUrl("data:image/png,raw", 100).ok());
  EXPECT_FALSE(ParseDataUrl("data:image/png;base64", 100).ok());
  EXPECT_FALSE(ParseDataUrl("data:image/png;base64,!!!!", 100).ok());
  auto big = ParseDataUrl("data:image/png;base64," + std::string(400, 'A'), 100);
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(std::string(big.status().message()), HasSubstr("over the limit"));
}

TEST(PrepareImages, SeveralImagesPerMessageAndRequest) {
  std::vector<chat::ChatMessage> messages(2);
  messages[0].images = {
      Part(DataUrl("image/png", Read("rgb_3x2.png")), "messages[0].content[0]"),
      Part(DataUrl("image/jpeg", Read("rgb_3x2.jpg")), "messages[0].content[2]", 1)};
  messages[1].images = {
      Part(DataUrl("image/webp", Read("rgb_3x2.webp")), "messages[1].content[0]"),
      Part(DataUrl("image/gif", Read("rgb_3x2.gif")), "messages[1].content[1]")};
  auto images = PrepareImages(&messages, {});
  ASSERT_TRUE(images.ok()) << images.status();
  ASSERT_EQ(images->size(), 4u);
  const char* mimes[] = {"image/png", "image/jpeg", "image/webp", "image/gif"};
  for (int i = 0; i < 4; ++i) {
    const auto& image = (*images)[i];
    EXPECT_EQ(image.mime_type(), mimes[i]);
    EXPECT_EQ(image.width(), 3);
    EXPECT_EQ(image.height(), 2);
    EXPECT_EQ(image.grid_h(), 2);  // 3x2 padded to 28x28
    EXPECT_EQ(image.grid_w(), 2);
    EXPECT_EQ(image.num_tokens(), 1);
    EXPECT_FALSE(image.data().empty());
  }
  // Lossless formats decode to the same pixels: the same content hash.
  EXPECT_EQ((*images)[0].content_hash(), (*images)[2].content_hash());
  EXPECT_EQ((*images)[0].content_hash(), (*images)[3].content_hash());
  EXPECT_NE((*images)[0].content_hash(), (*images)[1].content_hash());  // JPEG
  EXPECT_EQ(messages[0].images[1].width, 3);
  EXPECT_EQ(messages[1].images[0].num_tokens, 1);
}

TEST(PrepareImages, BadImagesNameThePart) {
  struct Case {
    std::string url;
    const char* message;
  };
  const std::string png = Read("rgb_3x2.png");
  const Case cases[] = {
      {DataUrl("image/jpeg", png), "messages[0].content[3].image_url: declared MIME"},
      {DataUrl("image/png", png.substr(0, 40)), "messages[0].content[3].image_url: "},
      {DataUrl("image/png", ""), "image data is empty"},
      {DataUrl("image/gif", "GIF89a"), "undecodable GIF"},
      {DataUrl("image/png", Read("bomb_100000x100000.png")), "over the limit"},
      {"data:image/png;base64,@@@", "invalid base64"},
      {"https://example.com/cat.png", "--allowed_media_domains is empty"},
      {"file:///etc/passwd", "unsupported URL scheme"},
  };
  for (const Case& c : cases) {
    std::vector<chat::ChatMessage> messages(1);
    messages[0].images = {Part(c.url, "messages[0].content[3]")};
    auto images = PrepareImages(&messages, {});
    ASSERT_FALSE(images.ok()) << c.message;
    EXPECT_EQ(images.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(images.status().message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(images.status().message()),
                HasSubstr("messages[0].content[3].image_url"));
  }
}

TEST(PrepareImages, RemoteUrlsGoThroughTheFetcherChecks) {
  std::vector<chat::ChatMessage> messages(1);
  messages[0].images = {Part("http://127.0.0.1:1/cat.png", "messages[0].content[1]")};
  ImageInputOptions options;
  options.fetch.allowed_domains = {"example.com"};
  auto images = PrepareImages(&messages, options);
  ASSERT_FALSE(images.ok());
  EXPECT_EQ(images.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(images.status().message()),
      HasSubstr("messages[0].content[1].image_url: host '127.0.0.1' is not in"));
  options.fetch.allowed_domains = {"*"};
  images = PrepareImages(&messages, options);
  ASSERT_FALSE(images.ok());
  EXPECT_THAT(std::string(images.status().message()), HasSubstr("loopback"));
}

TEST(PrepareImages, PerRequestLimit) {
  std::vector<chat::ChatMessage> messages(2);
  const std::string url = DataUrl("image/png", Read("rgb_3x2.png"));
  messages[0].images = {Part(url, "a"), Part(url, "b")};
  messages[1].images = {Part(url, "c")};
  ImageInputOptions options;
  options.max_images_per_request = 2;
  auto images = PrepareImages(&messages, options);
  ASSERT_FALSE(images.ok());
  EXPECT_THAT(std::string(images.status().message()), HasSubstr("over the limit of 2"));
  options.max_images_per_request = 3;
  EXPECT_TRUE(PrepareImages(&messages, options).ok());
}

TEST(LocatePlaceholders, RunsInOrder) {
  const int P = chat::kMediaPadId;
  std::vector<tandem::v1::ImageInput> images(2);
  images[0].set_num_tokens(3);
  images[1].set_num_tokens(1);
  const std::vector<int> ids = {
      1, chat::kMediaBeginId, 5, chat::kMediaContentId, P, P, P, chat::kMediaEndId, 7,
      P, chat::kMediaEndId};
  ASSERT_TRUE(LocatePlaceholders(ids, &images).ok());
  EXPECT_EQ(images[0].placeholder_start(), 4);
  EXPECT_EQ(images[1].placeholder_start(), 9);
  images[1].set_num_tokens(2);
  EXPECT_FALSE(LocatePlaceholders(ids, &images).ok());
  std::vector<tandem::v1::ImageInput> one(1);
  one[0].set_num_tokens(3);
  EXPECT_FALSE(LocatePlaceholders(ids, &one).ok());
}

}  // namespace
}  // namespace tandem::media
