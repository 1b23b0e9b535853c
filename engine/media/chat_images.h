// The images of a chat request, at the gateway: each `image_url` part of a chat request
// (a base64 `data:` URL) is decoded and preprocessed (engine/media), its
// original size and token count filled in for the renderer, and turned into
// the ImageInput the router and prefill worker receive (proto/router.proto).
// Errors are InvalidArgument naming the part ("messages[1].content[2].
// image_url: ..."), which api_error.h turns into a 400.
#ifndef TANDEM_ENGINE_MEDIA_CHAT_IMAGES_H_
#define TANDEM_ENGINE_MEDIA_CHAT_IMAGES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/chat/chat_types.h"
#include "engine/media/decode.h"
#include "engine/media/preprocess.h"
#include "engine/media/url_fetcher.h"
#include "proto/router.pb.h"

namespace tandem::media {

struct ImageInputOptions {
  // Images in one request, all messages together (vLLM's
  // --limit-mm-per-prompt '{"image": N}').
  int max_images_per_request = 16;
  DecodeLimits decode;
  MediaConfig media;
  // http(s) image URLs (--allowed_media_domains; empty: refused).
  // fetch.max_bytes is capped at decode.max_encoded_bytes.
  FetchOptions fetch;
};

// A `data:[<mime>];base64,<data>` URL's MIME type and decoded bytes.
struct DataUrl {
  std::string mime;
  std::string bytes;
};
absl::StatusOr<DataUrl> ParseDataUrl(absl::string_view url, int64_t max_bytes);

// Decodes and preprocesses every image part of `messages` in prompt order,
// fills each part's width, height and num_tokens, and returns one ImageInput
// per part (placeholder_start not yet set). http(s) URLs are fetched with
// url_fetcher.h when options.fetch allows their domain; a Content-Type other
// than image/* is ignored and the magic bytes decide.
absl::StatusOr<std::vector<tandem::v1::ImageInput>> PrepareImages(
    std::vector<chat::ChatMessage>* messages, const ImageInputOptions& options);

// Sets each image's placeholder_start from the encoded prompt: the k-th run of
// <|media_pad|> ids belongs to the k-th image and must be num_tokens long
// (user text spelling "<|media_pad|>" is plain BPE and never adds one).
absl::Status LocatePlaceholders(absl::Span<const int> prompt_ids,
                                std::vector<tandem::v1::ImageInput>* images);

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_CHAT_IMAGES_H_
