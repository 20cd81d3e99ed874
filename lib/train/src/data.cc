#include "dtrain/train/data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string_view>
#include <tuple>

#include "dtrain/common/errors.h"
#include "dtrain/common/memory.h"
#include "dtrain/common/strings.h"

namespace dtrain::train {
namespace {

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Box-Muller pairs in float (the data generator is on the training hot path).
void gaussians(uint64_t state, float* out, int n) {
  for (int i = 0; i < n; i += 2) {
    uint64_t bits = splitmix(state);
    float u1 = (static_cast<float>(bits >> 40) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = static_cast<float>((bits >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
    float r = std::sqrt(-2.0f * std::log(u1));
    float a = 6.2831853f * u2;
    out[i] = r * std::cos(a);
    if (i + 1 < n) out[i + 1] = r * std::sin(a);
  }
}

}  // namespace

SyntheticData::SyntheticData(int inputs, int outputs, uint64_t seed)
    : inputs_(inputs),
      outputs_(outputs),
      seed_(seed),
      gen_(static_cast<size_t>(inputs) * kLatent),
      teacher_(static_cast<size_t>(outputs) * kLatent) {
  gaussians(seed ^ 0x7ea0c4e5ull, gen_.data(), static_cast<int>(gen_.size()));
  gaussians(seed ^ 0x5eedf00dull, teacher_.data(), static_cast<int>(teacher_.size()));
  float s = 1.0f / std::sqrt(static_cast<float>(kLatent));
  for (auto& w : gen_) w *= s;
  for (auto& w : teacher_) w *= s;
}

void SyntheticData::sample(uint64_t index, bool eval, float* x, int* label, float* targets) const {
  uint64_t st = seed_ * 0x100000001b3ull ^ (eval ? 0xe7a1ull << 48 : 0) ^ (index * 0x9e3779b97f4a7c15ull);
  float z[kLatent];
  gaussians(st, z, kLatent);
  gaussians(st ^ 0xa5a5a5a5a5a5a5a5ull, x, inputs_);
  for (int i = 0; i < inputs_; ++i) {
    const float* g = gen_.data() + static_cast<size_t>(i) * kLatent;
    float v = 0;
    for (int j = 0; j < kLatent; ++j) v += g[j] * z[j];
    x[i] = v + kNoise * x[i];
  }
  int best = 0;
  float bestV = -1e30f;
  for (int k = 0; k < outputs_; ++k) {
    const float* w = teacher_.data() + static_cast<size_t>(k) * kLatent;
    float v = 0;
    for (int j = 0; j < kLatent; ++j) v += w[j] * z[j];
    if (targets) targets[k] = v;
    if (v > bestV) {
      bestV = v;
      best = k;
    }
  }
  if (label) *label = best;
}

EpochOrder::EpochOrder(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n), halfBits_(1) {
  while ((uint64_t{1} << (2 * halfBits_)) < n) ++halfBits_;
  uint64_t st = seed * 0x2545f4914f6cdd1dull + epoch * 0x9e3779b97f4a7c15ull + 1;
  for (auto& k : keys_) k = splitmix(st);
}

// A balanced Feistel network over 2*halfBits_ bits: a bijection on [0, 2^(2h)).
uint64_t EpochOrder::feistel(uint64_t v) const {
  const uint64_t mask = (uint64_t{1} << halfBits_) - 1;
  uint64_t l = v >> halfBits_, r = v & mask;
  for (uint64_t k : keys_) {
    uint64_t s = r ^ k;
    uint64_t f = splitmix(s) & mask;
    uint64_t nl = r;
    r = l ^ f;
    l = nl;
  }
  return (l << halfBits_) | r;
}

uint64_t EpochOrder::operator[](uint64_t position) const {
  // Cycle walking: values >= n are mapped again until they land in range; the domain is
  // less than 4n, so this takes under 4 rounds on average.
  uint64_t v = feistel(position);
  while (v >= n_) v = feistel(v);
  return v;
}

std::vector<uint64_t> epochOrder(uint64_t n, uint64_t seed, uint64_t epoch) {
  EpochOrder o(n, seed, epoch);
  std::vector<uint64_t> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = o[i];
  return out;
}

namespace {

class SyntheticSet final : public Dataset {
 public:
  SyntheticSet(const spec::TrainerSpec& t, bool eval)
      : data_(t.model.layers.front(), t.model.layers.back(), t.data.seed),
        eval_(eval),
        n_(static_cast<uint64_t>(eval ? t.data.eval_samples : t.data.train_samples)) {}
  uint64_t size() const override { return n_; }
  void sample(uint64_t i, float* x, int* label, float* targets) const override {
    data_.sample(i, eval_, x, label, targets);
  }

 private:
  SyntheticData data_;
  bool eval_;
  uint64_t n_;
};

// Rows in memory: features and a label (or a regression target) per row.
// Rows of floats: `inputs` per sample and one target. Either owns its vectors (parsed here)
// or views a mapping of the launcher's data image, kept alive by `owner`.
class TableSet final : public Dataset {
 public:
  TableSet(int inputs, std::vector<float> x, std::vector<float> y)
      : inputs_(inputs), rows_(y.size()), xs_(std::move(x)), ys_(std::move(y)), x_(xs_.data()), y_(ys_.data()) {}
  TableSet(int inputs, uint64_t rows, const float* x, const float* y, std::shared_ptr<const void> owner)
      : inputs_(inputs), rows_(rows), x_(x), y_(y), owner_(std::move(owner)) {}
  TableSet(const TableSet&) = delete;
  TableSet& operator=(const TableSet&) = delete;
  uint64_t size() const override { return rows_; }
  void sample(uint64_t i, float* x, int* label, float* targets) const override {
    std::memcpy(x, x_ + i * static_cast<uint64_t>(inputs_), static_cast<size_t>(inputs_) * sizeof(float));
    if (label) *label = static_cast<int>(y_[i]);
    if (targets) targets[0] = y_[i];
  }
  int inputs() const { return inputs_; }
  const float* x() const { return x_; }
  const float* y() const { return y_; }

 private:
  int inputs_;
  uint64_t rows_;
  std::vector<float> xs_, ys_;
  const float* x_;
  const float* y_;
  std::shared_ptr<const void> owner_;
};

// A contiguous slice of another set (the held-out 10%).
class Slice final : public Dataset {
 public:
  Slice(std::shared_ptr<Dataset> base, uint64_t begin, uint64_t end)
      : base_(std::move(base)), begin_(begin), end_(end) {}
  uint64_t size() const override { return end_ - begin_; }
  void sample(uint64_t i, float* x, int* label, float* targets) const override {
    base_->sample(begin_ + i, x, label, targets);
  }

 private:
  std::shared_ptr<Dataset> base_;
  uint64_t begin_, end_;
};

bool isLabel(const spec::TrainerSpec& t, double v) {
  return t.model.loss == "mse" || (v == std::floor(v) && v >= 0 && v < t.model.layers.back());
}

void checkLabel(const spec::TrainerSpec& t, double v, const std::string& where) {
  if (isLabel(t, v)) return;
  const bool classIndex = v == std::floor(v) && v >= 0 && v < (1 << 24);
  throw SpecError(fmt::format("{}: label {} is not a class index in 0..{} (the model's output width); {}", where, v,
                              t.model.layers.back() - 1,
                              classIndex ? fmt::format("fix it, or, with {} classes or more, make the last of "
                                                       "/trainer/model/layers {}",
                                                       v + 1, v + 1)
                                         : std::string("labels are class indices (0, 1, ...): fix it, or use "
                                                       "/trainer/model/loss \"mse\" for a regression target")));
}

// What a line without commas but with another separator says about the file: dtrain reads
// comma-separated values only ("" when the line has commas, or none of the others).
std::string separatorHint(const std::string& line) {
  if (line.find(',') != std::string::npos) return {};
  if (line.find('\t') != std::string::npos)
    return "; the line has tabs and no commas: dtrain reads comma-separated values, so convert the file (tr '\\t' ',')";
  if (line.find(';') != std::string::npos)
    return "; the line has ';' and no commas: dtrain reads comma-separated values, so convert the file (tr ';' ','; "
           "decimal commas first become points)";
  return {};
}

// A cell as a message shows it: one line, at most 40 bytes.
std::string shownCell(std::string_view cell) {
  return cell.size() > 40 ? oneLine(cell.substr(0, utf8PrefixLength(cell, 40))) + "..." : oneLine(cell);
}

// (a file whose lines end with CR alone reads as one line)
constexpr const char* kCrOnlyLines =
    "the lines end with a carriage return alone (CR, not LF or CRLF): convert the file (tr '\\r' '\\n')";

// One line of a csv file into `line`, as std::getline reads it, but refused past `maxBytes`:
// a file with no line ends (a binary file, a one-line export) was read whole into one string
// before its column count failed it (200 MB took a 622 MB peak). Reads in 64 KiB pieces.
bool getCsvLine(std::istream& in, std::string& line, size_t maxBytes, const std::string& path,
                long long lineNo) {
  line.clear();
  char piece[1 << 16];
  for (;;) {
    in.getline(piece, sizeof piece);
    const auto got = static_cast<size_t>(in.gcount());
    if (in.bad()) {
      const int err = errno;  // (the failed read's, as the stream keeps no reason)
      throw IoError(fmt::format("{}:{}: read error: {}", path, lineNo, std::strerror(err ? err : EIO)));
    }
    const bool full = in.fail() && !in.eof();  // the piece filled up before a line end
    const bool ended = !in.fail() && !in.eof();  // a line end, extracted (counted in gcount, not stored)
    if (in.eof() && got == 0 && line.empty()) return false;  // no more lines
    line.append(piece, ended ? got - 1 : got);
    if (line.size() > maxBytes)
      throw SpecError(
          line.find('\r') != std::string::npos
              ? fmt::format("{}:{}: {}", path, lineNo, kCrOnlyLines)
              : fmt::format("{}:{}: a line longer than {} bytes: no line ends? dtrain reads plain csv text, one "
                            "row per line (LF or CRLF line ends)",
                            path, lineNo, maxBytes));
    if (!full) return true;  // a line end, or the file's last line without one
    in.clear();
  }
}

std::shared_ptr<TableSet> loadCsv(const spec::TrainerSpec& t, const std::string& path,
                                  const std::function<void()>& poll) {
  std::ifstream in(path);
  if (!in) throw SpecError(fmt::format("{}: cannot open csv file", path));
  const int inputs = t.model.layers.front();
  // 256 bytes a cell is far beyond any number's text (or a column's name).
  const size_t maxLine = std::max<size_t>(1u << 20, 256 * (static_cast<size_t>(inputs) + 1));
  std::string line;
  long long lineNo = 0;
  int labelCol = -1, columns = -1;
  const std::string& lc = t.data.label_column;
  // A JSON number is an index; a string is a header name, or an index where its digits name
  // no column (a spec from before numbers were told apart; a file without a header).
  const bool lcDigits = !lc.empty() && std::all_of(lc.begin(), lc.end(), ::isdigit);
  bool lcIsIndex = t.data.label_column_is_index;
  // (an index too large for any file: "does not exist" below, like any other missing column)
  auto indexOf = [&] { return lc.size() > 9 ? std::numeric_limits<int>::max() : std::stoi(lc); };
  // A compressed file (data.csv.gz) read as text would be refused for its first "line" of
  // binary: said as what it is.
  if (in.peek() == 0x1f) {
    char magic[2] = {0, 0};
    in.read(magic, 2);
    if (static_cast<unsigned char>(magic[1]) == 0x8b)
      throw SpecError(fmt::format("{}: it is gzip-compressed: gunzip it first (dtrain reads plain csv)", path));
    in.seekg(0);
  }
  // Spreadsheet exports: a UTF-8 byte order mark before the first line, spaces after commas.
  if (in.peek() == 0xEF) {
    char bom[3] = {0, 0, 0};
    in.read(bom, 3);
    if (std::string_view(bom, 3) != "\xEF\xBB\xBF") in.seekg(0);
  }
  if (t.data.header) {
    if (!getCsvLine(in, line, maxLine, path, 1))
      throw SpecError(fmt::format("{}: empty file; expected a header line", path));
    ++lineNo;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    // Old Mac line ends (CR alone): the whole file reads as one header line.
    if (line.find('\r') != std::string::npos)
      throw SpecError(fmt::format("{}:1: {}", path, kCrOnlyLines));
    auto names = split(line, ',');
    columns = static_cast<int>(names.size());
    if (!lcIsIndex && lcDigits)
      lcIsIndex = std::none_of(names.begin(), names.end(), [&](const std::string& n) { return trim(n) == lc; });
    if (lcIsIndex) labelCol = indexOf();
    // A file without a header read as one: its first row would be taken for the names and
    // trained without, silently. Names that are all numbers are that row.
    if ((lcIsIndex || lcDigits) && columns > 1 && std::all_of(names.begin(), names.end(), [](const std::string& n) {
          const std::string c = trim(n);
          char* end = nullptr;
          return !c.empty() && (std::strtod(c.c_str(), &end), end == c.c_str() + c.size());
        }))
      throw SpecError(fmt::format("{}:1: the header line holds only numbers (\"{}\"): a data row? set "
                                  "/trainer/data/header to false if the file has no header",
                                  path, shownCell(line.substr(0, utf8PrefixLength(line, 60)))));
    if (!lcIsIndex) {
      std::string found;
      for (int i = 0; i < columns; ++i) {
        const std::string n = trim(names[static_cast<size_t>(i)]);
        if (n == lc && labelCol >= 0)
          throw SpecError(
              fmt::format("{}:1: two columns are named \"{}\" (columns {} and {}, 0-based): which is the "
                          "label is not clear; rename one, or set /trainer/data/label_column to a 0-based "
                          "column index",
                          path, oneLine(lc), labelCol, i));
        if (n == lc) labelCol = i;
        if (i < 12) found += fmt::format("{}\"{}\"", i ? ", " : "", shownCell(n));
      }
      if (columns > 12) found += fmt::format(", ... ({} columns)", columns);
      if (labelCol < 0)
        throw SpecError(
            fmt::format("{}:1: no column named \"{}\" in the header (it has {}); set "
                        "/trainer/data/label_column to one of them or to a 0-based column index{}",
                        path, oneLine(lc), found, separatorHint(line)));
    }
  } else if (!lcIsIndex && !lcDigits) {
    throw SpecError(
        fmt::format("{}: without a header, /trainer/data/label_column must be a column index (a JSON "
                    "number, as in \"label_column\": 0)",
                    path));
  } else {
    labelCol = indexOf();
  }
  // The rows: cells are parsed in place (no string per cell) with from_chars, strtod only for
  // what it alone reads (a leading '+', hex); 5x faster than split + strtod on a 100 MB file,
  // which the launcher's pre-check and every worker each parse.
  std::vector<float> x, y;
  auto isBlank = [](char c) { return c == ' ' || c == '\t'; };
  uint64_t bytesSincePoll = 0;  // (wide rows: 65536 of 30 KB would take longer than the 10 s grace)
  while (getCsvLine(in, line, maxLine, path, lineNo + 1)) {
    ++lineNo;
    bytesSincePoll += line.size() + 1;
    if (poll && ((lineNo & 0xffff) == 0 || bytesSincePoll >= (4u << 20))) {
      bytesSincePoll = 0;
      poll();
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const int cellsHere = static_cast<int>(std::count(line.begin(), line.end(), ',')) + 1;
    if (columns < 0) columns = cellsHere;
    if (cellsHere != columns)
      throw SpecError(fmt::format("{}:{}: has {} columns, expected {} (as the {}); fix or drop the row (a "
                                  "comma inside a cell is not read: quoting is not supported)",
                                  path, lineNo, cellsHere, columns, t.data.header ? "header" : "first row"));
    if (labelCol >= columns)
      throw SpecError(
          fmt::format("{}: label column {} does not exist ({} columns); set /trainer/data/label_column to a "
                      "0-based index below {}",
                      path, lc, columns, columns));
    if (columns - 1 != inputs)
      throw SpecError(
          fmt::format("{}: has {} feature columns but /trainer/model/layers starts with {}; make the first "
                      "layer {} (or check /trainer/data/label_column and header){}",
                      path, columns - 1, inputs, columns - 1, separatorHint(line)));
    if (y.empty()) {
      // Room for about as many rows as the file holds at this row's length: growing by
      // doubling copied and page-faulted the features several times over.
      std::error_code sizeEc;
      const uintmax_t fileBytes = std::filesystem::file_size(path, sizeEc);
      const uint64_t rows = sizeEc ? 0 : std::min<uint64_t>(fileBytes / (line.size() + 1) * 11 / 10 + 16, 1u << 28);
      if (rows * static_cast<uint64_t>(inputs) < (1ull << 32)) {  // (no estimate worth 16 GB)
        x.reserve(rows * static_cast<uint64_t>(inputs));
        y.reserve(rows);
        adviseHugePages(x.data(), x.capacity() * sizeof(float));
      }
    }
    const char* p = line.data();
    const char* const lineEnd = line.data() + line.size();
    for (int i = 0; i < columns; ++i) {
      const char* cellEnd = static_cast<const char*>(std::memchr(p, ',', static_cast<size_t>(lineEnd - p)));
      if (!cellEnd) cellEnd = lineEnd;
      const char* b = p;
      const char* e = cellEnd;
      while (b < e && isBlank(*b)) ++b;
      while (e > b && isBlank(e[-1])) --e;
      p = cellEnd + 1;
      double v = 0;
      auto [stop, ec] = std::from_chars(b, e, v);
      if (b == e || ec != std::errc() || stop != e) {
        const std::string cell(b, e);
        char* end = nullptr;
        v = std::strtod(cell.c_str(), &end);
        // (a NUL inside the cell would end strtod's string there: "1\0zzz" read as 1)
        if (cell.empty() || end == cell.c_str() || *end != '\0' || cell.find('\0') != std::string::npos)
          throw SpecError(
              fmt::format("{}:{}: column {} (0-based, as /trainer/data/label_column counts) is not a number "
                          "(\"{}\"){}",
                          path, lineNo, i, shownCell(cell),
                          !cell.empty() && (cell.front() == '"' || cell.front() == '\'')
                              ? "; quoted cells are not read: remove the quotes"
                          : !t.data.header && y.empty()
                              ? "; if this line is a header, set /trainer/data/header to true"
                              : "; every cell must be a number (the label a class index): fix or drop the row"));
      }
      // inf, nan, or beyond float's range: one such value turns every weight into NaN.
      // (numpy prints float32's largest as 3.4028235e+38, a hair above it as a double: values
      // that round to it are in range; from FLT_MAX + half an ulp, 0x1.ffffffp127, they round
      // to infinity)
      if (!std::isfinite(v) || std::abs(v) >= 0x1.ffffffp127) {
        const std::string cell(b, e);
        throw SpecError(
            fmt::format("{}:{}: column {} (0-based) is not a finite number within float's range (\"{}\"); "
                        "fix or drop the row",
                        path, lineNo, i, shownCell(cell)));
      }
      if (i == labelCol) {
        if (!isLabel(t, v)) checkLabel(t, v, fmt::format("{}:{}", path, lineNo));  // throws, with where
        y.push_back(static_cast<float>(v));
      } else {
        x.push_back(static_cast<float>(v));
      }
    }
  }
  if (y.empty()) throw SpecError(fmt::format("{}: no data rows", path));
  return std::make_shared<TableSet>(inputs, std::move(x), std::move(y));
}

uint32_t be32(std::istream& in) {
  unsigned char b[4] = {0, 0, 0, 0};
  in.read(reinterpret_cast<char*>(b), 4);
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

// Up to `bytes` from `in`, in chunks: memory follows what the stream holds, not `bytes`.
std::vector<unsigned char> readUpTo(std::istream& in, uint64_t bytes, const std::function<void()>& poll) {
  std::vector<unsigned char> out;
  constexpr uint64_t kChunk = 4u << 20;
  while (out.size() < bytes && in) {
    if (poll) poll();
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(std::min(kChunk, bytes - at)));
    in.read(reinterpret_cast<char*>(out.data() + at), static_cast<std::streamsize>(out.size() - at));
    out.resize(at + static_cast<size_t>(in.gcount()));
  }
  return out;
}

std::shared_ptr<TableSet> loadIdx(const spec::TrainerSpec& t, const std::string& images, const std::string& labels,
                                  const std::function<void()>& poll) {
  std::ifstream fi(images, std::ios::binary), fl(labels, std::ios::binary);
  if (!fi) throw SpecError(fmt::format("{}: cannot open idx images file", images));
  if (!fl) throw SpecError(fmt::format("{}: cannot open idx labels file", labels));
  // A file shorter than its header is said as such (its "magic" would be read as zeros).
  auto checkHeader = [](std::ifstream& f, const std::string& path, std::streamoff need, const char* kind) {
    f.seekg(0, std::ios::end);
    if (!f) {  // a pipe: no size to know beforehand
      f.clear();
      return;
    }
    const std::streamoff size = f.tellg();
    f.seekg(0);
    if (size >= 0 && size < need)
      throw SpecError(
          fmt::format("{}: {} bytes, too short for an {} file (its header alone is {} bytes)", path, size, kind, need));
  };
  checkHeader(fi, images, 16, "idx3-ubyte images");
  checkHeader(fl, labels, 8, "idx1-ubyte labels");
  uint32_t magic = be32(fi);
  // MNIST is distributed gzip-compressed (train-images-idx3-ubyte.gz): 1f 8b is gzip's magic.
  auto gzipHint = [](uint32_t m) {
    return (m >> 16) == 0x1f8b ? std::string("; it is gzip-compressed: gunzip it first") : std::string();
  };
  if (magic != 0x00000803)
    throw SpecError(fmt::format("{}: not an idx3-ubyte images file (magic 0x{:08x}, expected 0x00000803){}", images,
                                magic, gzipHint(magic)));
  uint32_t n = be32(fi), rows = be32(fi), cols = be32(fi);
  uint32_t lmagic = be32(fl);
  if (lmagic != 0x00000801)
    throw SpecError(fmt::format("{}: not an idx1-ubyte labels file (magic 0x{:08x}, expected 0x00000801){}", labels,
                                lmagic, gzipHint(lmagic)));
  uint32_t ln = be32(fl);
  if (ln != n) throw SpecError(fmt::format("{}: {} labels for {} images in {}", labels, ln, n, images));
  if (n == 0) throw SpecError(fmt::format("{}: no images (the header's count is 0)", images));
  const int inputs = t.model.layers.front();
  if (static_cast<uint64_t>(rows) * cols != static_cast<uint64_t>(inputs))
    throw SpecError(fmt::format("{}: images are {}x{} = {} pixels but /trainer/model/layers starts with {}", images,
                                rows, cols, static_cast<uint64_t>(rows) * cols, inputs));
  // The header's count is not trusted with memory: what is read grows with what the file
  // holds, so a corrupt count (4 billion images) is a "truncated" error, not an allocation
  // of terabytes.
  std::vector<unsigned char> px = readUpTo(fi, static_cast<uint64_t>(n) * rows * cols, poll);
  std::vector<unsigned char> lb = readUpTo(fl, n, poll);
  if (px.size() < static_cast<uint64_t>(n) * rows * cols)
    throw SpecError(fmt::format("{}: truncated: the header says {} images, the file holds {}", images, n,
                                px.size() / (static_cast<uint64_t>(rows) * cols)));
  if (lb.size() < n)
    throw SpecError(fmt::format("{}: truncated: the header says {} labels, the file holds {}", labels, n, lb.size()));
  // Bytes past the header's count: two files joined, or a count not updated when rows were
  // appended; which rows are meant is not clear, so it is said rather than cut silently.
  const std::tuple<std::ifstream*, const std::string*, const char*> files[] = {{&fi, &images, "images"},
                                                                               {&fl, &labels, "labels"}};
  for (const auto& [f, path, what] : files) {
    if (f->peek() == std::char_traits<char>::eof()) continue;
    throw SpecError(
        fmt::format("{}: the header says {} {}, but the file holds more bytes after them; make the "
                    "header's count match the file (or cut the bytes after {} {})",
                    *path, n, what, n, what));
  }
  std::vector<float> x(px.size()), y(n);
  // In chunks, polled between them: a file of several GB takes seconds here too.
  constexpr size_t kPollEvery = 4u << 20;
  for (size_t b = 0; b < px.size(); b += kPollEvery) {
    if (poll) poll();
    for (size_t i = b, e = std::min(px.size(), b + kPollEvery); i < e; ++i) x[i] = static_cast<float>(px[i]) / 255.0f;
  }
  for (size_t b = 0; b < n; b += kPollEvery) {
    if (poll) poll();
    for (size_t i = b, e = std::min<size_t>(n, b + kPollEvery); i < e; ++i) {
      if (!isLabel(t, lb[i]))
        checkLabel(t, lb[i], fmt::format("{}: label #{}", labels, i));  // (the where only when bad)
      y[i] = lb[i];
    }
  }
  return std::make_shared<TableSet>(inputs, std::move(x), std::move(y));
}

}  // namespace

namespace {

std::shared_ptr<TableSet> loadFile(const spec::TrainerSpec& t, const std::string& path, const std::string& labels,
                                   const std::function<void()>& poll) {
  if (t.model.loss == "mse" && t.model.layers.back() != 1)
    throw SpecError(
        "trainer: /trainer/model/layers: file data sets have one target column: mse needs an output width of "
        "1; make the last layer 1");  // (refused by the spec's checks first; kept for callers without them)
  return t.data.type == "csv" ? loadCsv(t, path, poll) : loadIdx(t, path, labels, poll);
}

}  // namespace

namespace {

// The training file's table, and the held-out file's (null without eval_path).
struct Tables {
  std::shared_ptr<TableSet> all, eval;
};

Tables parseFiles(const spec::TrainerSpec& t, const std::function<void()>& poll) {
  const auto& d = t.data;
  Tables out;
  out.all = loadFile(t, d.path, d.labels_path, poll);
  if (!d.eval_path.empty()) out.eval = loadFile(t, d.eval_path, d.eval_labels_path, poll);
  return out;
}

Datasets slices(const Tables& tb) {
  const uint64_t n = tb.all->size();
  if (tb.eval) return {std::make_unique<Slice>(tb.all, 0, n), std::make_unique<Slice>(tb.eval, 0, tb.eval->size())};
  const uint64_t cut = n - n / 10;  // the last 10% are held out
  return {std::make_unique<Slice>(tb.all, 0, cut), std::make_unique<Slice>(tb.all, cut, n)};
}

// ---- The data image (data.h): a sealed memfd. Layout: ImageHeader, ImageTable[tables], the
// fingerprint, then each table's x and y floats at 64-byte aligned offsets. Native byte order:
// it never leaves the host.
constexpr char kImageMagic[8] = {'D', 'T', 'R', 'D', 'A', 'T', 'A', '1'};
constexpr uint64_t kImageAlign = 64;
constexpr int kImageSeals = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;

struct ImageHeader {
  char magic[8];
  uint64_t total;        // the file's size
  uint64_t fingerprint;  // its length
  uint64_t tables;       // 1, or 2 with an eval file
};
struct ImageTable {
  uint64_t inputs, rows, x, y;  // x, y: offsets
};

uint64_t alignUp(uint64_t v) { return (v + kImageAlign - 1) / kImageAlign * kImageAlign; }

// What the image was made from: the data fields that change a parse, and each file's identity,
// size, and modification and change times (a file rewritten since the launcher read it does
// not match; the change time also catches a rewrite of the same size whose modification time
// was put back, as `cp -p` or `rsync -t` do). "" when a file cannot be looked at (no image:
// the parse says what is wrong).
std::string fingerprint(const spec::TrainerSpec& t) {
  const auto& d = t.data;
  std::string f =
      fmt::format("type={};inputs={};outputs={};loss={};label_column={}{};header={}", d.type, t.model.layers.front(),
                  t.model.layers.back(), t.model.loss, d.label_column, d.label_column_is_index ? "#" : "", d.header);
  for (const std::string* path : {&d.path, &d.labels_path, &d.eval_path, &d.eval_labels_path}) {
    if (path->empty()) {
      f += ";-";
      continue;
    }
    struct stat st {};
    if (::stat(path->c_str(), &st) != 0) return "";
    // (a pipe is read once, by the launcher: its times change as it is written, and no
    // worker could read it again anyway)
    if (!S_ISREG(st.st_mode)) {
      f += fmt::format(";{}:{}:once", static_cast<unsigned long long>(st.st_dev),
                       static_cast<unsigned long long>(st.st_ino));
      continue;
    }
    f += fmt::format(";{}:{}:{}:{}.{:09}:{}.{:09}", static_cast<unsigned long long>(st.st_dev),
                     static_cast<unsigned long long>(st.st_ino), static_cast<long long>(st.st_size),
                     static_cast<long long>(st.st_mtim.tv_sec), static_cast<long>(st.st_mtim.tv_nsec),
                     static_cast<long long>(st.st_ctim.tv_sec), static_cast<long>(st.st_ctim.tv_nsec));
  }
  return f;
}

// A read-only mapping of a whole image; the views' owner.
struct Mapping {
  void* p = MAP_FAILED;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (p != MAP_FAILED) ::munmap(p, bytes);
  }
};

// Copies `bytes` of the parse's memory at `src` into the image in 64 MiB pieces, giving each
// piece's whole pages back to the system once copied (MADV_DONTNEED; the parse is discarded
// right after, its contents no longer read): the launcher holds about one copy of the data
// while it writes the image, not two.
void moveInto(char* dst, const void* src, size_t bytes) {
  char* from = const_cast<char*>(static_cast<const char*>(src));  // (the parse's own, see above)
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  constexpr size_t kPiece = size_t{64} << 20;
  for (size_t at = 0; at < bytes; at += kPiece) {
    const size_t n = std::min(kPiece, bytes - at);
    std::memcpy(dst + at, from + at, n);
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(from + at) + page - 1) / page * page;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(from + at + n) / page * page;
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }
}

// Writes `tb` into a new sealed memfd; throws IoError naming the call that failed. Once
// *consumed is set, tb's rows are gone (moved into the image: moveInto).
Fd writeImage(const Tables& tb, const std::string& fp, uint64_t* bytes, bool* consumed) {
  std::vector<const TableSet*> sets{tb.all.get()};
  if (tb.eval) sets.push_back(tb.eval.get());
  std::vector<ImageTable> tables;
  uint64_t at = alignUp(sizeof(ImageHeader) + sets.size() * sizeof(ImageTable) + fp.size());
  for (const TableSet* t : sets) {
    ImageTable it{static_cast<uint64_t>(t->inputs()), t->size(), 0, 0};
    it.x = at;
    at = alignUp(at + it.rows * it.inputs * sizeof(float));
    it.y = at;
    at = alignUp(at + it.rows * sizeof(float));
    tables.push_back(it);
  }
  const uint64_t total = at;
  Fd fd(static_cast<int>(::syscall(SYS_memfd_create, "dtrain-data", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!fd) throwErrno("memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0)
    throwErrno(fmt::format("ftruncate to {}", formatBytes(total)));
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) throwErrno("mmap");
  char* base = static_cast<char*>(p);
  ImageHeader h{};
  std::memcpy(h.magic, kImageMagic, sizeof(h.magic));
  h.total = total;
  h.fingerprint = fp.size();
  h.tables = sets.size();
  std::memcpy(base, &h, sizeof(h));
  std::memcpy(base + sizeof(h), tables.data(), tables.size() * sizeof(ImageTable));
  std::memcpy(base + sizeof(h) + tables.size() * sizeof(ImageTable), fp.data(), fp.size());
  *consumed = true;
  for (size_t i = 0; i < sets.size(); ++i) {
    moveInto(base + tables[i].x, sets[i]->x(), tables[i].rows * tables[i].inputs * sizeof(float));
    moveInto(base + tables[i].y, sets[i]->y(), tables[i].rows * sizeof(float));
  }
  ::munmap(p, total);  // (a writable mapping would make F_SEAL_WRITE fail with EBUSY)
  if (::fcntl(fd.get(), F_ADD_SEALS, kImageSeals) != 0) throwErrno("fcntl(F_ADD_SEALS)");
  *bytes = total;
  return fd;
}

// The data sets viewed in the image `fd`, checked against `t` and the fingerprint `fp` (its
// size, offsets and seals too: nothing in it is trusted). nullopt with *why when it cannot be
// used.
std::optional<Datasets> mapImage(int fd, const spec::TrainerSpec& t, const std::string& fp, uint64_t* bytes,
                                 std::string* why) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *why = fmt::format("descriptor {}: {}", fd, std::strerror(errno));
    return std::nullopt;
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kImageSeals) != kImageSeals) {
    *why = fmt::format("descriptor {} is not a sealed data image", fd);
    return std::nullopt;
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < sizeof(ImageHeader)) {
    *why = fmt::format("descriptor {}: {} bytes, shorter than a data image's header", fd, size);
    return std::nullopt;
  }
  auto m = std::make_shared<Mapping>();
  m->p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (m->p == MAP_FAILED) {
    *why = fmt::format("mmap of {}: {}", formatBytes(size), std::strerror(errno));
    return std::nullopt;
  }
  m->bytes = size;
  const char* base = static_cast<const char*>(m->p);
  ImageHeader h;
  std::memcpy(&h, base, sizeof(h));
  const uint64_t wantTables = t.data.eval_path.empty() ? 1 : 2;
  if (std::memcmp(h.magic, kImageMagic, sizeof(h.magic)) != 0 || h.total != size || h.tables != wantTables ||
      h.fingerprint > size || sizeof(h) + h.tables * sizeof(ImageTable) + h.fingerprint > size) {
    *why = fmt::format("descriptor {} does not hold a data image of this dtrain's format", fd);
    return std::nullopt;
  }
  const char* fpAt = base + sizeof(h) + h.tables * sizeof(ImageTable);
  if (fp.empty() || std::string_view(fpAt, h.fingerprint) != fp) {
    *why = "it was made from other data (a data file or the spec's data fields changed since the launch)";
    return std::nullopt;
  }
  std::shared_ptr<TableSet> sets[2];
  for (uint64_t i = 0; i < h.tables; ++i) {
    ImageTable it;
    std::memcpy(&it, base + sizeof(h) + i * sizeof(ImageTable), sizeof(it));
    uint64_t xBytes = 0, cells = 0;
    const bool bad = it.inputs != static_cast<uint64_t>(t.model.layers.front()) || it.rows == 0 ||
                     __builtin_mul_overflow(it.rows, it.inputs, &cells) ||
                     __builtin_mul_overflow(cells, sizeof(float), &xBytes) || it.x % alignof(float) ||
                     it.y % alignof(float) || it.x > size || xBytes > size - it.x || it.y > size ||
                     it.rows > (size - it.y) / sizeof(float);
    if (bad) {
      *why = fmt::format("descriptor {}: table {} of the data image is malformed", fd, i);
      return std::nullopt;
    }
    sets[i] =
        std::make_shared<TableSet>(static_cast<int>(it.inputs), it.rows, reinterpret_cast<const float*>(base + it.x),
                                   reinterpret_cast<const float*>(base + it.y), m);
  }
  *bytes = size;
  return slices({sets[0], sets[1]});
}

}  // namespace

std::pair<std::string, std::string> onceReadableDataFile(const spec::TrainerSpec& t) {
  const auto& d = t.data;
  if (d.type == "synthetic") return {};
  const std::pair<const char*, const std::string*> files[] = {{"/trainer/data/path", &d.path},
                                                              {"/trainer/data/labels_path", &d.labels_path},
                                                              {"/trainer/data/eval_path", &d.eval_path},
                                                              {"/trainer/data/eval_labels_path", &d.eval_labels_path}};
  for (const auto& [pointer, path] : files) {
    struct stat st {};
    if (!path->empty() && ::stat(path->c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return {pointer, *path};
  }
  return {};
}

bool dataShareEnabled() { return envSwitch("DTRAIN_DATA_SHARE").value_or(true); }

SharedDatasets openSharedDatasets(const spec::TrainerSpec& t, const std::function<void()>& poll, bool makeImage) {
  SharedDatasets out;
  if (t.data.type == "synthetic") {
    out.sets = {std::make_unique<SyntheticSet>(t, false), std::make_unique<SyntheticSet>(t, true)};
    return out;
  }
  // (taken before and after the parse: a file replaced while it was read gets no image)
  const std::string fpBefore = makeImage ? fingerprint(t) : "";
  Tables tb = parseFiles(t, poll);
  if (!makeImage) {
    out.sets = slices(tb);
    return out;
  }
  const std::string fp = fingerprint(t);
  std::string why = fp.empty()       ? "a data file cannot be looked at"
                    : fp != fpBefore ? "a data file changed while it was read"
                                     : "";
  bool consumed = false;
  if (why.empty()) {
    try {
      uint64_t bytes = 0;
      Fd fd = writeImage(tb, fp, &bytes, &consumed);
      if (auto sets = mapImage(fd.get(), t, fp, &bytes, &why)) {
        out.sets = std::move(*sets);  // (the parse's own copy goes with tb)
        out.sets.shared = true;
        out.image.fd = std::move(fd);
        out.image.bytes = bytes;
        out.image.fingerprint = fp;
        return out;
      }
    } catch (const IoError& e) {
      why = e.what();
    }
  }
  if (consumed) tb = parseFiles(t, poll);  // (its rows went into the image that failed)
  out.sets = slices(tb);
  out.image.problem = why;
  return out;
}

std::string refreshDataImage(const spec::TrainerSpec& t, DataImage& image, const std::function<void()>& poll) {
  if (!image.fd) return "";
  const std::string now = fingerprint(t);
  if (now == image.fingerprint) return "";
  // Which file: the fingerprint's parts after the fields are the four paths', in order.
  std::string which = "a data file";
  const auto& d = t.data;
  const std::string* paths[] = {&d.path, &d.labels_path, &d.eval_path, &d.eval_labels_path};
  const auto parts = [](const std::string& f) {
    std::vector<std::string> out;
    for (size_t at = 0;;) {
      const size_t semi = f.find(';', at);
      out.push_back(f.substr(at, semi == std::string::npos ? semi : semi - at));
      if (semi == std::string::npos) return out;
      at = semi + 1;
    }
  };
  const auto was = parts(image.fingerprint), is = parts(now);
  constexpr size_t kFields = 6;  // (type, inputs, outputs, loss, label_column, header)
  for (size_t i = 0; i < 4; ++i) {
    const size_t k = kFields + i;
    if (k < was.size() && (k >= is.size() || was[k] != is[k]) && !paths[i]->empty()) {
      which = *paths[i];
      break;
    }
  }
  std::error_code ec;
  const bool gone = !std::filesystem::exists(which, ec);
  // The old image first: its memory is given back before the new one is made (no worker
  // maps it any more between attempts).
  image = DataImage{};
  try {
    SharedDatasets fresh = openSharedDatasets(t, poll, true);
    image = std::move(fresh.image);
  } catch (const SpecError& e) {
    image.problem = e.what();
  }
  if (!image.fd)
    return fmt::format("{} {} since the data image was made; the workers read the files ({})", which,
                       gone ? "is gone" : "changed", image.problem);
  return fmt::format("{} changed since the data image was made; made it again from the file as it is now ({})",
                     which, image.bytes < (1u << 20) ? fmt::format("{} KiB", (image.bytes + 1023) / 1024)
                                                      : formatBytes(image.bytes));
}

Datasets openDatasets(const spec::TrainerSpec& t, const std::function<void()>& poll) {
  const auto& d = t.data;
  if (d.type == "synthetic") return {std::make_unique<SyntheticSet>(t, false), std::make_unique<SyntheticSet>(t, true)};
  const char* env = std::getenv(kDataImageEnv);
  if (!env || !*env) return slices(parseFiles(t, poll));
  std::string why;
  int fd = -1;
  const std::string_view v(env);
  if (std::from_chars(v.data(), v.data() + v.size(), fd).ptr != v.data() + v.size() || fd < 0) {
    why = fmt::format("{}=\"{}\" is not a descriptor", kDataImageEnv, env);
  } else {
    uint64_t bytes = 0;
    if (auto sets = mapImage(fd, t, fingerprint(t), &bytes, &why)) {
      // (the mapping holds the memory: no process this one starts needs the descriptor)
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
      sets->shared = true;
      sets->note = fmt::format("mapped from this host's data image ({}), shared by this host's workers",
                               bytes < (1u << 20) ? fmt::format("{} KiB", (bytes + 1023) / 1024) : formatBytes(bytes));
      return std::move(*sets);
    }
  }
  Datasets out = slices(parseFiles(t, poll));
  out.note = fmt::format("parsed from the files: this host's data image could not be used ({})", why);
  return out;
}

}  // namespace dtrain::train
