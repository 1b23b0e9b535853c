#include "engine/media/chat_images.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/chat/renderer.h"

namespace tandem::media {

absl::StatusOr<DataUrl> ParseDataUrl(absl::string_view url, int64_t max_bytes) {
  if (!absl::StartsWithIgnoreCase(url, "data:")) {
    return InvalidArgument("not a data: URL");
  }
  const size_t comma = url.find(',');
  if (comma == absl::string_view::npos) {
    return InvalidArgument("data: URL without ',' before its data");
  }
  absl::string_view meta = url.substr(5, comma - 5);
  const absl::string_view payload = url.substr(comma + 1);
  if (!absl::EndsWithIgnoreCase(meta, ";base64")) {
    return InvalidArgument("data: URL is not base64 (expected data:<mime>;base64,...)");
  }
  meta.remove_suffix(7);
  DataUrl out;
  out.mime = absl::AsciiStrToLower(meta.substr(0, meta.find(';')));
  // Reject before decoding: base64 is 4 characters per 3 bytes.
  if (static_cast<int64_t>(payload.size()) / 4 * 3 > max_bytes + 3) {
    return InvalidArgument("image data is over the limit of ", max_bytes, " bytes");
  }
  if (!absl::Base64Unescape(payload, &out.bytes) &&
      !absl::WebSafeBase64Unescape(payload, &out.bytes)) {
    return InvalidArgument("data: URL has invalid base64");
  }
  return out;
}

absl::StatusOr<std::vector<tandem::v1::ImageInput>> PrepareImages(
    std::vector<chat::ChatMessage>* messages, const ImageInputOptions& options) {
  std::vector<tandem::v1::ImageInput> out;
  int total = 0;
  for (const chat::ChatMessage& m : *messages)
    total += static_cast<int>(m.images.size());
  if (total > options.max_images_per_request) {
    return InvalidArgument("messages: ", total,
                           " images in one request, over the limit of ",
                           options.max_images_per_request);
  }
  for (chat::ChatMessage& message : *messages) {
    for (chat::ImagePart& part : message.images) {
      const std::string where = absl::StrCat(part.where, ".image_url");
      DataUrl data;
      if (absl::StartsWithIgnoreCase(part.url, "http://") ||
          absl::StartsWithIgnoreCase(part.url, "https://")) {
        if (options.fetch.allowed_domains.empty()) {
          return InvalidArgument(where,
                                 ": http(s) image URLs are disabled on this gateway "
                                 "(--allowed_media_domains is empty); send the image "
                                 "inline as a data: URL (data:image/png;base64,...)");
        }
        FetchOptions fetch = options.fetch;
        fetch.max_bytes = std::min(fetch.max_bytes, options.decode.max_encoded_bytes);
        absl::StatusOr<FetchResult> fetched = FetchUrl(part.url, fetch);
        if (!fetched.ok()) {
          return absl::Status(fetched.status().code(),
                              absl::StrCat(where, ": ", fetched.status().message()));
        }
        data.bytes = std::move(fetched->body);
        const std::string type = absl::AsciiStrToLower(fetched->content_type);
        if (absl::StartsWith(type, "image/")) data.mime = type;
      } else if (absl::StartsWithIgnoreCase(part.url, "data:")) {
        absl::StatusOr<DataUrl> parsed =
            ParseDataUrl(part.url, options.decode.max_encoded_bytes);
        if (!parsed.ok())
          return InvalidArgument(where, ": ", parsed.status().message());
        data = *std::move(parsed);
      } else {
        return InvalidArgument(
            where, ": unsupported URL scheme (expected data:, http: or https:)");
      }
      absl::StatusOr<DecodedImage> image =
          DecodeImage(data.bytes, data.mime, options.decode);
      if (!image.ok()) return InvalidArgument(where, ": ", image.status().message());
      absl::StatusOr<PatchedImage> patched = Preprocess(*image, options.media);
      if (!patched.ok())
        return InvalidArgument(where, ": ", patched.status().message());
      part.width = patched->original_width;
      part.height = patched->original_height;
      part.num_tokens = patched->num_tokens();
      tandem::v1::ImageInput input;
      input.set_data(std::move(data.bytes));
      input.set_mime_type(std::string(ImageFormatMime(image->format)));
      input.set_width(part.width);
      input.set_height(part.height);
      input.set_grid_h(patched->grid_h);
      input.set_grid_w(patched->grid_w);
      input.set_num_tokens(part.num_tokens);
      input.set_content_hash(patched->content_hash);
      out.push_back(std::move(input));
    }
  }
  return out;
}

absl::Status LocatePlaceholders(absl::Span<const int> prompt_ids,
                                std::vector<tandem::v1::ImageInput>* images) {
  size_t next = 0;
  for (size_t i = 0; i < prompt_ids.size();) {
    if (prompt_ids[i] != chat::kMediaPadId) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < prompt_ids.size() && prompt_ids[end] == chat::kMediaPadId) ++end;
    if (next >= images->size()) {
      return absl::InternalError(absl::StrCat(
          "prompt has more <|media_pad|> runs than its ", images->size(), " images"));
    }
    tandem::v1::ImageInput& image = (*images)[next++];
    if (static_cast<int64_t>(end - i) != image.num_tokens()) {
      return absl::InternalError(absl::StrCat("image ", next - 1, ": ", end - i,
                                              " <|media_pad|> ids, expected ",
                                              image.num_tokens()));
    }
    image.set_placeholder_start(static_cast<int64_t>(i));
    i = end;
  }
  if (next != images->size()) {
    return absl::InternalError(absl::StrCat(
        "prompt has ", next, " <|media_pad|> runs for ", images->size(), " images"));
  }
  return absl::OkStatus();
}

}  // namespace tandem::media
