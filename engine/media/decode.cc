#include "engine/media/decode.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

// The C libraries' headers come after ours (jpeglib.h needs <cstdio> first).
#include <gif_lib.h>
#include <jpeglib.h>
#include <png.h>
#include <webp/decode.h>
#include <webp/demux.h>

namespace tandem::media {
namespace {

absl::Status CheckSize(ImageFormat format, int64_t width, int64_t height,
                       const DecodeLimits& limits) {
  if (width <= 0 || height <= 0) {
    return InvalidArgument(ImageFormatMime(format), " image has zero size (", width,
                           "x", height, ")");
  }
  if (width * height > limits.max_pixels) {
    return InvalidArgument(ImageFormatMime(format), " image is ", width, "x", height,
                           " = ", width * height, " pixels, over the limit of ",
                           limits.max_pixels);
  }
  return absl::OkStatus();
}

// Expands palette indices to RGB or RGBA (alpha from `alpha`, 255 elsewhere).
void ExpandPalette(const std::vector<uint8_t>& indices, const uint8_t palette[256][3],
                   const uint8_t alpha[256], bool with_alpha, DecodedImage* out) {
  const int channels = with_alpha ? 4 : 3;
  out->kind = with_alpha ? PixelKind::kRgba : PixelKind::kRgb;
  out->pixels.resize(indices.size() * channels);
  uint8_t* p = out->pixels.data();
  for (uint8_t index : indices) {
    p[0] = palette[index][0];
    p[1] = palette[index][1];
    p[2] = palette[index][2];
    if (with_alpha) p[3] = alpha[index];
    p += channels;
  }
}

// Replicates one grey channel (plus alpha when `grey_alpha`) to RGB(A).
void ExpandGrey(const std::vector<uint8_t>& grey, bool grey_alpha, DecodedImage* out) {
  const size_t n = grey.size() / (grey_alpha ? 2 : 1);
  out->kind = grey_alpha ? PixelKind::kRgba : PixelKind::kRgb;
  const int channels = grey_alpha ? 4 : 3;
  out->pixels.resize(n * channels);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t v = grey_alpha ? grey[2 * i] : grey[i];
    uint8_t* p = &out->pixels[i * channels];
    p[0] = p[1] = p[2] = v;
    if (grey_alpha) p[3] = grey[2 * i + 1];
  }
}

// ---------------------------------------------------------------- PNG
struct PngContext {
  const uint8_t* data;
  size_t size;
  size_t pos;
  std::jmp_buf jump;
  char message[256];
  // Filled between setjmp and a possible longjmp; owned by the caller's frame.
  std::vector<uint8_t> raw;
  std::vector<png_bytep> rows;
};

void PngError(png_structp png, png_const_charp message) {
  auto* ctx = static_cast<PngContext*>(png_get_error_ptr(png));
  std::snprintf(ctx->message, sizeof(ctx->message), "%s", message);
  std::longjmp(ctx->jump, 1);
}
void PngWarning(png_structp, png_const_charp) {}
void PngRead(png_structp png, png_bytep out, size_t n) {
  auto* ctx = static_cast<PngContext*>(png_get_io_ptr(png));
  if (ctx->size - ctx->pos < n) png_error(png, "truncated PNG data");
  std::memcpy(out, ctx->data + ctx->pos, n);
  ctx->pos += n;
}

// Returns false with ctx->message set on a libpng error. No C++ object with a
// destructor lives in this frame past setjmp.
bool PngDecodeInner(png_structp png, png_infop info, PngContext* ctx,
                    const DecodeLimits& limits, DecodedImage* out,
                    absl::Status* size_status, int* color_type_out, int* bit_depth_out,
                    uint8_t palette[256][3], uint8_t alpha[256], bool* has_trns) {
  if (setjmp(ctx->jump)) return false;
  png_set_read_fn(png, ctx, PngRead);
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
  png_set_chunk_cache_max(png, 1000);
  png_set_chunk_malloc_max(png, 16 << 20);
  png_read_info(png, info);
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
  png_get_IHDR(png, info, &width, &height, &bit_depth, &color_type, &interlace, nullptr,
               nullptr);
  *size_status = CheckSize(ImageFormat::kPng, width, height, limits);
  if (!size_status->ok()) return true;
  out->width = static_cast<int>(width);
  out->height = static_cast<int>(height);
  *color_type_out = color_type;
  *bit_depth_out = bit_depth;
  if (color_type == PNG_COLOR_TYPE_PALETTE) {
    png_set_packing(png);  // 1/2/4-bit indices to one byte each
    png_colorp plte = nullptr;
    int num_plte = 0;
    if (png_get_PLTE(png, info, &plte, &num_plte) & PNG_INFO_PLTE) {
      for (int i = 0; i < num_plte && i < 256; ++i) {
        palette[i][0] = plte[i].red;
        palette[i][1] = plte[i].green;
        palette[i][2] = plte[i].blue;
      }
    }
    png_bytep trans = nullptr;
    int num_trans = 0;
    if (png_get_tRNS(png, info, &trans, &num_trans, nullptr) & PNG_INFO_tRNS) {
      *has_trns = true;
      for (int i = 0; i < num_trans && i < 256; ++i) alpha[i] = trans[i];
    }
  } else if (color_type == PNG_COLOR_TYPE_GRAY && bit_depth < 8) {
    png_set_expand_gray_1_2_4_to_8(png);
  } else if (bit_depth == 16 && color_type != PNG_COLOR_TYPE_GRAY) {
    png_set_strip_16(png);  // Pillow's ";16B" raw modes keep the high byte
  }
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const size_t rowbytes = png_get_rowbytes(png, info);
  ctx->raw.resize(rowbytes * height);
  ctx->rows.resize(height);
  for (png_uint_32 y = 0; y < height; ++y) ctx->rows[y] = &ctx->raw[y * rowbytes];
  png_read_image(png, ctx->rows.data());
  return true;
}

absl::StatusOr<DecodedImage> DecodePng(absl::string_view bytes,
                                       const DecodeLimits& limits) {
  png_structp png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, nullptr, PngError, PngWarning);
  if (png == nullptr) return absl::ResourceExhaustedError("png_create_read_struct");
  png_infop info = png_create_info_struct(png);
  auto ctx = std::make_unique<PngContext>();
  ctx->data = reinterpret_cast<const uint8_t*>(bytes.data());
  ctx->size = bytes.size();
  ctx->pos = 0;
  ctx->message[0] = '\0';
  png_set_error_fn(png, ctx.get(), PngError, PngWarning);
  DecodedImage out;
  out.format = ImageFormat::kPng;
  absl::Status size_status;
  int color_type = 0, bit_depth = 0;
  uint8_t palette[256][3] = {};
  uint8_t alpha[256];
  std::memset(alpha, 255, sizeof(alpha));
  bool has_trns = false;
  const bool ok = info != nullptr &&
                  PngDecodeInner(png, info, ctx.get(), limits, &out, &size_status,
                                 &color_type, &bit_depth, palette, alpha, &has_trns);
  png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
  if (!ok) return InvalidArgument("undecodable PNG image: ", ctx->message);
  if (!size_status.ok()) return size_status;
  switch (color_type) {
    case PNG_COLOR_TYPE_PALETTE:
      out.nearest_resize = true;
      ExpandPalette(ctx->raw, palette, alpha, has_trns, &out);
      break;
    case PNG_COLOR_TYPE_GRAY:
      if (bit_depth == 16) {
        out.kind = PixelKind::kGrey32;
        out.wide.resize(ctx->raw.size() / 2);
        for (size_t i = 0; i < out.wide.size(); ++i) {
          out.wide[i] = (ctx->raw[2 * i] << 8) | ctx->raw[2 * i + 1];
        }
      } else {
        out.nearest_resize = bit_depth == 1;  // Pillow mode "1"
        ExpandGrey(ctx->raw, /*grey_alpha=*/false, &out);
      }
      break;
    case PNG_COLOR_TYPE_GRAY_ALPHA:
      ExpandGrey(ctx->raw, /*grey_alpha=*/true, &out);
      break;
    case PNG_COLOR_TYPE_RGB:
      out.kind = PixelKind::kRgb;
      out.pixels = std::move(ctx->raw);
      break;
    case PNG_COLOR_TYPE_RGB_ALPHA:
      out.kind = PixelKind::kRgba;
      out.pixels = std::move(ctx->raw);
      break;
    default:
      return InvalidArgument("PNG image has an unknown colour type ", color_type);
  }
  return out;
}

// ---------------------------------------------------------------- JPEG
struct JpegError {
  jpeg_error_mgr manager;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};
struct JpegProgress {
  jpeg_progress_mgr manager;
  int max_scans;
  JpegError* error;
};

void JpegErrorExit(j_common_ptr cinfo) {
  auto* error = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, error->message);
  std::longjmp(error->jump, 1);
}
void JpegOutputMessage(j_common_ptr) {}
void JpegProgressMonitor(j_common_ptr cinfo) {
  auto* progress = reinterpret_cast<JpegProgress*>(cinfo->progress);
  auto* dinfo = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (dinfo->input_scan_number > progress->max_scans) {
    std::snprintf(progress->error->message, sizeof(progress->error->message),
                  "more than %d progressive scans", progress->max_scans);
    std::longjmp(progress->error->jump, 1);
  }
}

struct JpegState {
  jpeg_decompress_struct cinfo;
  JpegError error;
  JpegProgress progress;
  std::vector<uint8_t> raw;
};

bool JpegDecodeInner(JpegState* s, absl::string_view bytes, const DecodeLimits& limits,
                     DecodedImage* out, absl::Status* size_status, int* components) {
  if (setjmp(s->error.jump)) return false;
  jpeg_mem_src(&s->cinfo, reinterpret_cast<const unsigned char*>(bytes.data()),
               static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&s->cinfo, TRUE);
  *size_status = CheckSize(ImageFormat::kJpeg, s->cinfo.image_width,
                           s->cinfo.image_height, limits);
  if (!size_status->ok()) return true;
  // Pillow's modes: 1 component "L", 3 "RGB", 4 "CMYK" (YCCK converted).
  switch (s->cinfo.num_components) {
    case 1:
      s->cinfo.out_color_space = JCS_GRAYSCALE;
      break;
    case 3:
      s->cinfo.out_color_space = JCS_RGB;
      break;
    case 4:
      s->cinfo.out_color_space = JCS_CMYK;
      break;
    default:
      *size_status = InvalidArgument("JPEG image has ", s->cinfo.num_components,
                                     " components (1, 3 or 4 are supported)");
      return true;
  }
  jpeg_start_decompress(&s->cinfo);
  *components = s->cinfo.output_components;
  out->width = static_cast<int>(s->cinfo.output_width);
  out->height = static_cast<int>(s->cinfo.output_height);
  const size_t stride = static_cast<size_t>(out->width) * *components;
  s->raw.resize(stride * out->height);
  while (s->cinfo.output_scanline < s->cinfo.output_height) {
    JSAMPROW row = &s->raw[s->cinfo.output_scanline * stride];
    jpeg_read_scanlines(&s->cinfo, &row, 1);
  }
  jpeg_finish_decompress(&s->cinfo);
  return true;
}

absl::StatusOr<DecodedImage> DecodeJpeg(absl::string_view bytes,
                                        const DecodeLimits& limits) {
  auto s = std::make_unique<JpegState>();
  s->cinfo.err = jpeg_std_error(&s->error.manager);
  s->error.manager.error_exit = JpegErrorExit;
  s->error.manager.output_message = JpegOutputMessage;
  s->error.message[0] = '\0';
  jpeg_create_decompress(&s->cinfo);
  s->progress.manager.progress_monitor = JpegProgressMonitor;
  s->progress.max_scans = limits.max_jpeg_scans;
  s->progress.error = &s->error;
  s->cinfo.progress = &s->progress.manager;
  DecodedImage out;
  out.format = ImageFormat::kJpeg;
  absl::Status size_status;
  int components = 0;
  const bool ok =
      JpegDecodeInner(s.get(), bytes, limits, &out, &size_status, &components);
  jpeg_destroy_decompress(&s->cinfo);
  if (!ok) return InvalidArgument("undecodable JPEG image: ", s->error.message);
  if (!size_status.ok()) return size_status;
  if (components == 1) {
    ExpandGrey(s->raw, /*grey_alpha=*/false, &out);
  } else if (components == 3) {
    out.kind = PixelKind::kRgb;
    out.pixels = std::move(s->raw);
  } else {
    // Pillow reads 4-component JPEGs as "CMYK;I" (Adobe's inverted CMYK).
    out.kind = PixelKind::kCmyk;
    out.pixels = std::move(s->raw);
    for (uint8_t& v : out.pixels) v = 255 - v;
  }
  return out;
}

// ---------------------------------------------------------------- WebP
absl::StatusOr<DecodedImage> DecodeWebp(absl::string_view bytes,
                                        const DecodeLimits& limits) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(data, bytes.size(), &features) != VP8_STATUS_OK) {
    return InvalidArgument("undecodable WebP image: bad header");
  }
  // The canvas size (VP8X) for animations; checked before the decoder
  // allocates its canvas.
  TANDEM_RETURN_IF_ERROR(
      CheckSize(ImageFormat::kWebp, features.width, features.height, limits));
  // Pillow decodes every WebP through WebPAnimDecoder (first frame, RGBA).
  WebPData webp_data = {data, bytes.size()};
  WebPAnimDecoderOptions options;
  if (!WebPAnimDecoderOptionsInit(&options)) {
    return absl::InternalError("WebPAnimDecoderOptionsInit failed");
  }
  options.color_mode = MODE_RGBA;
  options.use_threads = 0;
  WebPAnimDecoder* decoder = WebPAnimDecoderNew(&webp_data, &options);
  if (decoder == nullptr) return InvalidArgument("undecodable WebP image");
  WebPAnimInfo info;
  uint8_t* frame = nullptr;
  int timestamp = 0;
  absl::Status status;
  if (!WebPAnimDecoderGetInfo(decoder, &info)) {
    status = InvalidArgument("undecodable WebP image: no stream info");
  } else if (info.canvas_width != static_cast<uint32_t>(features.width) ||
             info.canvas_height != static_cast<uint32_t>(features.height)) {
    status = InvalidArgument("undecodable WebP image: inconsistent canvas size");
  } else if (!WebPAnimDecoderGetNext(decoder, &frame, &timestamp)) {
    status = InvalidArgument("undecodable WebP image: first frame");
  }
  DecodedImage out;
  out.format = ImageFormat::kWebp;
  if (status.ok()) {
    out.width = features.width;
    out.height = features.height;
    const size_t n = static_cast<size_t>(out.width) * out.height;
    if (features.has_alpha) {
      out.kind = PixelKind::kRgba;
      out.pixels.assign(frame, frame + 4 * n);
    } else {
      out.kind = PixelKind::kRgb;
      out.pixels.resize(3 * n);
      for (size_t i = 0; i < n; ++i) std::memcpy(&out.pixels[3 * i], frame + 4 * i, 3);
    }
  }
  WebPAnimDecoderDelete(decoder);
  if (!status.ok()) return status;
  return out;
}

// ---------------------------------------------------------------- GIF
struct GifSource {
  const uint8_t* data;
  size_t size;
  size_t pos;
};
int GifRead(GifFileType* gif, GifByteType* out, int n) {
  auto* src = static_cast<GifSource*>(gif->UserData);
  const size_t take = std::min(static_cast<size_t>(n), src->size - src->pos);
  std::memcpy(out, src->data + src->pos, take);
  src->pos += take;
  return static_cast<int>(take);
}

struct GifCloser {
  void operator()(GifFileType* gif) const {
    int error = 0;
    DGifCloseFile(gif, &error);
  }
};

absl::Status GifError(const char* what, int code) {
  const char* text = GifErrorString(code);
  return InvalidArgument("undecodable GIF image: ", what, ": ",
                         text != nullptr ? text : "unknown error");
}

absl::StatusOr<DecodedImage> DecodeGif(absl::string_view bytes,
                                       const DecodeLimits& limits) {
  GifSource src = {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0};
  int error = 0;
  std::unique_ptr<GifFileType, GifCloser> gif(DGifOpen(&src, GifRead, &error));
  if (gif == nullptr) return GifError("header", error);
  int transparency = -1;
  for (;;) {
    GifRecordType record;
    if (DGifGetRecordType(gif.get(), &record) == GIF_ERROR) {
      return GifError("record", gif->Error);
    }
    if (record == TERMINATE_RECORD_TYPE) {
      return InvalidArgument("undecodable GIF image: no image in the file");
    }
    if (record == EXTENSION_RECORD_TYPE) {
      int code = 0;
      GifByteType* ext = nullptr;
      if (DGifGetExtension(gif.get(), &code, &ext) == GIF_ERROR) {
        return GifError("extension", gif->Error);
      }
      if (code == GRAPHICS_EXT_FUNC_CODE && ext != nullptr && ext[0] >= 4) {
        transparency = (ext[1] & 1) ? ext[4] : -1;
      }
      while (ext != nullptr) {
        if (DGifGetExtensionNext(gif.get(), &ext) == GIF_ERROR) {
          return GifError("extension", gif->Error);
        }
      }
      continue;
    }
    if (record != IMAGE_DESC_RECORD_TYPE) continue;
    if (DGifGetImageDesc(gif.get()) == GIF_ERROR) {
      return GifError("image descriptor", gif->Error);
    }
    const GifImageDesc& desc = gif->Image;
    TANDEM_RETURN_IF_ERROR(
        CheckSize(ImageFormat::kGif, desc.Width, desc.Height, limits));
    // Pillow (9.x) grows the canvas to hold a frame that overhangs it.
    const int64_t width =
        std::max<int64_t>(gif->SWidth, static_cast<int64_t>(desc.Left) + desc.Width);
    const int64_t height =
        std::max<int64_t>(gif->SHeight, static_cast<int64_t>(desc.Top) + desc.Height);
    TANDEM_RETURN_IF_ERROR(CheckSize(ImageFormat::kGif, width, height, limits));
    // The canvas starts as the transparent index (or 0), as Pillow fills it.
    std::vector<uint8_t> indices(
        width * height, static_cast<uint8_t>(transparency >= 0 ? transparency : 0));
    std::vector<GifPixelType> line(desc.Width);
    std::vector<int> order;
    order.reserve(desc.Height);
    if (desc.Interlace) {
      static constexpr int kStart[4] = {0, 4, 2, 1};
      static constexpr int kStep[4] = {8, 8, 4, 2};
      for (int pass = 0; pass < 4; ++pass) {
        for (int y = kStart[pass]; y < desc.Height; y += kStep[pass])
          order.push_back(y);
      }
    } else {
      for (int y = 0; y < desc.Height; ++y) order.push_back(y);
    }
    for (int y : order) {
      if (DGifGetLine(gif.get(), line.data(), desc.Width) == GIF_ERROR) {
        return GifError("image data", gif->Error);
      }
      std::memcpy(&indices[(desc.Top + y) * width + desc.Left], line.data(),
                  desc.Width);
    }
    const ColorMapObject* map =
        desc.ColorMap != nullptr ? desc.ColorMap : gif->SColorMap;
    // Pillow: no palette, or a palette that is the grey ramp (i, i, i), is
    // mode "L" (the index is the grey value, resized BICUBIC); otherwise "P".
    bool grey_ramp = true;
    if (map != nullptr) {
      for (int i = 0; i < map->ColorCount; ++i) {
        const GifColorType& c = map->Colors[i];
        if (c.Red != i || c.Green != i || c.Blue != i) grey_ramp = false;
      }
    }
    DecodedImage out;
    out.format = ImageFormat::kGif;
    out.width = static_cast<int>(width);
    out.height = static_cast<int>(height);
    if (grey_ramp) {
      ExpandGrey(indices, /*grey_alpha=*/false, &out);
      return out;
    }
    uint8_t palette[256][3] = {};
    for (int i = 0; i < map->ColorCount && i < 256; ++i) {
      palette[i][0] = map->Colors[i].Red;
      palette[i][1] = map->Colors[i].Green;
      palette[i][2] = map->Colors[i].Blue;
    }
    uint8_t alpha[256];
    std::memset(alpha, 255, sizeof(alpha));
    if (transparency >= 0) alpha[transparency] = 0;
    out.nearest_resize = true;
    ExpandPalette(indices, palette, alpha, transparency >= 0, &out);
    return out;
  }
}

bool MimeMatches(ImageFormat format, absl::string_view mime) {
  switch (format) {
    case ImageFormat::kPng:
      return mime == "image/png" || mime == "image/apng";
    case ImageFormat::kJpeg:
      return mime == "image/jpeg" || mime == "image/jpg" || mime == "image/pjpeg";
    case ImageFormat::kWebp:
      return mime == "image/webp";
    case ImageFormat::kGif:
      return mime == "image/gif";
  }
  return false;
}

}  // namespace

absl::string_view ImageFormatMime(ImageFormat format) {
  switch (format) {
    case ImageFormat::kPng:
      return "image/png";
    case ImageFormat::kJpeg:
      return "image/jpeg";
    case ImageFormat::kWebp:
      return "image/webp";
    case ImageFormat::kGif:
      return "image/gif";
  }
  return "image/unknown";
}

absl::StatusOr<ImageFormat> DetectImageFormat(absl::string_view bytes) {
  if (absl::StartsWith(bytes, "\x89PNG\r\n\x1a\n")) return ImageFormat::kPng;
  if (absl::StartsWith(bytes, "\xff\xd8\xff")) return ImageFormat::kJpeg;
  if (absl::StartsWith(bytes, "GIF87a") || absl::StartsWith(bytes, "GIF89a")) {
    return ImageFormat::kGif;
  }
  if (bytes.size() >= 12 && bytes.substr(0, 4) == "RIFF" &&
      bytes.substr(8, 4) == "WEBP") {
    return ImageFormat::kWebp;
  }
  if (bytes.empty()) return InvalidArgument("image data is empty");
  return InvalidArgument(
      "image data is not PNG, JPEG, WebP or GIF (unrecognised magic bytes)");
}

absl::StatusOr<DecodedImage> DecodeImage(absl::string_view bytes,
                                         absl::string_view declared_mime,
                                         const DecodeLimits& limits) {
  if (static_cast<int64_t>(bytes.size()) > limits.max_encoded_bytes) {
    return InvalidArgument("image data is ", bytes.size(), " bytes, over the limit of ",
                           limits.max_encoded_bytes);
  }
  TANDEM_ASSIGN_OR_RETURN(ImageFormat format, DetectImageFormat(bytes));
  std::string mime = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(declared_mime.substr(0, declared_mime.find(';'))));
  if (!mime.empty() && !MimeMatches(format, mime)) {
    return InvalidArgument("declared MIME type '", mime, "' does not match the data (",
                           ImageFormatMime(format), ")");
  }
  switch (format) {
    case ImageFormat::kPng:
      return DecodePng(bytes, limits);
    case ImageFormat::kJpeg:
      return DecodeJpeg(bytes, limits);
    case ImageFormat::kWebp:
      return DecodeWebp(bytes, limits);
    case ImageFormat::kGif:
      return DecodeGif(bytes, limits);
  }
  return absl::InternalError("unreachable");
}

}  // namespace tandem::media
