// Replays fuzz inputs (files, directories of files, or .packed files) through the fuzz target.
// A .packed file holds many inputs, each as "<decimal byte count>\n<bytes>\n" (written by
// tests/spec/fuzz/pack.py), so that a merged corpus of thousands of inputs is one file.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

size_t run(const std::string& data) {
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  return 1;
}

// Returns the number of inputs, or -1 when the file is not well formed.
long replayPacked(const std::string& text) {
  long n = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) return -1;
    if (nl == pos || nl - pos > 12) return -1;  // no input is a terabyte
    size_t len = 0;
    for (size_t i = pos; i < nl; ++i) {
      if (text[i] < '0' || text[i] > '9') return -1;
      len = len * 10 + static_cast<size_t>(text[i] - '0');
    }
    if (len >= text.size() - nl - 1 || text[nl + 1 + len] != '\n') return -1;
    n += static_cast<long>(run(text.substr(nl + 1, len)));
    pos = nl + 1 + len + 1;
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = 0;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(argv[i])) {
      for (const auto& e : std::filesystem::directory_iterator(argv[i])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[i]);
    }
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "%s: cannot read it\n", f.c_str());
        return 1;
      }
      std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (f.extension() == ".packed") {
        long k = replayPacked(data);
        if (k < 0) {
          std::fprintf(stderr, "%s: not a packed corpus (\"<count>\\n<bytes>\\n\" entries)\n", f.c_str());
          return 1;
        }
        n += static_cast<size_t>(k);
      } else {
        n += run(data);
      }
    }
  }
  std::printf("replayed %zu inputs\n", n);
  return n > 0 ? 0 : 1;
}
