// Compares engine/media's decode + preprocessing with the Pillow oracle
// corpus that oracle.py writes: the resized RGB bit for bit and the
// normalised patches bit for bit. Usage: oracle_check CORPUS_DIR.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/media/decode.h"
#include "engine/media/preprocess.h"

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem::media;
  if (argc != 2) {
    std::cerr << "usage: oracle_check CORPUS_DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::ifstream manifest(dir + "/MANIFEST");
  std::string line;
  int cases = 0, failures = 0;
  while (std::getline(manifest, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string name, config_name;
    int W, H, w, h, gh, gw;
    fields >> name >> config_name >> W >> H >> w >> h >> gh >> gw;
    ++cases;
    MediaConfig config;
    if (config_name == "tiny") {
      config.in_patch_limit = 64;
      config.patch_limit_on_one_side = 16;
    }
    auto fail = [&](const std::string& why) {
      std::cout << "FAIL " << name << ": " << why << "\n";
      ++failures;
    };
    const std::string data = ReadFile(dir + "/" + name + ".img");
    auto image = DecodeImage(data, "", {});
    if (!image.ok()) {
      fail(std::string(image.status().message()));
      continue;
    }
    if (image->width != W || image->height != H) {
      fail("decoded size " + std::to_string(image->width) + "x" +
           std::to_string(image->height));
      continue;
    }
    const ResizePlan plan = PlanResize(W, H, config);
    if (plan.width != w || plan.height != h || plan.grid_h != gh || plan.grid_w != gw) {
      fail("plan differs");
      continue;
    }
    const std::vector<uint8_t> rgb = ResizedRgb(*image, plan, config);
    const std::string want_rgb = ReadFile(dir + "/" + name + ".rgb");
    if (want_rgb.size() != rgb.size()) {
      fail("rgb size");
      continue;
    }
    int diff = 0, max_delta = 0;
    for (size_t i = 0; i < rgb.size(); ++i) {
      const int d = std::abs(int(rgb[i]) - int(uint8_t(want_rgb[i])));
      if (d != 0) {
        if (diff < 3) {
          std::cout << "  " << name << " byte " << i << " (pixel " << i / 3 << " c "
                    << i % 3 << "): got " << int(rgb[i]) << " want "
                    << int(uint8_t(want_rgb[i])) << "\n";
        }
        ++diff;
        max_delta = std::max(max_delta, d);
      }
    }
    if (diff != 0) {
      fail(std::to_string(diff) + " of " + std::to_string(rgb.size()) +
           " RGB bytes differ, max delta " + std::to_string(max_delta));
      continue;
    }
    auto patched = Preprocess(*image, config);
    if (!patched.ok()) {
      fail(std::string(patched.status().message()));
      continue;
    }
    const std::string want_f32 = ReadFile(dir + "/" + name + ".f32");
    if (want_f32.size() != patched->patches.size() * sizeof(float) ||
        std::memcmp(want_f32.data(), patched->patches.data(), want_f32.size()) != 0) {
      fail("patches differ from the oracle's");
      continue;
    }
    if (patched->num_tokens() != gh * gw / 4) fail("token count");
    std::cout << "ok " << name << " " << W << "x" << H << " -> " << w << "x" << h
              << " grid " << gh << "x" << gw << " tokens " << patched->num_tokens()
              << "\n";
  }
  std::cout << cases << " cases, " << failures << " failures\n";
  return (cases > 0 && failures == 0) ? 0 : 1;
}
