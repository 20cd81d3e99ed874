#include "dtrain/spec/job_spec.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <map>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/common/system_cpus.h"
#include "input_file.h"
#include "node_checks.h"

namespace dtrain::spec {
namespace {

using nlohmann::json;

const std::vector<std::string> kTopKeys = {
    "name",         "command",       "env",           "cwd",      "nproc_per_node",
    "log_dir",      "max_restarts",  "rendezvous",    "nodes",    "hostfile",
    "trainer",      "shutdown_timeout_s", "prefix_output", "console_ranks", "ssh",
    "env_forward",  "env_file",      "min_nodes",     "max_nodes", "worker_timeout_s",
    "restart_backoff_s"};
const std::vector<std::string> kRendezvousKeys = {"port", "timeout_s", "addr", "master_addr", "heartbeat_timeout_s"};
const std::vector<std::string> kNodeKeys = {"host", "slots", "user", "port", "address", "gpus"};
const std::vector<std::string> kSshKeys = {"user", "port", "identity_file", "connect_timeout_s",
                                           "options", "host_key_checking", "dtrain_path"};
const std::vector<std::string> kTrainerKeys = {"model", "data", "batch_size", "epochs", "max_steps", "optimizer",
                                               "device", "seed", "bucket_mb", "overlap", "log_every_steps", "checkpoint",
                                               "lr_schedule", "grad_clip_norm", "parallel"};
const std::vector<std::string> kParallelKeys = {"pipeline_stages", "micro_batches", "schedule", "stage_layers"};
const std::vector<std::string> kModelKeys = {"type", "layers", "activation", "loss"};
const std::vector<std::string> kDataKeys = {"type", "train_samples", "eval_samples", "seed", "path", "labels_path",
                                            "eval_path", "eval_labels_path", "label_column", "header", "prefetch",
                                            "loader_threads"};
const std::vector<std::string> kOptimizerKeys = {"type", "lr", "momentum", "nesterov", "weight_decay", "betas", "eps"};
const std::vector<std::string> kScheduleKeys = {"type", "step_size", "gamma", "warmup_steps", "min_lr"};
const std::vector<std::string> kCheckpointKeys = {"dir", "every_steps", "async"};

// A key as a JSON pointer token (RFC 6901): '~' is written ~0 and '/' ~1.
std::string pointerToken(const std::string& key) {
  std::string out;
  for (char ch : key) out += ch == '~' ? std::string("~0") : ch == '/' ? std::string("~1") : std::string(1, ch);
  return out;
}

// A string as JSON writes it: quoted, with escapes.
std::string jsonQuoted(const std::string& s) { return json(s).dump(-1, ' ', false, json::error_handler_t::replace); }

std::string typeName(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return j.get<bool>() ? "true" : "false";
    case json::value_t::string: return fmt::format("the string {}", jsonQuoted(j.get<std::string>()));
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return j.dump();
  }
}

// "; write the number without quotes" when a field that takes a number got one as a string.
std::string quotedNumberHint(const json& j) {
  if (!j.is_string()) return "";
  const std::string s = j.get<std::string>();
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return "";
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() ? "; numbers are JSON numbers: write it without quotes" : "";
}

// A command given as one string ("python3 train.py"): the array it most likely means, its
// words split on spaces (no shell runs it); a shell's syntax keeps the string, under sh -c.
std::string commandArrayHint(const json& j) {
  if (!j.is_string()) return "";
  const std::string s = j.get<std::string>();
  if (s.find_first_of("'\"\\$|&;<>*?`(){}~") != std::string::npos)
    return fmt::format("; write it as an array, and to have a shell read it: [\"sh\", \"-c\", {}]", jsonQuoted(s));
  std::vector<std::string> words;
  for (const std::string& w : split(s, ' '))
    if (!w.empty()) words.push_back(jsonQuoted(w));
  if (words.empty()) return "";
  return fmt::format("; write it as an array: [{}]", fmt::join(words, ", "));
}

// Environment variable names, wherever they are given (spec "env", "env_file", --env): what
// a POSIX shell takes, [A-Za-z_][A-Za-z0-9_]*. "" when fine, else the problem.
std::string envNameProblem(const std::string& name) {
  auto letter = [](char ch) { return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || ch == '_'; };
  bool ok = !name.empty() && letter(name[0]) &&
            std::all_of(name.begin(), name.end(), [&](char ch) { return letter(ch) || (ch >= '0' && ch <= '9'); });
  if (ok) return "";
  return fmt::format("bad variable name {}; names are letters, digits and '_', not starting with a digit", jsonQuoted(name));
}

// A worker identity variable given by the job: the problem and the fix, "" for other names.
std::string identityProblem(const std::string& name) {
  // dtrain's own wiring of a worker to this run: a value from the job would connect every
  // worker to another store, run or round (a trainer's store login fails; a port that
  // answers nothing waits out its timeout).
  static const std::map<std::string, std::string> kRunVars = {
      {"DTRAIN_STORE_ADDR", "the address of this run's store"},
      {"DTRAIN_STORE_PORT", "the port of this run's store"},
      {"DTRAIN_STORE_TOKEN", "this run's secret for its store"},
      {"DTRAIN_RUN_ID", "this run's id"},
      {"DTRAIN_ROUND", "the rendezvous round"},
      {"DTRAIN_RESTART_COUNT", "the restarts so far"},
      {"DTRAIN_NODE_RANK", "the rank of the worker's node"},
      {"DTRAIN_NNODES", "the number of nodes"},
      {"DTRAIN_DATA_FD", "the descriptor of the launcher's data image"},
  };
  if (const auto run = kRunVars.find(name); run != kRunVars.end())
    return fmt::format("{} is set by dtrain for every worker ({}), and a value here would replace it in all of them; "
                       "remove it",
                       name, run->second);
  const std::string what = workerIdentityVar(name);
  if (what.empty()) return "";
  return fmt::format("{} is set by dtrain for every worker ({}, from the job's layout), and a value here would "
                     "replace it in all of them; remove it (the layout comes from nproc_per_node and the hosts' slots)",
                     name, what);
}

// MASTER_ADDR / MASTER_PORT given by the job: allowed (the torchrun way to choose them,
// docs/job-spec.md), said once as a warning naming `where`; "" for other names.
std::string masterOverrideWarning(const std::string& where, const std::string& name, const std::string& value) {
  if (name == "MASTER_PORT")
    return oneLine(fmt::format("{}: MASTER_PORT={} replaces the free port dtrain picks for the workers' process group: "
                               "it must be free on node 0 when the workers start, and two jobs given the same port "
                               "collide; leave it out to get a free one",
                               where, value));
  if (name == "MASTER_ADDR")
    return oneLine(fmt::format("{}: MASTER_ADDR={} replaces the address dtrain gives the workers (127.0.0.1 on one "
                               "node, else node 0's): every rank must reach rank 0 there; leave it out unless that is "
                               "the point",
                               where, value));
  return "";
}

// MASTER_PORT given by the job on the store's own port (rendezvous.port): the workers' process
// group could never bind it (the store holds it from the start). The problem and the fix, or "".
std::string masterPortClash(const JobSpec& spec, const std::string& value) {
  if (spec.rendezvous.port == 0 || value != std::to_string(spec.rendezvous.port)) return "";
  return fmt::format("MASTER_PORT={} is the job's store port (/rendezvous/port), which the store holds while the "
                     "job runs, so rank 0 could not listen there; give MASTER_PORT another port, or leave it out",
                     value);
}

// MASTER_PORT given by the job must be a port the workers' process group can use: an integer
// 1..65535 in decimal (torch reads it with int(); 99999 or "notaport" only failed in every
// worker, after the launch). The problem and the fix, "" when fine or for other names.
// Also DTRAIN_COMM_SHM and DTRAIN_COMM_CHECK, dtrain's switches its workers read: 0 or 1 (and
// the other spellings envSwitch takes), said here rather than by every worker after the launch.
// Linux's limit on one string of exec's argv or environment (MAX_ARG_STRLEN, 32 pages), the
// NUL included: a longer one fails every worker's exec with E2BIG.
constexpr size_t kMaxArgStrlen = 131072;

std::string envValueProblem(const std::string& name, const std::string& value) {
  if (name.size() + value.size() + 2 > kMaxArgStrlen)
    return fmt::format(
        "the value of {} is {} bytes, and Linux passes at most {} bytes in one environment string "
        "(NAME=value, MAX_ARG_STRLEN): no worker could start; put large values in a file and pass "
        "its path",
        name, value.size(), kMaxArgStrlen - name.size() - 2);
  if (name == "DTRAIN_COMM_SHM" || name == "DTRAIN_COMM_CHECK") {
    try {
      (void)parseSwitch(name, value);
    } catch (const SpecError& e) {
      return e.what();
    }
    return "";
  }
  if (name != "MASTER_PORT") return "";
  const bool digits = !value.empty() && value.size() <= 5 && value.find_first_not_of("0123456789") == std::string::npos;
  if (digits && std::stoi(value) >= 1 && std::stoi(value) <= 65535) return "";
  return oneLine(fmt::format("MASTER_PORT={}: expected a port, an integer between 1 and 65535; give one, or leave "
                             "MASTER_PORT out to get a free port picked by dtrain",
                             jsonQuoted(value)));
}

// The bounds a number field accepts: [lo, hi], or open at one end.
enum class Bounds { kClosed, kOpenLow, kOpenHigh };

// Collects the file name so that every error reads "<file>: <pointer>: <problem>".
class Checker {
 public:
  explicit Checker(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& pointer, const std::string& msg) const {
    throw SpecError(oneLine(fmt::format("{}: {}: {}", source_, pointer, msg)));
  }

  void checkKeys(const json& obj, const std::string& pointer, const std::vector<std::string>& allowed) const {
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      if (std::find(allowed.begin(), allowed.end(), it.key()) != allowed.end()) continue;
      std::string hint = closestMatch(it.key(), allowed);
      std::string where = pointer + "/" + pointerToken(it.key());
      if (!hint.empty())
        fail(where, fmt::format("unknown key \"{}\"; did you mean \"{}\"?", it.key(), hint));
      fail(where, fmt::format("unknown key \"{}\"; known keys: {}", it.key(), fmt::join(allowed, ", ")));
    }
  }

  // Every string of a spec ends up in a command line, the environment, a path or a name,
  // none of which can carry a NUL: "x", NUL, "y" would silently become "x".
  std::string str(const json& j, const std::string& pointer, bool allowEmpty = true) const {
    if (!j.is_string()) fail(pointer, fmt::format("expected a string, got {}", typeName(j)));
    std::string s = j.get<std::string>();
    if (!allowEmpty && s.empty()) fail(pointer, "expected a non-empty string, got \"\"");
    if (s.find('\0') != std::string::npos)
      fail(pointer, "contains a NUL character (\\u0000), which a command line, environment or path cannot carry; remove it");
    return s;
  }

  // An integer in lo..hi, written as a JSON number. `what` names it ("a worker count"); the
  // message adds the range, then `alt` (e.g. " or \"auto\"").
  long long integer(const json& j, const std::string& pointer, long long lo, long long hi, const std::string& what,
                    const std::string& alt = "") const {
    const std::string expected = fmt::format("expected {} between {} and {}{}", what, lo, hi, alt);
    if (j.is_number_float()) {
      double d = j.get<double>();
      bool whole = d == std::floor(d) && d >= static_cast<double>(lo) && d <= static_cast<double>(hi);
      // (a whole number written as a decimal, 1e3 or 1000.0: the fix names the integer, not
      // only the JSON form "1000.0" that is all the parser keeps of it)
      fail(pointer, fmt::format("{}, got {}{}", expected, j.dump(),
                                whole ? fmt::format("; write it as {:.0f}, without a decimal point or exponent", d) : ""));
    }
    if (!j.is_number()) fail(pointer, fmt::format("{}, got {}{}", expected, typeName(j), quotedNumberHint(j)));
    if (j.is_number_unsigned() && j.get<unsigned long long>() > static_cast<unsigned long long>(hi))
      fail(pointer, fmt::format("{}, got {}", expected, j.dump()));
    long long v = j.get<long long>();
    if (v < lo || v > hi) fail(pointer, fmt::format("{}, got {}", expected, v));
    return v;
  }

  // A number in [lo, hi] (or open at one end), written as a JSON number; messages as integer's.
  double number(const json& j, const std::string& pointer, double lo, double hi, const std::string& what,
                const std::string& alt = "", Bounds b = Bounds::kClosed) const {
    std::string range = b == Bounds::kOpenLow    ? fmt::format("in ({}, {}]", lo, hi)
                        : b == Bounds::kOpenHigh ? fmt::format("in [{}, {})", lo, hi)
                                                 : fmt::format("between {} and {}", lo, hi);
    const std::string expected = fmt::format("expected {} {}{}", what, range, alt);
    if (!j.is_number()) fail(pointer, fmt::format("{}, got {}{}", expected, typeName(j), quotedNumberHint(j)));
    double v = j.get<double>();
    bool ok = (b == Bounds::kOpenLow ? v > lo : v >= lo) && (b == Bounds::kOpenHigh ? v < hi : v <= hi);
    if (!ok) fail(pointer, fmt::format("{}, got {}", expected, j.dump()));
    return v;
  }

  bool boolean(const json& j, const std::string& pointer) const {
    if (!j.is_boolean()) fail(pointer, fmt::format("expected true or false, got {}", typeName(j)));
    return j.get<bool>();
  }

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

// nlohmann reports a byte offset; users want line:column.
std::pair<size_t, size_t> lineColumn(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i + 1 < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

std::string stripJsonPrefix(const std::string& what) {
  // "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error ..."
  auto pos = what.find(": ");
  std::string rest = pos == std::string::npos ? what : what.substr(pos + 2);
  return rest;
}

// The first occurrence of token in text that is not inside a JSON string literal.
size_t numberOutsideStrings(const std::string& text, const std::string& token) {
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char ch = text[i];
    if (inString) {
      if (ch == '\\') ++i;
      else if (ch == '"') inString = false;
    } else if (ch == '"') {
      inString = true;
    } else if (text.compare(i, token.size(), token) == 0) {
      return i;
    }
  }
  return std::string::npos;
}

// Feeds the parser one byte at a time and remembers the last byte it read, so that the parser
// callback knows where in the text it is (nlohmann's callback gets no position).
class TrackingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;
  TrackingIterator(const char* p, const char** last) : p_(p), last_(last) {}
  reference operator*() const {
    *last_ = p_;
    return *p_;
  }
  TrackingIterator& operator++() {
    ++p_;
    return *this;
  }
  TrackingIterator operator++(int) {
    TrackingIterator before = *this;
    ++p_;
    return before;
  }
  bool operator==(const TrackingIterator& o) const { return p_ == o.p_; }
  bool operator!=(const TrackingIterator& o) const { return p_ != o.p_; }

 private:
  const char* p_;
  const char** last_;
};

// The byte offset of the opening quote of the string literal whose closing quote is at `close`.
size_t stringStart(const std::string& text, size_t close) {
  for (size_t i = close; i-- > 0;) {
    if (text[i] != '"') continue;
    size_t backslashes = 0;
    while (backslashes < i && text[i - 1 - backslashes] == '\\') ++backslashes;
    if (backslashes % 2 == 0) return i;
  }
  return 0;
}

// json::parse, except that a key given twice in one object is an error: nlohmann keeps the
// last one, so {"nproc_per_node": 2, "nproc_per_node": 8} would silently run 8.
constexpr size_t kMaxJsonDepth = 64;

// The first key given twice is kept in `duplicate` (its object's path, the message) and the
// parse goes on: the caller says it once the job's name is read (a summary of the refused
// spec then names its job), or says an error of the JSON itself first.
struct DuplicateKey {
  std::string path, message;
};
json parseRefusingDuplicateKeys(const std::string& text, const Checker& c, std::optional<DuplicateKey>& duplicate) {
  struct Frame {
    bool object;
    std::string path;                     // JSON pointer of this object or array
    std::map<std::string, size_t> keys;   // object: keys seen, at the byte offset of their quote
    std::string key;                      // object: the key of the value being read
    size_t index = 0;                     // array: the index of the next element
  };
  std::vector<Frame> stack;
  const char* last = text.data();
  auto childPath = [&]() -> std::string {
    if (stack.empty()) return "";
    Frame& f = stack.back();
    return f.object ? f.path + "/" + pointerToken(f.key) : f.path + "/" + std::to_string(f.index++);
  };
  auto where = [&](size_t byte) {
    auto [line, col] = lineColumn(text, byte + 1);
    return fmt::format("line {}, column {}", line, col);
  };
  using E = json::parse_event_t;
  json::parser_callback_t callback = [&](int, E event, json& parsed) -> bool {
    switch (event) {
      case E::object_start:
      case E::array_start: {
        // No field nests deeper than a few levels; a file nested thousands deep (each level's
        // path kept here) would take time and memory growing with the square of its depth.
        if (stack.size() >= kMaxJsonDepth) {
          auto [line, col] = lineColumn(text, static_cast<size_t>(last - text.data()));
          throw SpecError(fmt::format("{}:{}:{}: invalid JSON: nested more than {} levels deep; no field of a job spec "
                                      "nests more than 4, so this is not a job spec (check the file)",
                                      c.source(), line, col, kMaxJsonDepth));
        }
        std::string path = childPath();
        stack.push_back(Frame{event == E::object_start, std::move(path), {}, {}, 0});
        break;
      }
      case E::key: {
        Frame& f = stack.back();
        std::string key = parsed.get<std::string>();
        size_t at = stringStart(text, static_cast<size_t>(last - text.data()));
        auto [first, fresh] = f.keys.emplace(key, at);
        if (!fresh && !duplicate)
          duplicate = DuplicateKey{f.path.empty() ? "/" : f.path,
                                   fmt::format("key {} is given twice ({}, then {}); the second would silently "
                                               "override the first; keep one of them",
                                               jsonQuoted(key), where(first->second), where(at))};
        f.key = std::move(key);
        break;
      }
      case E::value:
        if (!stack.empty() && !stack.back().object) ++stack.back().index;
        break;
      case E::object_end:
      case E::array_end:
        stack.pop_back();
        break;
    }
    return true;
  };
  return json::parse(TrackingIterator(text.data(), &last), TrackingIterator(text.data() + text.size(), &last), callback);
}

bool isDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}
// A device or socket: data that never ends (/dev/zero) or is not a file's.
bool isSpecialFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISSOCK(st.st_mode));
}

// --nproc-per-node's text (the spec's nproc_per_node is a JSON number or "auto").
void parseNproc(const std::string& value, JobSpec& spec, const std::function<void(const std::string&)>& bad) {
  if (value == "auto") {
    spec.nproc_auto = true;
    return;
  }
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (...) {
    used = 0;
  }
  if (value == "gpu" || value == "cpu")
    bad(fmt::format("expected a worker count or \"auto\", got torchrun's \"{}\"; dtrain's \"auto\" is one worker "
                    "per visible GPU, else per CPU core, or give the count",
                    value));
  if (used != value.size() || value.empty() || v < 1 || v > kMaxProcsPerNode)
    bad(fmt::format("expected a worker count between 1 and {} or \"auto\", got \"{}\"", kMaxProcsPerNode, value));
  spec.nproc_auto = false;
  spec.nproc_per_node = static_cast<int>(v);
}

std::vector<int> parseRankList(const std::string& value, const std::function<void(const std::string&)>& bad) {
  std::vector<int> out;
  for (const auto& part : split(value, ',')) {
    size_t used = 0;
    long v = -1;
    try {
      v = std::stol(part, &used);
    } catch (...) {
      used = 0;
    }
    if (part.empty() || used != part.size() || v < 0 || v > kMaxProcsPerNode - 1)
      bad(fmt::format("expected comma-separated local ranks between 0 and {} like \"0,2\", got \"{}\"",
                      kMaxProcsPerNode - 1, value));
    out.push_back(static_cast<int>(v));
  }
  return out;
}

std::string oneOf(const Checker& c, const json& j, const std::string& p, const std::vector<std::string>& allowed) {
  std::string v = c.str(j, p);
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
    std::string hint = closestMatch(v, allowed);
    // What other tools call a GPU device (by spelling, "gpu" is closest to "cpu").
    if ((v == "gpu" || v == "GPU" || v == "nvidia") && std::find(allowed.begin(), allowed.end(), "cuda") != allowed.end())
      hint = "cuda";
    c.fail(p, fmt::format("\"{}\" is not one of {}{}", v, fmt::join(allowed, ", "),
                          hint.empty() ? "" : fmt::format("; did you mean \"{}\"?", hint)));
  }
  return v;
}

TrainerSpec parseTrainer(const Checker& c, const json& t) {
  const std::string P = "/trainer";
  if (!t.is_object()) c.fail(P, fmt::format("expected an object, got {}", typeName(t)));
  c.checkKeys(t, P, kTrainerKeys);
  TrainerSpec ts;
  if (!t.contains("model")) c.fail(P + "/model", "missing; e.g. {\"type\": \"mlp\", \"layers\": [784, 256, 10]}");
  const json& m = t["model"];
  if (!m.is_object()) c.fail(P + "/model", fmt::format("expected an object, got {}", typeName(m)));
  c.checkKeys(m, P + "/model", kModelKeys);
  if (m.contains("type")) ts.model.type = oneOf(c, m["type"], P + "/model/type", {"mlp"});
  if (!m.contains("layers") || !m["layers"].is_array())
    c.fail(P + "/model/layers", "expected an array of layer widths, input first, e.g. [784, 256, 10]");
  const json& layers = m["layers"];
  if (layers.size() < 2) c.fail(P + "/model/layers", "needs at least an input and an output width");
  for (size_t i = 0; i < layers.size(); ++i)
    ts.model.layers.push_back(static_cast<int>(c.integer(layers[i], fmt::format("{}/model/layers/{}", P, i), 1, 1 << 20, "a layer width")));
  if (m.contains("activation")) ts.model.activation = oneOf(c, m["activation"], P + "/model/activation", {"relu", "gelu"});
  if (m.contains("loss")) ts.model.loss = oneOf(c, m["loss"], P + "/model/loss", {"cross_entropy", "mse"});
  if (t.contains("data")) {
    const json& d = t["data"];
    if (!d.is_object()) c.fail(P + "/data", fmt::format("expected an object, got {}", typeName(d)));
    c.checkKeys(d, P + "/data", kDataKeys);
    if (d.contains("type")) ts.data.type = oneOf(c, d["type"], P + "/data/type", {"synthetic", "csv", "idx"});
    const std::string& ty = ts.data.type;
    auto file = [&](const char* key, std::string& out) {
      if (!d.contains(key)) return;
      out = c.str(d[key], P + "/data/" + key, false);
      if (!exists(out)) c.fail(P + "/data/" + key, fmt::format("file \"{}\" does not exist", out));
      if (isDirectory(out)) c.fail(P + "/data/" + key, fmt::format("\"{}\" is a directory, not a data file; give a file", out));
      if (isSpecialFile(out))
        c.fail(P + "/data/" + key, fmt::format("\"{}\" is a device, not a data file; give a file (or a pipe)", out));
    };
    file("path", ts.data.path);
    file("labels_path", ts.data.labels_path);
    file("eval_path", ts.data.eval_path);
    file("eval_labels_path", ts.data.eval_labels_path);
    if (ty != "synthetic" && ts.data.path.empty()) c.fail(P + "/data/path", fmt::format("missing; {} data needs a file", ty));
    if (ty == "idx" && ts.data.labels_path.empty()) c.fail(P + "/data/labels_path", "missing; idx data needs a labels file");
    if (ty == "idx" && !ts.data.eval_path.empty() && ts.data.eval_labels_path.empty())
      c.fail(P + "/data/eval_labels_path", "missing; an idx eval_path needs its labels file");
    // A field the type does not read is a mistake, not something to skip in silence.
    for (const char* key : {"labels_path", "eval_labels_path"})
      if (ty != "idx" && d.contains(key))
        c.fail(P + "/data/" + key, fmt::format("only idx data has separate label files; {} data {}", ty,
                                               ty == "csv" ? "keeps its labels in a column (label_column)" : "has no files"));
    if (d.contains("eval_labels_path") && !d.contains("eval_path"))
      c.fail(P + "/data/eval_labels_path", "given without eval_path; add the eval images file as eval_path, or drop it");
    if (d.contains("header") && ty != "csv") c.fail(P + "/data/header", fmt::format("only csv data has a header; {} data does not", ty));
    if (ty == "synthetic" && (d.contains("path") || d.contains("eval_path")))
      c.fail(P + "/data/" + std::string(d.contains("path") ? "path" : "eval_path"), "synthetic data has no files; use type csv or idx");
    if (ty != "synthetic" && (d.contains("train_samples") || d.contains("eval_samples")))
      c.fail(P + "/data/" + std::string(d.contains("train_samples") ? "train_samples" : "eval_samples"),
             "only synthetic data takes a sample count; file data sets have the size of their files");
    if (d.contains("label_column")) {
      if (ty != "csv") c.fail(P + "/data/label_column", "only csv data has a label column");
      const json& lc = d["label_column"];
      if (!lc.is_number() && !lc.is_string())
        c.fail(P + "/data/label_column", fmt::format("expected a header name or a 0-based column index, got {}", typeName(lc)));
      ts.data.label_column_is_index = lc.is_number();
      ts.data.label_column = lc.is_number() ? std::to_string(c.integer(lc, P + "/data/label_column", 0, 1 << 20, "a column index"))
                                            : c.str(lc, P + "/data/label_column", false);
    }
    if (d.contains("header")) ts.data.header = c.boolean(d["header"], P + "/data/header");
    if (d.contains("prefetch") && !(d["prefetch"].is_string() && d["prefetch"] == "auto")) {
      if (!d["prefetch"].is_boolean())
        c.fail(P + "/data/prefetch", fmt::format("expected true, false or \"auto\", got {}", typeName(d["prefetch"])));
      ts.data.prefetch = d["prefetch"].get<bool>();
    }
    if (d.contains("loader_threads") && !(d["loader_threads"].is_string() && d["loader_threads"] == "auto"))
      ts.data.loader_threads = static_cast<int>(
          c.integer(d["loader_threads"], P + "/data/loader_threads", 1, 256, "a thread count", " or \"auto\""));
    if (d.contains("train_samples"))
      ts.data.train_samples = c.integer(d["train_samples"], P + "/data/train_samples", 1, 1ll << 40, "a sample count");
    if (d.contains("eval_samples"))
      ts.data.eval_samples = c.integer(d["eval_samples"], P + "/data/eval_samples", 0, 1ll << 40, "a sample count");
    if (d.contains("seed")) ts.data.seed = static_cast<unsigned long long>(c.integer(d["seed"], P + "/data/seed", 0, INT64_MAX, "an integer"));
  }
  if (t.contains("batch_size")) ts.batch_size = static_cast<int>(c.integer(t["batch_size"], P + "/batch_size", 1, 1 << 20, "a per-worker batch size"));
  if (t.contains("epochs")) ts.epochs = static_cast<int>(c.integer(t["epochs"], P + "/epochs", 1, 1000000, "an integer"));
  if (t.contains("max_steps") && !t["max_steps"].is_null())
    ts.max_steps = c.integer(t["max_steps"], P + "/max_steps", 1, 1ll << 40, "a step count", ", or null");
  if (t.contains("optimizer")) {
    const json& o = t["optimizer"];
    const std::string OP = P + "/optimizer";
    if (!o.is_object()) c.fail(OP, fmt::format("expected an object, got {}", typeName(o)));
    c.checkKeys(o, OP, kOptimizerKeys);
    if (o.contains("type")) ts.optimizer.type = oneOf(c, o["type"], OP + "/type", {"sgd", "adamw"});
    bool adam = ts.optimizer.type == "adamw";
    if (adam) {  // PyTorch's AdamW defaults (SGD's lr, 0.05, would be far too high for Adam)
      ts.optimizer.weight_decay = 0.01;
      ts.optimizer.lr = 1e-3;
    }
    if (adam && (o.contains("momentum") || o.contains("nesterov")))
      c.fail(OP + (o.contains("momentum") ? "/momentum" : "/nesterov"), "belongs to sgd; adamw takes betas and eps");
    if (!adam && (o.contains("betas") || o.contains("eps")))
      c.fail(OP + (o.contains("betas") ? "/betas" : "/eps"), "belongs to adamw; sgd takes momentum and nesterov");
    if (o.contains("betas")) {
      const json& b = o["betas"];
      if (!b.is_array() || b.size() != 2) c.fail(OP + "/betas", "expected [beta1, beta2], e.g. [0.9, 0.999]");
      ts.optimizer.beta1 = c.number(b[0], OP + "/betas/0", 0, 1, "a beta", "", Bounds::kOpenHigh);
      ts.optimizer.beta2 = c.number(b[1], OP + "/betas/1", 0, 1, "a beta", "", Bounds::kOpenHigh);
    }
    if (o.contains("eps")) ts.optimizer.eps = c.number(o["eps"], OP + "/eps", 0, 1, "an epsilon", "", Bounds::kOpenLow);
    if (o.contains("lr")) ts.optimizer.lr = c.number(o["lr"], OP + "/lr", 0, 1e6, "a learning rate", "", Bounds::kOpenLow);
    if (o.contains("momentum")) ts.optimizer.momentum = c.number(o["momentum"], OP + "/momentum", 0, 1, "a momentum", "", Bounds::kOpenHigh);
    if (o.contains("nesterov")) ts.optimizer.nesterov = c.boolean(o["nesterov"], OP + "/nesterov");
    if (o.contains("weight_decay")) ts.optimizer.weight_decay = c.number(o["weight_decay"], OP + "/weight_decay", 0, 1e3, "a weight decay");
    if (ts.optimizer.nesterov && ts.optimizer.momentum == 0) c.fail(OP + "/nesterov", "Nesterov needs a momentum > 0");
  }
  if (t.contains("lr_schedule")) {
    const json& l = t["lr_schedule"];
    const std::string LP = P + "/lr_schedule";
    if (!l.is_object()) c.fail(LP, fmt::format("expected an object, got {}", typeName(l)));
    c.checkKeys(l, LP, kScheduleKeys);
    if (l.contains("type")) ts.lr_schedule.type = oneOf(c, l["type"], LP + "/type", {"constant", "step", "warmup_cosine"});
    const auto& ty = ts.lr_schedule.type;
    if (l.contains("step_size")) ts.lr_schedule.step_size = c.integer(l["step_size"], LP + "/step_size", 1, 1ll << 40, "a step count");
    if (l.contains("gamma")) ts.lr_schedule.gamma = c.number(l["gamma"], LP + "/gamma", 0, 1e6, "a factor");
    if (l.contains("warmup_steps")) ts.lr_schedule.warmup_steps = c.integer(l["warmup_steps"], LP + "/warmup_steps", 0, 1ll << 40, "a step count");
    if (l.contains("min_lr")) ts.lr_schedule.min_lr = c.number(l["min_lr"], LP + "/min_lr", 0, 1e6, "a learning rate");
    if (ty == "step" && ts.lr_schedule.step_size == 0) c.fail(LP + "/step_size", "missing; the step schedule needs step_size");
    // A key of another schedule would be silently ignored (as the optimizer's are not).
    for (const auto& [key, owner] : std::vector<std::pair<std::string, std::string>>{
             {"step_size", "step"}, {"gamma", "step"}, {"warmup_steps", "warmup_cosine"}, {"min_lr", "warmup_cosine"}})
      if (l.contains(key) && ty != owner)
        c.fail(LP + "/" + key, fmt::format("belongs to the {} schedule, not {}; remove it or set /type to \"{}\"", owner,
                                           ty, owner));
    if (ty == "warmup_cosine" && ts.lr_schedule.min_lr > ts.optimizer.lr)
      c.fail(LP + "/min_lr", fmt::format("{} is above the optimizer's lr {}: the schedule would raise the learning rate; "
                                         "give a min_lr <= lr",
                                         ts.lr_schedule.min_lr, ts.optimizer.lr));
  }
  if (t.contains("grad_clip_norm")) ts.grad_clip_norm = c.number(t["grad_clip_norm"], P + "/grad_clip_norm", 0, 1e12, "a norm", " (0 = off)");
  if (t.contains("device")) ts.device = oneOf(c, t["device"], P + "/device", {"auto", "cpu", "cuda"});
  if (t.contains("seed")) ts.seed = static_cast<unsigned long long>(c.integer(t["seed"], P + "/seed", 0, INT64_MAX, "an integer"));
  if (t.contains("bucket_mb")) ts.bucket_mb = c.number(t["bucket_mb"], P + "/bucket_mb", 0.001, 4096, "megabytes");
  if (t.contains("overlap") && !(t["overlap"].is_string() && t["overlap"] == "auto")) {
    if (!t["overlap"].is_boolean())
      c.fail(P + "/overlap", fmt::format("expected true, false or \"auto\", got {}", typeName(t["overlap"])));
    ts.overlap = t["overlap"].get<bool>();
  }
  if (t.contains("log_every_steps"))
    ts.log_every_steps = static_cast<int>(c.integer(t["log_every_steps"], P + "/log_every_steps", 1, 1 << 30, "an integer"));
  if (t.contains("checkpoint")) {
    const json& k = t["checkpoint"];
    if (!k.is_object()) c.fail(P + "/checkpoint", fmt::format("expected an object, got {}", typeName(k)));
    c.checkKeys(k, P + "/checkpoint", kCheckpointKeys);
    if (k.contains("dir")) {
      ts.checkpoint.dir = c.str(k["dir"], P + "/checkpoint/dir", false);
      if (exists(ts.checkpoint.dir) && !isDirectory(ts.checkpoint.dir))
        c.fail(P + "/checkpoint/dir", fmt::format("\"{}\" is a file, not a directory; give a directory for checkpoints",
                                                  ts.checkpoint.dir));
    }
    if (k.contains("every_steps"))
      ts.checkpoint.every_steps = static_cast<int>(c.integer(k["every_steps"], P + "/checkpoint/every_steps", 0, 1 << 30, "an integer"));
    if (k.contains("async")) ts.checkpoint.async = c.boolean(k["async"], P + "/checkpoint/async");
    if (!k.contains("dir")) c.fail(P + "/checkpoint/dir", "missing; give a directory for checkpoints");
  }
  if (ts.model.loss == "cross_entropy" && ts.model.layers.back() < 2)
    c.fail(P + "/model/layers", "cross_entropy needs at least 2 output classes");
  if (ts.model.loss == "mse" && ts.data.type != "synthetic" && ts.model.layers.back() != 1)
    c.fail(P + "/model/layers",
           fmt::format("ends with {} outputs, but {} data has one target column: mse regression needs an output width of "
                       "1; make the last layer 1 (or use synthetic data, whose teacher has as many outputs as the model)",
                       ts.model.layers.back(), ts.data.type));
  auto& par = ts.parallel;
  if (t.contains("parallel")) {
    const json& q = t["parallel"];
    const std::string QP = P + "/parallel";
    if (!q.is_object()) c.fail(QP, fmt::format("expected an object, got {}", typeName(q)));
    c.checkKeys(q, QP, kParallelKeys);
    const int weightLayers = static_cast<int>(ts.model.layers.size()) - 1;
    if (q.contains("pipeline_stages"))
      par.pipeline_stages = static_cast<int>(c.integer(q["pipeline_stages"], QP + "/pipeline_stages", 1, 64, "a stage count"));
    if (par.pipeline_stages > weightLayers)
      c.fail(QP + "/pipeline_stages", fmt::format("{} stages but the model has only {} weight layer{} (/trainer/model/layers); "
                                                  "a stage needs at least one", par.pipeline_stages, weightLayers,
                                                  weightLayers == 1 ? "" : "s"));
    if (q.contains("micro_batches"))
      par.micro_batches = static_cast<int>(c.integer(q["micro_batches"], QP + "/micro_batches", 1, 4096, "a micro-batch count"));
    // Micro-batches are how a pipeline keeps its stages busy; one stage has none to keep busy,
    // and a user who set them expecting gradient accumulation (less activation memory per
    // step) would get neither in silence.
    if (par.micro_batches > 1 && par.pipeline_stages == 1)
      c.fail(QP + "/micro_batches",
             fmt::format("{} micro-batches, but pipeline_stages is 1: micro-batches split a step between pipeline "
                         "stages, and dtrain has no gradient accumulation; remove micro_batches, or set "
                         "pipeline_stages to 2 or more", par.micro_batches));
    if (q.contains("schedule")) par.schedule = oneOf(c, q["schedule"], QP + "/schedule", {"gpipe", "1f1b"});
    if (q.contains("stage_layers")) {
      const json& sl = q["stage_layers"];
      if (!sl.is_array()) c.fail(QP + "/stage_layers", fmt::format("expected an array of layer counts per stage, got {}", typeName(sl)));
      if (static_cast<int>(sl.size()) != par.pipeline_stages)
        c.fail(QP + "/stage_layers", fmt::format("has {} entries; expected one per stage ({})", sl.size(), par.pipeline_stages));
      int sum = 0;
      for (size_t i = 0; i < sl.size(); ++i) {
        par.stage_layers.push_back(static_cast<int>(c.integer(sl[i], fmt::format("{}/stage_layers/{}", QP, i), 1, 1 << 20, "a layer count")));
        sum += par.stage_layers.back();
      }
      if (sum != weightLayers)
        c.fail(QP + "/stage_layers", fmt::format("adds up to {} layers; the model has {} weight layers", sum, weightLayers));
    }
  }
  if (par.micro_batches == 0) {
    // Not given: P, or the next count up to 4P that divides the batch (P 3 with batch 32: 4);
    // at least P keeps every stage busy, and past 4P (a prime batch size would have made
    // every sample a micro-batch of its own) the choice is the user's.
    const int stages = par.pipeline_stages;
    if (ts.batch_size < stages)
      c.fail(P + "/batch_size", fmt::format("{} is smaller than /trainer/parallel/pipeline_stages {}: a pipeline needs "
                                            "a micro-batch per stage at least; use a batch_size of {} or more",
                                            ts.batch_size, stages, stages));
    par.micro_batches = stages;
    while (par.micro_batches < 4 * stages && ts.batch_size % par.micro_batches != 0) ++par.micro_batches;
    if (ts.batch_size % par.micro_batches != 0)
      c.fail(P + "/parallel/micro_batches",
             fmt::format("not given, and no count from {} (pipeline_stages) to {} divides /trainer/batch_size {}; set "
                         "micro_batches to a divisor of batch_size, or change batch_size",
                         stages, 4 * stages, ts.batch_size));
  }
  if (ts.batch_size % par.micro_batches != 0)
    c.fail(P + "/parallel/micro_batches", fmt::format("{} does not divide /trainer/batch_size {}; each micro-batch must be "
                                                      "a whole number of samples", par.micro_batches, ts.batch_size));
  return ts;
}

std::vector<NodeSpec> parseNodes(const Checker& c, const json& arr) {
  if (!arr.is_array())
    c.fail("/nodes", fmt::format("expected an array of hosts like [{{\"host\": \"node1\", \"slots\": 8}}], got {}", typeName(arr)));
  if (arr.empty()) c.fail("/nodes", "is empty; list at least one host, or remove \"nodes\" to run on this machine only");
  std::vector<NodeSpec> nodes;
  for (size_t i = 0; i < arr.size(); ++i) {
    const std::string P = fmt::format("/nodes/{}", i);
    const json& e = arr[i];
    if (!e.is_object())
      c.fail(P, fmt::format("expected an object like {{\"host\": \"node1\", \"slots\": 8}}, got {}", typeName(e)));
    c.checkKeys(e, P, kNodeKeys);
    NodeSpec n;
    n.origin = fmt::format("{}: {}", c.source(), P);
    if (!e.contains("host")) c.fail(P + "/host", "missing; give the host name or address, e.g. \"host\": \"node1\"");
    std::string host = c.str(e["host"], P + "/host", false);
    if (auto at = host.find('@'); at != std::string::npos) {
      n.user = host.substr(0, at);
      host = host.substr(at + 1);
      if (auto p = detail::userProblem(n.user); !p.empty()) c.fail(P + "/host", p + "; write \"user@host\" or just the host");
    }
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    if (std::count(host.begin(), host.end(), ':') == 1)
      c.fail(P + "/host", fmt::format("\"{}\" looks like host:slots; write \"host\": \"{}\", \"slots\": {}", e["host"].get<std::string>(),
                                      host.substr(0, host.find(':')), host.substr(host.find(':') + 1)));
    if (auto p = detail::hostProblem(host); !p.empty()) c.fail(P + "/host", p + "; give a host name or address");
    n.host = host;
    if (e.contains("user")) {
      std::string user = c.str(e["user"], P + "/user", false);
      if (auto p = detail::userProblem(user); !p.empty()) c.fail(P + "/user", p + "; give the login name");
      if (!n.user.empty() && n.user != user)
        c.fail(P + "/user", fmt::format("\"{}\" contradicts \"{}@\" in host; give the user once", user, n.user));
      n.user = user;
    }
    if (e.contains("slots"))
      n.slots = static_cast<int>(c.integer(e["slots"], P + "/slots", 1, kMaxProcsPerNode, "a worker count"));
    if (e.contains("port"))
      n.port = static_cast<int>(c.integer(e["port"], P + "/port", 1, 65535, "an ssh port"));
    if (e.contains("address")) {
      n.address = c.str(e["address"], P + "/address", false);
      if (auto p = detail::hostProblem(n.address); !p.empty())
        c.fail(P + "/address", p + "; give the IP (or name) the other nodes reach this one by");
    }
    if (e.contains("gpus")) {
      const json& g = e["gpus"];
      if (!g.is_array()) c.fail(P + "/gpus", fmt::format("expected an array of GPU indices like [0, 1], got {}", typeName(g)));
      if (g.empty())
        c.fail(P + "/gpus", "is empty; list the GPUs this node's workers use, like [0, 1], or leave gpus out for all");
      for (size_t k = 0; k < g.size(); ++k) {
        std::string gp = fmt::format("{}/gpus/{}", P, k);
        int v = static_cast<int>(c.integer(g[k], gp, 0, 1023, "a GPU index"));
        auto prev = std::find(n.gpus.begin(), n.gpus.end(), v);
        if (prev != n.gpus.end())
          c.fail(gp, fmt::format("GPU {} is listed twice (also {}/gpus/{}); list each GPU once", v, P, prev - n.gpus.begin()));
        n.gpus.push_back(v);
      }
    }
    if (int dup = detail::findDuplicate(nodes, n); dup >= 0)
      c.fail(P, fmt::format("{} is listed twice (first at /nodes/{}); merge the entries (\"slots\" runs more workers on one host)",
                            detail::hostLabel(n), dup));
    nodes.push_back(std::move(n));
  }
  detail::markLocal(nodes);
  return nodes;
}

// Every path a spec names means what it means in the directory dtrain is started in, where
// it is checked; `cwd` only moves the workers' command. Made absolute after the checks, so
// workers started in `cwd` or on other hosts read the same files (and messages keep the
// path as the user wrote it).
// An absolute path is kept as written: checkpoints hash their data files' paths as the spec
// gave them (normalising "/d//x.csv" would refuse every checkpoint written before), and
// "/link/../x" means what the kernel makes of it, which lexically_normal does not know.
void makeAbsolute(std::string& path) {
  if (!path.empty() && path.front() != '/') path = std::filesystem::absolute(path).lexically_normal().string();
}

void makePathsAbsolute(JobSpec& spec) {
  for (std::string* p : {&spec.cwd, &spec.log_dir, &spec.hostfile, &spec.env_file, &spec.ssh.identity_file}) makeAbsolute(*p);
  if (spec.trainer) {
    TrainerSpec::Data& d = spec.trainer->data;
    for (std::string* p : {&d.path, &d.labels_path, &d.eval_path, &d.eval_labels_path, &spec.trainer->checkpoint.dir})
      makeAbsolute(*p);
  }
}

// "~/x" as ssh reads it, so that the existence check looks where ssh will.
std::string expandHome(const std::string& path) {
  if (path.rfind("~/", 0) != 0) return path;
  const char* home = std::getenv("HOME");
  return home && *home ? std::string(home) + path.substr(1) : path;
}

SshSpec parseSsh(const Checker& c, const json& j) {
  const std::string P = "/ssh";
  if (!j.is_object()) c.fail(P, fmt::format("expected an object, got {}", typeName(j)));
  c.checkKeys(j, P, kSshKeys);
  SshSpec s;
  if (j.contains("user")) {
    s.user = c.str(j["user"], P + "/user", false);
    if (auto p = detail::userProblem(s.user); !p.empty()) c.fail(P + "/user", p + "; give the login name");
  }
  if (j.contains("port")) s.port = static_cast<int>(c.integer(j["port"], P + "/port", 1, 65535, "an ssh port"));
  if (j.contains("identity_file")) {
    s.identity_file = expandHome(c.str(j["identity_file"], P + "/identity_file", false));
    if (!exists(s.identity_file))
      c.fail(P + "/identity_file", fmt::format("file \"{}\" does not exist; give the private key ssh should use (-i)", s.identity_file));
    if (isDirectory(s.identity_file))
      c.fail(P + "/identity_file", fmt::format("\"{}\" is a directory; give the private key file ssh should use (-i)", s.identity_file));
  }
  if (j.contains("connect_timeout_s"))
    s.connect_timeout_s = c.number(j["connect_timeout_s"], P + "/connect_timeout_s", 0.1, 3600, "seconds");
  if (j.contains("options")) {
    const json& o = j["options"];
    if (!o.is_array())
      c.fail(P + "/options", fmt::format("expected an array of ssh arguments like [\"-F\", \"ssh_config\"], got {}", typeName(o)));
    for (size_t i = 0; i < o.size(); ++i) s.options.push_back(c.str(o[i], fmt::format("{}/options/{}", P, i), false));
  }
  if (j.contains("host_key_checking"))
    s.host_key_checking = oneOf(c, j["host_key_checking"], P + "/host_key_checking", {"yes", "no", "accept-new"});
  if (j.contains("dtrain_path")) s.dtrain_path = c.str(j["dtrain_path"], P + "/dtrain_path", false);
  return s;
}

}  // namespace

// Env files are not JSON, so nothing else has checked their encoding; a value that is not
// UTF-8 could not be shipped to remote nodes in the JSON node spec.
bool validUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

std::string workerIdentityVar(const std::string& name) {
  static const std::map<std::string, std::string> kVars = {
      {"RANK", "each worker's global rank"},
      {"ROLE_RANK", "each worker's global rank"},
      {"LOCAL_RANK", "each worker's rank on its node"},
      {"GROUP_RANK", "the rank of the worker's node"},
      {"CROSS_RANK", "the rank of the worker's node"},
      {"WORLD_SIZE", "the number of workers"},
      {"ROLE_WORLD_SIZE", "the number of workers"},
      {"LOCAL_WORLD_SIZE", "the number of workers on the node"},
      {"LOCAL_SIZE", "the number of workers on the node"},
      {"GROUP_WORLD_SIZE", "the number of nodes"},
      {"CROSS_SIZE", "the number of nodes"},
  };
  const auto it = kVars.find(name);
  return it == kVars.end() ? std::string() : it->second;
}

std::map<std::string, std::string> parseEnvFile(const std::string& text, const std::string& source,
                                                std::map<std::string, int>* lineOf) {
  std::map<std::string, std::string> env;
  std::map<std::string, int> firstLine;
  std::istringstream in(text.rfind("\xEF\xBB\xBF", 0) == 0 ? text.substr(3) : text);  // without a UTF-8 BOM
  std::string line;
  int lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    auto fail = [&](const std::string& msg) { throw SpecError(oneLine(fmt::format("{}:{}: {}", source, lineNo, msg))); };
    // Old Mac line ends (CR alone): the whole file would be one line, the first key's value.
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find('\r') != std::string::npos)
      fail("the lines end with a carriage return alone (CR, not LF or CRLF): convert the file (tr '\\r' '\\n')");
    size_t b = line.find_first_not_of(" \t");
    size_t e = line.find_last_not_of(" \t\r");
    if (b == std::string::npos || e == std::string::npos || line[b] == '#') continue;
    std::string body = line.substr(b, e - b + 1);
    if (!validUtf8(body)) fail("the line is not valid UTF-8; save the file as UTF-8");
    if (body.rfind("export", 0) == 0 && body.size() > 6 && (body[6] == ' ' || body[6] == '\t'))
      body = body.substr(body.find_first_not_of(" \t", 6));
    auto eq = body.find('=');
    if (eq == std::string::npos)
      fail(fmt::format("expected KEY=VALUE, got \"{}\"; write one KEY=VALUE per line ('#' starts a comment line)", body));
    std::string key = body.substr(0, eq);
    if (auto problem = envNameProblem(key); !problem.empty()) fail(problem + " (no spaces around '=')");
    if (auto problem = identityProblem(key); !problem.empty()) fail(problem);
    std::string value = body.substr(eq + 1);
    if (value.find('\0') != std::string::npos)
      fail(fmt::format("the value of {} contains a NUL byte, which the environment cannot carry; remove it", key));
    if (!value.empty() && (value[0] == '"' || value[0] == '\'')) {
      const size_t close = value.find(value[0], 1);
      if (close == std::string::npos)
        fail(fmt::format("unterminated quote in the value of {}; values are one line: close the {} quote", key,
                         value[0] == '"' ? "double" : "single"));
      // (A="a"b: a shell joins the two, this file format does not)
      if (close != value.size() - 1)
        fail(fmt::format("text after the closing quote in the value of {}; quote the whole value (KEY=\"...\"), "
                         "or leave the quotes out",
                         key));
      value = value.substr(1, value.size() - 2);
    }
    // (one value per name, as the spec's JSON keys: the later line silently won)
    if (const auto first = firstLine.find(key); first != firstLine.end())
      fail(fmt::format("{} is set again (first on line {}); keep one of the two lines", key, first->second));
    firstLine[key] = lineNo;
    env[key] = value;
    if (lineOf) (*lineOf)[key] = lineNo;
  }
  return env;
}

namespace {

// parseJobSpec, with the job's name in `name` as soon as it is read.
JobSpec parseJobSpecReadingName(const std::string& text, const std::string& source, std::string& name,
                                const SpecLoadOptions& opts) {
  Checker c(source);
  // (the JSON parser would stop at a NUL and take the text before it for the whole spec)
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    auto [line, col] = lineColumn(text, nul + 1);  // (1-based, as the parser's positions)
    throw SpecError(fmt::format("{}:{}:{}: invalid JSON: a NUL byte; a job spec is text: remove it, and what follows it if "
                                "that is not part of the spec",
                                source, line, col));
  }
  json root;
  std::optional<DuplicateKey> duplicate;
  try {
    root = parseRefusingDuplicateKeys(text, c, duplicate);
  } catch (const json::parse_error& e) {
    auto [line, col] = lineColumn(text, e.byte);
    throw SpecError(fmt::format("{}:{}:{}: invalid JSON: {}", source, line, col, stripJsonPrefix(e.what())));
  } catch (const json::out_of_range& e) {
    // A number beyond double's range: "[json.exception.out_of_range.406] number overflow
    // parsing '1e808'", without a position; find the number for one.
    std::string what = e.what();
    std::string number;
    if (auto a = what.find("parsing '"); a != std::string::npos)
      if (auto b = what.find('\'', a + 9); b != std::string::npos) number = what.substr(a + 9, b - a - 9);
    size_t at = number.empty() ? std::string::npos : numberOutsideStrings(text, number);
    auto [line, col] = lineColumn(text, at == std::string::npos ? 0 : at + 1);
    throw SpecError(fmt::format("{}:{}:{}: invalid JSON: the number {} is out of range; write a number within "
                                "+-1.7e308 (no field takes anything near that)",
                                source, line, col, number.empty() ? "here" : number));
  } catch (const json::exception& e) {
    throw SpecError(fmt::format("{}: invalid JSON: {}; fix the file's JSON syntax", source, stripJsonPrefix(e.what())));
  }
  if (!root.is_object()) c.fail("/", fmt::format("expected a JSON object at the top level, got {}", typeName(root)));
  // (a name given twice names no job: which one is meant is the question)
  if (duplicate && duplicate->path == "/" && duplicate->message.rfind("key \"name\" ", 0) == 0)
    c.fail(duplicate->path, duplicate->message);

  JobSpec spec;
  spec.source = source;
  if (root.contains("name")) {
    spec.name = c.str(root["name"], "/name", false);
    // Every worker gets it (DTRAIN_JOB_NAME), and every headline says it: a name past Linux's
    // limit on one environment string failed every worker's exec (126) after validate passed.
    if (spec.name.size() > kMaxJobName)
      c.fail("/name", fmt::format("is {} bytes; a job name is at most {} (every worker gets it in DTRAIN_JOB_NAME, and "
                                  "every message says it): shorten it",
                                  spec.name.size(), kMaxJobName));
    // The name is part of one-line messages and summaries read by scripts and terminals.
    // (C1 controls too, U+0080..U+009F: UTF-8 C2 80..C2 9F; a terminal takes U+009B as CSI)
    for (size_t i = 0; i < spec.name.size(); ++i) {
      const unsigned char ch = static_cast<unsigned char>(spec.name[i]);
      const unsigned char next = i + 1 < spec.name.size() ? static_cast<unsigned char>(spec.name[i + 1]) : 0;
      const bool c1 = ch == 0xc2 && next >= 0x80 && next <= 0x9f;
      // (and the line and paragraph separators U+2028/9 and the bidirectional overrides and
      // isolates U+202A..E, U+2066..9, which break a line or turn the text around it)
      const unsigned char third = i + 2 < spec.name.size() ? static_cast<unsigned char>(spec.name[i + 2]) : 0;
      const bool layout = ch == 0xe2 && ((next == 0x80 && third >= 0xa8 && third <= 0xae) ||
                                         (next == 0x81 && third >= 0xa6 && third <= 0xa9));
      if (layout)
        c.fail("/name", fmt::format("contains U+{:04X}, which breaks a line or reverses the text around it; a job name "
                                    "appears in one-line messages and on terminals: use printable characters",
                                    0x2000 + ((next & 0x3f) << 6) + (third & 0x3f)));
      if (ch < 0x20 || ch == 0x7f || c1)
        c.fail("/name", fmt::format("contains the control character U+{:04X}; a job name appears in one-line messages "
                                    "and on terminals: use printable characters",
                                    c1 ? static_cast<unsigned>(next) : static_cast<unsigned>(ch)));
    }
  }
  name = spec.name;
  // (after the name: a summary of a spec refused for a key given twice, or an unknown one,
  // still names its job)
  if (duplicate) c.fail(duplicate->path, duplicate->message);
  c.checkKeys(root, "", kTopKeys);

  bool hasTrainer = root.contains("trainer");
  if (hasTrainer && root.contains("command"))
    c.fail("/command", "a job has either \"command\" (your program) or \"trainer\" (the built-in trainer), not both");
  if (!hasTrainer && !root.contains("command"))
    c.fail("/command",
           "missing; give the worker's argv, e.g. \"command\": [\"python3\", \"train.py\"], or a \"trainer\" section");
  if (!hasTrainer) {
    const json& cmd = root["command"];
    if (!cmd.is_array())
      c.fail("/command", fmt::format("expected an array of strings (argv), got {}{}", typeName(cmd), commandArrayHint(cmd)));
    if (cmd.empty()) c.fail("/command", "is empty; give at least the program to run");
    for (size_t i = 0; i < cmd.size(); ++i)
      spec.command.push_back(c.str(cmd[i], fmt::format("/command/{}", i), i != 0));
  }

  if (root.contains("env")) {
    const json& env = root["env"];
    if (!env.is_object()) c.fail("/env", fmt::format("expected an object of strings, got {}", typeName(env)));
    for (auto it = env.begin(); it != env.end(); ++it) {
      std::string p = "/env/" + pointerToken(it.key());
      if (auto problem = envNameProblem(it.key()); !problem.empty()) c.fail(p, problem);
      if (auto problem = identityProblem(it.key()); !problem.empty()) c.fail(p, problem);
      spec.env[it.key()] = c.str(it.value(), p);
      if (auto problem = envValueProblem(it.key(), spec.env[it.key()]); !problem.empty()) c.fail(p, problem);
      if (auto w = masterOverrideWarning(source + ": " + p, it.key(), spec.env[it.key()]); !w.empty())
        spec.warnings[it.key()] = w;
    }
  }
  if (root.contains("cwd")) {
    spec.cwd = c.str(root["cwd"], "/cwd", false);
    if (!exists(spec.cwd)) c.fail("/cwd", fmt::format("directory \"{}\" does not exist", spec.cwd));
    if (!isDirectory(spec.cwd))
      c.fail("/cwd", fmt::format("\"{}\" is not a directory; give the directory the workers start in", spec.cwd));
  }
  if (root.contains("nproc_per_node")) {
    // A JSON number, or the one word "auto" (a count in quotes is refused like any other number field's).
    const json& n = root["nproc_per_node"];
    if (n.is_string() && n.get<std::string>() == "auto")
      spec.nproc_auto = true;
    else
      spec.nproc_per_node = static_cast<int>(c.integer(n, "/nproc_per_node", 1, kMaxProcsPerNode, "a worker count", " or \"auto\""));
  }
  if (root.contains("log_dir")) {
    spec.log_dir = c.str(root["log_dir"], "/log_dir", false);
    if (exists(spec.log_dir) && !isDirectory(spec.log_dir))
      c.fail("/log_dir", fmt::format("\"{}\" exists and is not a directory", spec.log_dir));
  }
  if (root.contains("max_restarts"))
    spec.max_restarts = static_cast<int>(c.integer(root["max_restarts"], "/max_restarts", 0, kMaxRestarts, "an integer"));
  if (root.contains("min_nodes"))
    spec.min_nodes = static_cast<int>(c.integer(root["min_nodes"], "/min_nodes", 1, kMaxNodes, "a node count"));
  if (root.contains("max_nodes"))
    spec.max_nodes = static_cast<int>(c.integer(root["max_nodes"], "/max_nodes", 1, kMaxNodes, "a node count"));
  if (root.contains("worker_timeout_s")) {
    spec.worker_timeout_s = c.number(root["worker_timeout_s"], "/worker_timeout_s", 0, 86400, "seconds", " (0 = off)");
    // (below a second no worker could say it is alive in time: its first heartbeat would
    // find it hung)
    if (spec.worker_timeout_s > 0 && spec.worker_timeout_s < 1)
      c.fail("/worker_timeout_s", fmt::format("{} s is too short for any worker to show it is alive; give 0 (off) or "
                                              "at least 1, more than a step takes",
                                              spec.worker_timeout_s));
  }
  if (root.contains("restart_backoff_s"))
    spec.restart_backoff_s = c.number(root["restart_backoff_s"], "/restart_backoff_s", 0, 3600, "seconds");
  if (root.contains("shutdown_timeout_s"))
    spec.shutdown_timeout_s = c.number(root["shutdown_timeout_s"], "/shutdown_timeout_s", 0, 86400, "seconds");
  if (root.contains("prefix_output")) spec.prefix_output = c.boolean(root["prefix_output"], "/prefix_output");
  if (root.contains("console_ranks")) {
    const json& r = root["console_ranks"];
    if (!r.is_array()) c.fail("/console_ranks", fmt::format("expected an array of local ranks, got {}", typeName(r)));
    for (size_t i = 0; i < r.size(); ++i)
      spec.console_ranks.push_back(static_cast<int>(c.integer(r[i], fmt::format("/console_ranks/{}", i), 0, kMaxProcsPerNode - 1, "a local rank")));
  }
  if (root.contains("rendezvous")) {
    const json& r = root["rendezvous"];
    auto addr = [&](const char* key, std::string& out) {
      if (!r.is_object() || !r.contains(key)) return;
      std::string p = std::string("/rendezvous/") + key;
      out = c.str(r[key], p, false);
      if (auto problem = detail::hostProblem(out); !problem.empty()) c.fail(p, problem + "; give an IP address or host name");
    };
    if (!r.is_object()) c.fail("/rendezvous", fmt::format("expected an object, got {}", typeName(r)));
    c.checkKeys(r, "/rendezvous", kRendezvousKeys);
    if (r.contains("port"))
      spec.rendezvous.port = static_cast<int>(c.integer(r["port"], "/rendezvous/port", 0, 65535, "a TCP port", " (0 = a free one)"));
    if (r.contains("timeout_s"))
      spec.rendezvous.timeout_s = static_cast<int>(c.integer(r["timeout_s"], "/rendezvous/timeout_s", 1, 86400, "whole seconds"));
    if (r.contains("heartbeat_timeout_s"))
      spec.rendezvous.heartbeat_timeout_s =
          c.number(r["heartbeat_timeout_s"], "/rendezvous/heartbeat_timeout_s", 1, 3600, "seconds");
    addr("addr", spec.rendezvous.addr);
    addr("master_addr", spec.rendezvous.master_addr);
  }
  if (hasTrainer) spec.trainer = parseTrainer(c, root["trainer"]);

  if (root.contains("nodes") && root.contains("hostfile"))
    c.fail("/hostfile", "\"nodes\" and \"hostfile\" both list the hosts; keep one of them");
  if (root.contains("nodes")) spec.nodes = parseNodes(c, root["nodes"]);
  if (root.contains("hostfile") && !opts.read_hostfile) {
    (void)c.str(root["hostfile"], "/hostfile", false);  // (its type still checked; the command line's hosts replace it)
  } else if (root.contains("hostfile")) {
    spec.hostfile = c.str(root["hostfile"], "/hostfile", false);
    using S = detail::InputFile::Status;
    detail::InputFile f = detail::readInputFile(spec.hostfile);
    if (f.status == S::kMissing)
      c.fail("/hostfile", fmt::format("hostfile \"{}\" does not exist; the path is relative to the directory dtrain runs in",
                                      spec.hostfile));
    if (f.status == S::kDirectory) c.fail("/hostfile", fmt::format("\"{}\" is a directory; give a hostfile", spec.hostfile));
    if (f.status == S::kTooLarge)
      c.fail("/hostfile", fmt::format("\"{}\" is too large for a hostfile ({}); give a file with one host per line",
                                      spec.hostfile, f.reason));
    if (f.status != S::kOk) c.fail("/hostfile", fmt::format("cannot read hostfile \"{}\": {}", spec.hostfile, f.reason));
    spec.nodes = parseHostfile(f.text, spec.hostfile);  // errors name the hostfile and line
  }
  if (root.contains("ssh")) spec.ssh = parseSsh(c, root["ssh"]);
  if (root.contains("env_forward")) {
    const json& f = root["env_forward"];
    if (!f.is_array())
      c.fail("/env_forward", fmt::format("expected an array of variable-name prefixes like [\"NCCL_\"], got {}", typeName(f)));
    spec.env_forward.clear();  // the spec's list replaces the default ([] forwards none)
    for (size_t i = 0; i < f.size(); ++i) {
      std::string p = fmt::format("/env_forward/{}", i);
      std::string prefix = c.str(f[i], p, false);
      if (!envNameProblem(prefix).empty())
        c.fail(p, fmt::format("bad variable-name prefix {}; prefixes are letters, digits and '_', not starting with a digit",
                              jsonQuoted(prefix)));
      spec.env_forward.push_back(prefix);
    }
  }
  if (root.contains("env_file")) {
    spec.env_file = c.str(root["env_file"], "/env_file", false);
    using S = detail::InputFile::Status;
    detail::InputFile f = detail::readInputFile(spec.env_file);
    if (f.status == S::kMissing)
      c.fail("/env_file", fmt::format("file \"{}\" does not exist; the path is relative to the directory dtrain runs in",
                                      spec.env_file));
    if (f.status == S::kDirectory) c.fail("/env_file", fmt::format("\"{}\" is a directory; give a file of KEY=VALUE lines", spec.env_file));
    if (f.status == S::kDenied)
      c.fail("/env_file", fmt::format("cannot read \"{}\": permission denied; check its mode", spec.env_file));
    if (f.status == S::kTooLarge)
      c.fail("/env_file", fmt::format("\"{}\" is too large for an env file ({}); point it at a KEY=VALUE file",
                                      spec.env_file, f.reason));
    if (f.status != S::kOk) c.fail("/env_file", fmt::format("cannot read \"{}\": {}", spec.env_file, f.reason));
    // The spec's own env wins over the file.
    std::map<std::string, int> lineOf;
    for (auto& [k, v] : parseEnvFile(f.text, spec.env_file, &lineOf)) {
      if (!spec.env.emplace(k, v).second) continue;
      if (auto problem = envValueProblem(k, v); !problem.empty())
        throw SpecError(fmt::format("{}:{}: {}", spec.env_file, lineOf[k], problem));
      if (auto w = masterOverrideWarning(fmt::format("{}:{}", spec.env_file, lineOf[k]), k, v); !w.empty())
        spec.warnings[k] = w;
    }
  }
  if (auto it = spec.env.find("MASTER_PORT"); it != spec.env.end())
    if (const std::string clash = masterPortClash(spec, it->second); !clash.empty())
      c.fail(root.contains("env") && root["env"].contains("MASTER_PORT") ? "/env/MASTER_PORT" : "/env_file", clash);
  makePathsAbsolute(spec);
  return spec;
}

}  // namespace

JobSpec parseJobSpec(const std::string& text, const std::string& source, const SpecLoadOptions& o) {
  std::string name;
  try {
    return parseJobSpecReadingName(text, source, name, o);
  } catch (const SpecError& e) {
    if (name.empty()) throw;
    throw NamedSpecError(e.what(), name);
  }
}

JobSpec loadJobSpec(const std::string& path, const SpecLoadOptions& o) {
  return parseJobSpec(detail::readInputOrThrow(path, "job spec", "give a job spec file (.json)"), path, o);
}

void applyOverrides(JobSpec& spec, const Overrides& o) {
  if (o.nproc_per_node)
    parseNproc(*o.nproc_per_node, spec, [](const std::string& m) { throw SpecError("--nproc-per-node: " + m); });
  if (o.nnodes) {
    auto bad = [&]() -> SpecError {
      return SpecError(fmt::format("--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX <= {}, got \"{}\"", kMaxNodes, *o.nnodes));
    };
    auto parts = split(*o.nnodes, ':');
    if (parts.empty() || parts.size() > 2) throw bad();
    std::vector<int> v;
    for (const auto& p : parts) {
      size_t used = 0;
      int x = 0;
      try {
        x = std::stoi(p, &used);
      } catch (...) {
        throw bad();
      }
      if (used != p.size() || x < 1 || x > kMaxNodes) throw bad();
      v.push_back(x);
    }
    spec.min_nodes = v[0];
    spec.max_nodes = v.size() == 2 ? v[1] : v[0];
    if (spec.min_nodes > spec.max_nodes) throw bad();
  }
  if (o.max_restarts) {
    if (*o.max_restarts < 0 || *o.max_restarts > kMaxRestarts)
      throw SpecError(fmt::format("--max-restarts: expected an integer between 0 and {}, got {}", kMaxRestarts, *o.max_restarts));
    spec.max_restarts = *o.max_restarts;
  }
  if (o.log_dir) {
    if (o.log_dir->empty()) throw SpecError("--log-dir: expected a directory path, got \"\"");
    if (exists(*o.log_dir) && !isDirectory(*o.log_dir))
      throw SpecError(fmt::format("--log-dir: \"{}\" exists and is not a directory", *o.log_dir));
    spec.log_dir = *o.log_dir;
    makeAbsolute(spec.log_dir);
  }
  if (o.shutdown_timeout_s) {
    if (!(*o.shutdown_timeout_s >= 0 && *o.shutdown_timeout_s <= 86400))
      throw SpecError(fmt::format("--shutdown-timeout: expected seconds between 0 and 86400, got {}", *o.shutdown_timeout_s));
    spec.shutdown_timeout_s = *o.shutdown_timeout_s;
  }
  std::map<std::string, std::string> givenEnv;  // --env NAME -> its value, to tell a repeat
  for (const auto& kv : o.env) {
    auto eq = kv.find('=');
    if (eq == 0 || kv.empty())
      throw SpecError(oneLine(fmt::format("--env: expected KEY=VALUE (or a NAME, for dtrain's own value of it), got \"{}\"", kv)));
    const std::string name = kv.substr(0, eq);
    if (auto problem = envNameProblem(name); !problem.empty()) throw SpecError(oneLine("--env: " + problem));
    if (auto problem = identityProblem(name); !problem.empty()) throw SpecError("--env: " + problem);
    std::string value;
    if (eq == std::string::npos) {
      // mpirun's -x NAME: the variable as the launcher has it (local workers inherit it anyway;
      // this also takes it to remote hosts).
      const char* mine = std::getenv(name.c_str());
      if (mine == nullptr)
        throw SpecError(fmt::format("--env: {} is not set in dtrain's environment, so there is no value to pass on; set "
                                    "it before dtrain run (export {}=...), or give --env {}=VALUE",
                                    name, name, name));
      value = mine;
    } else {
      value = kv.substr(eq + 1);
    }
    if (value.find('\0') != std::string::npos)
      throw SpecError(fmt::format("--env: the value of {} contains a NUL character, which the environment cannot carry; remove it",
                                  name));
    // (the values unsaid: they may be secrets)
    if (auto it = givenEnv.find(name); it != givenEnv.end() && it->second != value)
      spec.warnings["--env twice: " + name] =
          fmt::format("--env {} is given twice, with different values; the last one is used", name);
    if (auto problem = envValueProblem(name, value); !problem.empty()) throw SpecError("--env: " + problem);
    givenEnv[name] = value;
    spec.env[name] = value;
    spec.warnings.erase(name);  // --env wins: its line, not the spec's
    if (auto w = masterOverrideWarning("--env", name, value); !w.empty()) spec.warnings[name] = w;
    if (name == "MASTER_PORT")
      if (const std::string clash = masterPortClash(spec, value); !clash.empty()) throw SpecError("--env: " + clash);
  }
  for (const auto& prefix : o.env_forward) {
    if (!envNameProblem(prefix).empty())
      throw SpecError(oneLine(fmt::format("--env-forward: bad variable-name prefix \"{}\"; prefixes are letters, digits "
                                          "and '_', not starting with a digit (e.g. --env-forward MY_APP_)",
                                          prefix)));
    if (std::find(spec.env_forward.begin(), spec.env_forward.end(), prefix) == spec.env_forward.end())
      spec.env_forward.push_back(prefix);
  }
  if (o.local_ranks_filter)
    spec.console_ranks = parseRankList(*o.local_ranks_filter, [](const std::string& m) { throw SpecError("--local-ranks-filter: " + m); });
  if (o.no_prefix) spec.prefix_output = false;
  if (o.hostfile && o.hosts) throw SpecError("--hostfile and --hosts both list the hosts; give one of them");
  if (o.hostfile) {
    if (o.hostfile->empty()) throw SpecError("--hostfile: expected a file path, got \"\"");
    try {
      spec.nodes = loadHostfile(*o.hostfile);
    } catch (const SpecError& e) {
      throw SpecError(std::string("--hostfile: ") + e.what());
    }
    spec.hostfile = *o.hostfile;
    makeAbsolute(spec.hostfile);
  }
  if (o.hosts) {
    spec.nodes = parseHostList(*o.hosts);
    spec.hostfile.clear();
  }
}

int visibleGpuCount() {
  int driverGpus = 0;
  if (DIR* d = ::opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++driverGpus;
    ::closedir(d);
  } else {
    for (int i = 0; i < 64; ++i)
      if (exists(fmt::format("/dev/nvidia{}", i))) ++driverGpus;
  }
  const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
  if (cvd == nullptr) return driverGpus;
  // CUDA stops at the first invalid entry; "" or "-1" hides every device.
  int visible = 0;
  std::string s(cvd);
  if (s.empty()) return 0;
  for (const auto& part : split(s, ',')) {
    if (part.empty() || part[0] == '-') break;
    ++visible;
  }
  return std::min(visible, driverGpus);
}

// One worker per visible GPU, else per usable CPU: under a cgroup CPU quota (a container's
// --cpus, a Kubernetes limit) the quota's CPUs, not the affinity mask's.
int autoProcsPerNode(std::string* note) {
  int gpus = visibleGpuCount();
  if (gpus > 0) return gpus;
  const CpuAvailability cpus = cpuAvailability();
  if (cpus.quotaBinds()) *note = cpus.describe();
  return cpus.usable;
}

namespace {

// What exec takes, said before any worker fails on it: one argument at most MAX_ARG_STRLEN
// (the environment's strings are checked where they are given, with their file and line),
// and the command and environment together within ARG_MAX (sysconf: a quarter of the stack
// limit, `ulimit -s`), where the environment the workers inherit from dtrain's counts too,
// with room for what dtrain adds (RANK, MASTER_ADDR, ...). Another host's limit and
// environment may differ: this host's is the measure.
void checkExecSize(const JobSpec& spec, const std::string& source) {
  const bool adHoc = spec.source.empty() || spec.source == "command line";
  auto argName = [&](size_t i) {
    return adHoc ? fmt::format("the command after --, argument {}", i) : fmt::format("{}: /command/{}", source, i);
  };
  size_t total = 0;
  for (size_t i = 0; i < spec.command.size(); ++i) {
    const size_t n = spec.command[i].size() + 1;
    if (n > kMaxArgStrlen)
      throw SpecError(
          fmt::format("{}: is {} bytes, and Linux passes at most {} bytes in one argument (MAX_ARG_STRLEN): "
                      "no worker could start; put it in a file and pass the file's path",
                      argName(i), n - 1, kMaxArgStrlen - 1));
    total += n + sizeof(char*);
  }
  size_t specEnv = 0;
  for (const auto& [k, v] : spec.env) specEnv += k.size() + v.size() + 2 + sizeof(char*);
  // (dtrain's own environment is what local workers inherit; remote ones inherit their agent's,
  // which that agent measures. A variable the spec sets replaces the inherited one.)
  const bool anyLocal =
      spec.nodes.empty() || std::any_of(spec.nodes.begin(), spec.nodes.end(), [](const NodeSpec& n) { return n.local; });
  size_t inherited = 0;
  for (char** e = environ; anyLocal && e != nullptr && *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr && spec.env.count(std::string(*e, static_cast<size_t>(eq - *e)))) continue;
    inherited += std::strlen(*e) + 1 + sizeof(char*);
  }
  constexpr size_t kDtrainVars = 16 * 1024;
  // (the kernel's own measure, fs/exec.c: a quarter of the stack limit, at most 6 MiB, at
  // least 128 KiB; glibc's sysconf says 128 KiB for an unlimited stack, where 6 MiB goes)
  struct rlimit stack {};
  long argMax = 6L << 20;
  if (::getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY)
    argMax = std::max<long>(131072, std::min<long>(argMax, static_cast<long>(stack.rlim_cur / 4)));
  total += specEnv + inherited + kDtrainVars;
  if (total > static_cast<size_t>(argMax))
    throw SpecError(fmt::format(
        "{}: the workers' command and environment come to about {} KiB ({} KiB of them /command, {} KiB /env and "
        "env_file, {} KiB dtrain's own environment, which workers inherit), over the {} KiB exec takes on this host "
        "(a quarter of `ulimit -s`, at most 6 MiB): no worker could start; put large values in files, or raise the "
        "stack "
        "limit",
        adHoc ? std::string("the command after --") : source + ": /command and /env", total / 1024,
        (total - specEnv - inherited - kDtrainVars) / 1024, specEnv / 1024, inherited / 1024,
        static_cast<size_t>(argMax) / 1024));
}

}  // namespace

void resolve(JobSpec& spec, const Overrides& given) {
  if (spec.nproc_auto) spec.nproc_per_node = autoProcsPerNode(&spec.nproc_auto_note);
  // (hosts: each agent counts its own; this host's quota says nothing about them)
  if (!spec.nodes.empty()) spec.nproc_auto_note.clear();
  const std::string source = spec.source.empty() ? "command line" : spec.source;
  checkExecSize(spec, source);
  // Each message names where the value came from: the flag, else the spec's field.
  const std::string nodesFrom = given.nnodes ? "--nnodes" : "";
  const char* maxName = given.nnodes ? "--nnodes" : "max_nodes";  // in the fix
  auto field = [&](const std::string& flag, const char* pointer) {
    return flag.empty() ? fmt::format("{}: {}", source, pointer) : flag;
  };
  // Elastic range: defaults to the hosts given; it cannot ask for more nodes than there are.
  int hosts = std::max<int>(1, static_cast<int>(spec.nodes.size()));
  if (hosts > kMaxNodes)
    throw SpecError(fmt::format("{}: {} hosts, and a job runs on at most {} nodes; split the job, or give fewer hosts",
                                !spec.hostfile.empty() ? spec.hostfile
                                : given.hosts          ? std::string("--hosts")
                                                       : source + ": /nodes",
                                hosts, kMaxNodes));
  const bool maxGiven = spec.max_nodes != 0;
  if (spec.max_nodes == 0) spec.max_nodes = std::max(hosts, spec.min_nodes);
  if (spec.min_nodes == 0) spec.min_nodes = std::min(hosts, spec.max_nodes);
  if (spec.min_nodes > spec.max_nodes)
    throw SpecError(fmt::format("{}: {} is more than max_nodes {}; make min_nodes <= max_nodes",
                                field(nodesFrom, "/min_nodes"), spec.min_nodes, spec.max_nodes));
  if (spec.max_nodes < hosts)
    throw SpecError(fmt::format("{}: {} node(s) at most, but {} host(s) given, and dtrain starts every host "
                                "it is given; list only the hosts to use, or raise {} to {}",
                                field(nodesFrom, "/max_nodes"), spec.max_nodes, hosts, maxName, hosts));
  // max_nodes left out defaults to the hosts, or to min_nodes when that is more: then the
  // count asked for is min_nodes's, and that is the field to name.
  if (spec.max_nodes > hosts && !maxGiven)
    throw SpecError(fmt::format("{}: at least {} node(s), but {} host(s) given; list more hosts (hostfile, nodes, "
                                "--hosts) or lower min_nodes",
                                field("", "/min_nodes"), spec.min_nodes, hosts));
  if (spec.max_nodes > hosts)
    throw SpecError(fmt::format("{}: {} node(s) asked for but {} host(s) given; list more hosts (hostfile, "
                                "nodes, --hosts) or lower {}",
                                field(nodesFrom, "/max_nodes"), spec.max_nodes, hosts, maxName));
  // A trainer that can restart (a failure's, a node's joining or leaving) without a checkpoint
  // directory trains from step 0 again each time, the progress of every attempt before lost:
  // said once, before the launch.
  if (spec.trainer && spec.trainer->checkpoint.dir.empty() && (spec.max_restarts > 0 || spec.min_nodes < spec.max_nodes))
    spec.warnings["no checkpoint dir"] = fmt::format(
        "{}: /trainer/checkpoint/dir is not set, so every restart ({}) starts the training over from step 0; set "
        "it to resume from the last checkpoint",
        source,
        spec.min_nodes < spec.max_nodes
            ? fmt::format("max_restarts {}, and a node joining or lost between min_nodes {} and max_nodes {}",
                          spec.max_restarts, spec.min_nodes, spec.max_nodes)
            : fmt::format("max_restarts {}", spec.max_restarts));
  const std::string ranksFrom = field(given.local_ranks_filter ? "--local-ranks-filter" : "", "/console_ranks");
  if (spec.nodes.empty()) {
    for (int r : spec.console_ranks) {
      if (r >= spec.nproc_per_node)
        throw SpecError(fmt::format("{}: local rank {} does not exist with nproc_per_node {}; use ranks 0..{}",
                                    ranksFrom, r, spec.nproc_per_node, spec.nproc_per_node - 1));
    }
    return;
  }
  // A host's workers: its slots; without them one per GPU it lists (DeepSpeed's
  // `--include host:1,3` is two workers), else nproc_per_node. "auto" is counted on each node
  // itself (its GPUs, its cores), so those slots stay 0 here. The spec's nproc_per_node is
  // the default for hosts without slots; --nproc-per-node on the command line overrides the
  // spec, and a host's own count it cannot override is refused rather than ignored.
  const NodeSpec* smallest = nullptr;
  for (auto& n : spec.nodes) {
    std::vector<std::string> g;
    for (int i : n.gpus) g.push_back(std::to_string(i));
    const std::string gpus = fmt::format("gpus={}", fmt::join(g, ","));
    const bool fromGpus = n.slots == 0 && !n.gpus.empty();
    if (fromGpus) n.slots = static_cast<int>(n.gpus.size());
    if (given.nproc_per_node && !spec.nproc_auto && n.slots > 0 && n.slots != spec.nproc_per_node) {
      const std::string has =
          fromGpus ? fmt::format("lists {} GPUs ({}) and no slots, so it runs one worker per GPU", n.slots, gpus)
                   : fmt::format("has {} slot{}", n.slots, n.slots == 1 ? "" : "s");
      const std::string fix =
          fromGpus ? fmt::format("drop --nproc-per-node, or give the host slots={} (then its {} worker{} see{} all "
                                 "these GPUs)",
                                 spec.nproc_per_node, spec.nproc_per_node, spec.nproc_per_node == 1 ? "" : "s",
                                 spec.nproc_per_node == 1 ? "s" : "")
                   : std::string("drop --nproc-per-node or the host's slots (hosts without slots run --nproc-per-node "
                                 "workers)");
      throw SpecError(fmt::format("--nproc-per-node {}: {} ({}) {}, not {}; {}", spec.nproc_per_node,
                                  detail::hostLabel(n), n.origin, has, spec.nproc_per_node, fix));
    }
    const bool fromNproc = n.slots == 0 && !spec.nproc_auto;
    if (fromNproc) n.slots = spec.nproc_per_node;
    // (explicit slots above max_slots were refused with the hostfile line)
    if (n.max_slots > 0 && n.slots > n.max_slots) {
      const char* nproc = given.nproc_per_node ? "--nproc-per-node" : "nproc_per_node";
      throw SpecError(fmt::format("{}: {} would run {} workers ({}) but its max_slots is {}, and dtrain never runs "
                                  "more; give it slots=N with N <= {}{}",
                                  n.origin, detail::hostLabel(n), n.slots,
                                  fromGpus ? "one per GPU listed" : fmt::format("{} {}", nproc, n.slots), n.max_slots,
                                  n.max_slots, fromNproc ? fmt::format(", or lower {}", nproc) : std::string()));
    }
    if (!n.gpus.empty() && n.slots > static_cast<int>(n.gpus.size()))
      spec.warnings["nodes: " + n.origin] = fmt::format(
          "{}: {} runs {} workers on {} GPU{} ({}): they share GPUs, which NCCL refuses within one communicator (the "
          "built-in trainer then uses the CPU); list {} GPUs, or give slots={}",
          n.origin, detail::hostLabel(n), n.slots, n.gpus.size(), n.gpus.size() == 1 ? "" : "s", gpus, n.slots,
          n.gpus.size());
    if (n.slots > 0 && (smallest == nullptr || n.slots < smallest->slots)) smallest = &n;
  }
  if (smallest == nullptr) return;
  for (int r : spec.console_ranks) {
    if (r >= smallest->slots)
      throw SpecError(fmt::format("{}: local rank {} does not exist on {} ({}), which runs {} worker{}; use ranks 0..{}",
                                  ranksFrom, r, detail::hostLabel(*smallest), smallest->origin, smallest->slots,
                                  smallest->slots == 1 ? "" : "s", smallest->slots - 1));
  }
}

std::map<int, std::vector<long long>> possibleWorldSizes(const JobSpec& spec) {
  if (spec.nodes.empty()) return {{1, {spec.nproc_per_node}}};
  std::map<int, int> hostsWith;  // workers per host -> hosts with that many
  long long all = 0;
  for (const auto& n : spec.nodes) {
    if (n.slots <= 0) return {};  // "auto": counted on the host itself
    ++hostsWith[n.slots];
    all += n.slots;
  }
  const int hostCount = static_cast<int>(spec.nodes.size());
  // Not elastic (every host, always: the default): one world size.
  if (spec.min_nodes >= hostCount) return {{hostCount, {all}}};
  // (node count, workers) of every set of hosts, by kinds of host: few distinct counts keep
  // it small. Past the bound (thousands of hosts of many sizes) only all hosts are counted.
  constexpr size_t kMaxSets = 200000;
  std::set<std::pair<int, long long>> sets = {{0, 0}};
  for (const auto& [slots, hosts] : hostsWith) {
    std::set<std::pair<int, long long>> next;
    for (const auto& [k, w] : sets) {
      for (int j = 0; j <= hosts && k + j <= spec.max_nodes; ++j)
        next.insert({k + j, w + static_cast<long long>(j) * slots});
      if (next.size() > kMaxSets) return {{hostCount, {all}}};
    }
    sets.swap(next);
  }
  std::map<int, std::vector<long long>> out;
  for (const auto& [k, w] : sets)
    if (k >= spec.min_nodes && k <= spec.max_nodes) out[k].push_back(w);  // (sorted: the set is)
  return out;
}

void checkPipelineWorld(const JobSpec& spec, const Overrides& given) {
  if (!spec.trainer || spec.trainer->parallel.pipeline_stages <= 1) return;
  const long long P = spec.trainer->parallel.pipeline_stages;
  const auto worlds = possibleWorldSizes(spec);
  if (worlds.empty()) return;
  const std::string where =
      fmt::format("{}: /trainer/parallel/pipeline_stages", spec.source.empty() ? "command line" : spec.source);
  const std::string layout =
      fmt::format("a pipeline job runs D x {} workers (D data-parallel replicas of the pipeline)", P);
  auto multipleAbove = [&](long long w) { return (w + P - 1) / P * P; };
  auto lowerStages = [](long long w) {
    return w < 2 ? std::string("drop trainer.parallel (one worker runs no pipeline)")
                 : fmt::format("set pipeline_stages to a divisor of {}", w);
  };
  if (spec.nodes.empty()) {
    const long long W = spec.nproc_per_node;
    if (W % P == 0) return;
    const std::string nproc = given.nproc_per_node ? "--nproc-per-node" : "nproc_per_node";
    throw SpecError(
        fmt::format("{}: {} stages do not divide the world size {} ({} {}{}); {}: set {} to a multiple of "
                    "{} (e.g. {}), or {}",
                    where, P, W, nproc, spec.nproc_auto ? "\"auto\" = " : "", W, layout, nproc, P, multipleAbove(W),
                    lowerStages(W)));
  }
  // Across hosts: every node count of the elastic range, any hosts of that count.
  std::map<int, std::vector<long long>> bad;
  for (const auto& [k, ws] : worlds)
    for (long long w : ws)
      if (w % P != 0) bad[k].push_back(w);
  if (bad.empty()) return;
  const int all = static_cast<int>(spec.nodes.size());
  if (bad.count(all)) {
    long long W = 0;
    std::vector<int> slots;
    for (const auto& n : spec.nodes) {
      W += n.slots;
      slots.push_back(n.slots);
    }
    const bool same = std::all_of(slots.begin(), slots.end(), [&](int x) { return x == slots.front(); });
    std::string hosts;
    if (same) {
      hosts = fmt::format("{} host{} x {} worker{}", all, all == 1 ? "" : "s", slots.front(),
                          slots.front() == 1 ? "" : "s");
    } else {
      std::vector<std::string> shown;
      for (size_t i = 0; i < slots.size() && i < 8; ++i) shown.push_back(std::to_string(slots[i]));
      hosts = fmt::format("{} hosts with {}{} workers", all, fmt::join(shown, "+"), slots.size() > 8 ? "+..." : "");
    }
    throw SpecError(
        fmt::format("{}: {} stages do not divide the world size {} ({}); {}: give the hosts workers (slots, "
                    "or nproc_per_node) adding up to a multiple of {} (each host a multiple of {} keeps "
                    "every pipeline on one host), or {}",
                    where, P, W, hosts, layout, P, P, lowerStages(W)));
  }
  // All hosts form whole pipelines, fewer may not: a round of such a size (after a node is
  // lost) would end the job, as the trainer's exit 2 is not restarted.
  std::vector<std::string> which;
  for (const auto& [k, ws] : bad) {
    std::vector<std::string> shown;
    for (size_t i = 0; i < ws.size() && i < 6; ++i) shown.push_back(std::to_string(ws[i]));
    which.push_back(fmt::format("{} node{}: {}{} workers", k, k == 1 ? "" : "s", fmt::join(shown, " or "),
                                ws.size() > 6 ? " or ..." : ""));
  }
  const int from = bad.rbegin()->first + 1;  // every count from here up works
  const std::string raise = given.nnodes ? fmt::format("give --nnodes {}:{}", from, spec.max_nodes)
                                         : fmt::format("raise min_nodes to {}", from);
  throw SpecError(
      fmt::format("{}: {} stages do not divide every world size of the elastic range ({}..{} nodes): {}; "
                  "{}, and a round of such a size (after a node is lost) would stop the job (a trainer's exit 2 "
                  "is not restarted): {}, or give every host a multiple of {} workers",
                  where, P, spec.min_nodes, spec.max_nodes, fmt::join(which, "; "), layout, raise, P));
}

std::string serializeForNode(const JobSpec& spec) {
  json j;
  j["name"] = spec.name;
  if (!spec.command.empty()) j["command"] = spec.command;
  j["env"] = json::object();
  for (const auto& [k, v] : spec.env) j["env"][k] = v;
  if (!spec.cwd.empty()) j["cwd"] = spec.cwd;
  if (spec.nproc_auto)
    j["nproc_per_node"] = "auto";
  else
    j["nproc_per_node"] = spec.nproc_per_node;
  if (!spec.log_dir.empty()) j["log_dir"] = spec.log_dir;
  j["max_restarts"] = spec.max_restarts;
  j["worker_timeout_s"] = spec.worker_timeout_s;
  j["restart_backoff_s"] = spec.restart_backoff_s;
  json r = {{"port", spec.rendezvous.port}, {"timeout_s", spec.rendezvous.timeout_s},
            {"heartbeat_timeout_s", spec.rendezvous.heartbeat_timeout_s}};
  if (!spec.rendezvous.addr.empty()) r["addr"] = spec.rendezvous.addr;
  if (!spec.rendezvous.master_addr.empty()) r["master_addr"] = spec.rendezvous.master_addr;
  j["rendezvous"] = r;
  j["shutdown_timeout_s"] = spec.shutdown_timeout_s;
  j["prefix_output"] = spec.prefix_output;
  j["console_ranks"] = spec.console_ranks;
  j["env_forward"] = spec.env_forward;
  if (spec.trainer) {
    const TrainerSpec& t = *spec.trainer;
    json tj;
    tj["model"] = {{"type", t.model.type}, {"layers", t.model.layers}, {"activation", t.model.activation}, {"loss", t.model.loss}};
    // Only the keys the data type takes: parseJobSpec refuses the others.
    json d = {{"type", t.data.type}, {"seed", t.data.seed}};
    if (t.data.type == "synthetic") {
      d["train_samples"] = t.data.train_samples;
      d["eval_samples"] = t.data.eval_samples;
    } else {
      d["path"] = t.data.path;
      if (!t.data.labels_path.empty()) d["labels_path"] = t.data.labels_path;
      if (!t.data.eval_path.empty()) d["eval_path"] = t.data.eval_path;
      if (!t.data.eval_labels_path.empty()) d["eval_labels_path"] = t.data.eval_labels_path;
    }
    if (t.data.type == "csv") {
      // (an index stays a number: a string would be a header name first)
      d["label_column"] =
          t.data.label_column_is_index ? json(std::stoll(t.data.label_column)) : json(t.data.label_column);
      d["header"] = t.data.header;
    }
    d["prefetch"] = t.data.prefetch ? json(*t.data.prefetch) : json("auto");
    d["loader_threads"] = t.data.loader_threads ? json(*t.data.loader_threads) : json("auto");
    tj["data"] = d;
    tj["batch_size"] = t.batch_size;
    tj["epochs"] = t.epochs;
    tj["max_steps"] = t.max_steps > 0 ? json(t.max_steps) : json(nullptr);
    json o = {{"type", t.optimizer.type}, {"lr", t.optimizer.lr}, {"weight_decay", t.optimizer.weight_decay}};
    if (t.optimizer.type == "adamw") {
      o["betas"] = {t.optimizer.beta1, t.optimizer.beta2};
      o["eps"] = t.optimizer.eps;
    } else {
      o["momentum"] = t.optimizer.momentum;
      o["nesterov"] = t.optimizer.nesterov;
    }
    tj["optimizer"] = o;
    // Only the keys of its type (the parser refuses the others).
    json l = {{"type", t.lr_schedule.type}};
    if (t.lr_schedule.type == "step") {
      l["gamma"] = t.lr_schedule.gamma;
      if (t.lr_schedule.step_size > 0) l["step_size"] = t.lr_schedule.step_size;
    } else if (t.lr_schedule.type == "warmup_cosine") {
      l["warmup_steps"] = t.lr_schedule.warmup_steps;
      l["min_lr"] = t.lr_schedule.min_lr;
    }
    tj["lr_schedule"] = l;
    tj["grad_clip_norm"] = t.grad_clip_norm;
    tj["device"] = t.device;
    tj["seed"] = t.seed;
    tj["bucket_mb"] = t.bucket_mb;
    tj["overlap"] = t.overlap ? json(*t.overlap) : json("auto");
    tj["log_every_steps"] = t.log_every_steps;
    if (!t.checkpoint.dir.empty())
      tj["checkpoint"] = {{"dir", t.checkpoint.dir}, {"every_steps", t.checkpoint.every_steps}, {"async", t.checkpoint.async}};
    json par = {{"pipeline_stages", t.parallel.pipeline_stages}, {"micro_batches", t.parallel.micro_batches},
                {"schedule", t.parallel.schedule}};
    if (!t.parallel.stage_layers.empty()) par["stage_layers"] = t.parallel.stage_layers;
    tj["parallel"] = par;
    j["trainer"] = tj;
  }
  try {
    return j.dump();
  } catch (const json::type_error&) {
    // Only --env values (from argv) can get here: everything else was JSON or checked.
    throw SpecError("a value of the job (env, --env) is not valid UTF-8 and cannot be sent to remote nodes; use UTF-8 text");
  }
}

namespace {

std::string autoOr(const std::optional<bool>& v) { return v ? (*v ? "true" : "false") : "auto"; }

// The trainer section of `dtrain validate`: every setting as the workers will use it.
std::string describeTrainer(const TrainerSpec& t) {
  std::ostringstream os;
  os << fmt::format("trainer:            {} {}, {}, {}\n", t.model.type, fmt::join(t.model.layers, "-"), t.model.activation,
                    t.model.loss);
  const auto& d = t.data;
  std::string data;
  if (d.type == "synthetic") {
    data = fmt::format("synthetic, {} train / {} eval samples, seed {}", d.train_samples, d.eval_samples, d.seed);
  } else {
    data = fmt::format("{} {}{}", d.type, d.path, d.labels_path.empty() ? "" : " + " + d.labels_path);
    if (d.type == "csv") data += fmt::format(", label column {}, header {}", d.label_column, d.header);
    data += d.eval_path.empty() ? ", last 10% held out"
                                : fmt::format(", eval {}{}", d.eval_path, d.eval_labels_path.empty() ? "" : " + " + d.eval_labels_path);
  }
  os << fmt::format("  data:             {}, prefetch {}, loader threads {}\n", data, autoOr(d.prefetch),
                    d.loader_threads ? std::to_string(*d.loader_threads) : std::string("auto"));
  os << fmt::format("  batch_size:       {} per worker, {} epoch{}{}\n", t.batch_size, t.epochs, t.epochs == 1 ? "" : "s",
                    t.max_steps > 0 ? fmt::format(", at most {} steps", t.max_steps) : "");
  const auto& o = t.optimizer;
  os << fmt::format("  optimizer:        {}\n",
                    o.type == "adamw" ? fmt::format("adamw lr {}, betas {} {}, eps {}, weight_decay {}", o.lr, o.beta1,
                                                    o.beta2, o.eps, o.weight_decay)
                                      : fmt::format("sgd lr {}, momentum {}{}, weight_decay {}", o.lr, o.momentum,
                                                    o.nesterov ? " (nesterov)" : "", o.weight_decay));
  const auto& l = t.lr_schedule;
  std::string sched = l.type;
  if (l.type == "step") sched += fmt::format(", x{} every {} steps", l.gamma, l.step_size);
  if (l.type == "warmup_cosine") sched += fmt::format(", {} warm-up steps, min_lr {}", l.warmup_steps, l.min_lr);
  os << fmt::format("  lr_schedule:      {}\n", sched);
  if (t.grad_clip_norm > 0) os << fmt::format("  grad_clip_norm:   {}\n", t.grad_clip_norm);
  os << fmt::format("  device:           {}, seed {}, bucket_mb {}, overlap {}, log every {} steps\n", t.device, t.seed,
                    t.bucket_mb, autoOr(t.overlap), t.log_every_steps);
  os << fmt::format("  checkpoint:       {}\n", t.checkpoint.dir.empty() ? std::string("(none)")
                                                  : fmt::format("{} {}{}", t.checkpoint.dir,
                                                                t.checkpoint.every_steps > 0
                                                                    ? fmt::format("every {} steps", t.checkpoint.every_steps)
                                                                    : std::string("at the end only (no every_steps)"),
                                                                t.checkpoint.async ? ", written in the background" : ""));
  const auto& p = t.parallel;
  if (p.pipeline_stages > 1)
    os << fmt::format("  parallel:         {} pipeline stages{}, {} micro-batches, {}\n", p.pipeline_stages,
                      p.stage_layers.empty() ? "" : fmt::format(" (layers {})", fmt::join(p.stage_layers, ",")),
                      p.micro_batches, p.schedule);
  return os.str();
}

}  // namespace

// validate's output goes to CI logs and terminals: a variable whose name says it holds a
// credential (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD) is shown as set,
// not by its value, as CI systems mask theirs.
static bool looksSecret(const std::string& name) {
  std::string upper;
  for (char ch : name) upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(ch))));
  for (const char* word : {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH", "COOKIE", "PRIVATE"})
    if (upper.find(word) != std::string::npos) return true;
  return false;
}

// A value that is a credential whatever its variable is called (HUB=hf_..., GH=ghp_...,
// a URL with a password): the formats of the issuers users' training jobs talk to, whose
// prefixes exist so that scanners can find them. Nothing guessed from entropy alone: a path
// or a hash is not hidden.
static bool looksSecretValue(const std::string& v) {
  auto starts = [&](const char* p) { return v.rfind(p, 0) == 0; };
  for (const char* prefix : {"ghp_", "gho_", "ghs_", "ghu_", "ghr_", "github_pat_", "glpat-", "xoxb-", "xoxp-",
                             "xoxa-", "xapp-", "hf_", "sk-", "sk_live_", "rk_live_", "npm_", "pypi-", "AIza"})
    if (starts(prefix) && v.size() >= std::strlen(prefix) + 16) return true;
  if ((starts("AKIA") || starts("ASIA")) && v.size() == 20) return true;  // an AWS access key id
  if (starts("-----BEGIN ") && v.find("PRIVATE KEY") != std::string::npos) return true;
  // A JWT (an OIDC or service token): three base64url parts, a JSON header ('{"' -> "eyJ").
  return starts("eyJ") && std::count(v.begin(), v.end(), '.') == 2 && v.size() >= 32;
}

// "scheme://user:password@host..." with the password hidden; the rest shown (where the job
// connects is worth seeing). Empty when `v` has no such password.
static std::string withoutUrlPassword(const std::string& v) {
  const size_t scheme = v.find("://");
  if (scheme == std::string::npos) return "";
  const size_t start = scheme + 3;
  const size_t end = v.find_first_of("/?#", start);
  const size_t at = v.rfind('@', end == std::string::npos ? std::string::npos : end);
  if (at == std::string::npos || at < start) return "";
  const size_t colon = v.find(':', start);
  if (colon == std::string::npos || colon > at || colon + 1 == at) return "";
  return v.substr(0, colon + 1) + "(hidden)" + v.substr(at);
}

static std::string shownEnvValue(const std::string& name, const std::string& v) {
  if (looksSecret(name)) return fmt::format("(hidden: {} characters)", v.size());
  if (looksSecretValue(v)) return fmt::format("(hidden: {} characters, a credential's format)", v.size());
  if (std::string url = withoutUrlPassword(v); !url.empty()) return url;
  return v;
}

// A command's words as validate shows them: a credential passed as an argument is hidden like
// an env value: by its format (hf_..., a URL's password), as --token=VALUE, or as the word
// after an option named for one (--api-key VALUE; not --key-file PATH: a path is no secret).
static std::vector<std::string> shownWords(const std::vector<std::string>& command) {
  auto secretOption = [](const std::string& w) {
    if (w.size() < 2 || w[0] != '-') return false;
    std::string upper;
    for (char ch : w) upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(ch))));
    for (const char* notSecret : {"FILE", "PATH", "DIR"})
      if (upper.find(notSecret) != std::string::npos) return false;
    return looksSecret(w);
  };
  std::vector<std::string> out;
  bool hideNext = false;
  for (const auto& a : command) {
    std::string shown = a;
    const size_t eq = a.find('=');
    if (hideNext && !(a.size() > 1 && a[0] == '-')) {
      shown = fmt::format("(hidden: {} characters)", a.size());
    } else if (eq != std::string::npos && secretOption(a.substr(0, eq))) {
      shown = a.substr(0, eq + 1) + fmt::format("(hidden: {} characters)", a.size() - eq - 1);
    } else if (looksSecretValue(a) || (eq != std::string::npos && looksSecretValue(a.substr(eq + 1)))) {
      shown = eq != std::string::npos && !looksSecretValue(a)
                  ? a.substr(0, eq + 1) + fmt::format("(hidden: {} characters, a credential's format)", a.size() - eq - 1)
                  : fmt::format("(hidden: {} characters, a credential's format)", a.size());
    } else if (std::string url = withoutUrlPassword(a); !url.empty()) {
      shown = url;
    }
    hideNext = eq == std::string::npos && secretOption(a);
    out.push_back(shown == a ? shellQuote(a) : shown);
  }
  return out;
}

std::string shownCommand(const std::vector<std::string>& command) {
  std::vector<std::string> words = command;
  for (auto& w : words) w = oneLine(w);
  return fmt::format("{}", fmt::join(shownWords(words), " "));
}

std::string describe(const JobSpec& raw) {
  // One value per line: a newline or a terminal control in a path, a command word or an env
  // value is shown escaped (\n, \x1b), not as a line of its own or sent to the terminal.
  JobSpec spec = raw;
  auto esc = [](std::string& v) { v = oneLine(v); };
  for (std::string* v : {&spec.cwd, &spec.log_dir, &spec.env_file, &spec.hostfile, &spec.ssh.identity_file,
                         &spec.ssh.dtrain_path, &spec.ssh.user, &spec.rendezvous.addr, &spec.rendezvous.master_addr})
    esc(*v);
  for (auto& w : spec.command) esc(w);
  for (auto& o : spec.ssh.options) esc(o);
  for (auto& [k, v] : spec.env) esc(v);
  for (auto& n : spec.nodes)
    for (std::string* v : {&n.host, &n.user, &n.address}) esc(*v);
  if (spec.trainer) {
    auto& d = spec.trainer->data;
    for (std::string* v : {&d.path, &d.labels_path, &d.eval_path, &d.eval_labels_path, &spec.trainer->checkpoint.dir})
      esc(*v);
  }
  std::ostringstream os;
  os << fmt::format("name:               {}\n", spec.name);
  os << fmt::format("command:            {}\n", fmt::join(shownWords(spec.command), " "));
  os << fmt::format("cwd:                {}\n", spec.cwd.empty() ? "(current directory)" : spec.cwd);
  if (spec.nproc_auto && !spec.nodes.empty())  // (this host's count says nothing about the others)
    os << "nproc_per_node:     auto (counted on each host: its GPUs, else its usable CPUs)\n";
  else
    os << fmt::format("nproc_per_node:     {}{}\n", spec.nproc_per_node,
                      !spec.nproc_auto ? "" : spec.nproc_auto_note.empty() ? " (auto)" : " (auto: " + spec.nproc_auto_note + ")");
  os << fmt::format("log_dir:            {}\n", spec.log_dir.empty() ? "(none)" : spec.log_dir);
  os << fmt::format("max_restarts:       {}\n", spec.max_restarts);
  if (spec.max_restarts > 0)
    os << fmt::format("restart_backoff_s:  {} (doubling with each restart, at most 60 s)\n", spec.restart_backoff_s);
  if (!spec.nodes.empty()) os << fmt::format("nodes range:        {}..{} (min_nodes..max_nodes)\n", spec.min_nodes, spec.max_nodes);
  if (spec.worker_timeout_s > 0) os << fmt::format("worker_timeout_s:   {}\n", spec.worker_timeout_s);
  os << fmt::format("shutdown_timeout_s: {}\n", spec.shutdown_timeout_s);
  os << fmt::format("rendezvous:         port {}, timeout {} s\n",
                    spec.rendezvous.port ? std::to_string(spec.rendezvous.port) : std::string("any free"),
                    spec.rendezvous.timeout_s);
  os << fmt::format("prefix_output:      {}\n", spec.prefix_output);
  if (!spec.console_ranks.empty()) os << fmt::format("console_ranks:      {}\n", fmt::join(spec.console_ranks, ","));
  for (const auto& [k, v] : spec.env)
    os << fmt::format("env:                {}={}\n", k, shownEnvValue(k, v));
  if (!spec.env_file.empty()) os << fmt::format("env_file:           {} (under env)\n", spec.env_file);
  if (spec.trainer) os << describeTrainer(*spec.trainer);
  if (spec.nodes.empty()) return os.str();

  if (!spec.rendezvous.addr.empty()) os << fmt::format("rendezvous.addr:    {}\n", spec.rendezvous.addr);
  if (!spec.rendezvous.master_addr.empty()) os << fmt::format("master_addr:        {}\n", spec.rendezvous.master_addr);
  os << fmt::format("heartbeat timeout:  {} s (a node whose agent is silent this long is lost)\n",
                    spec.rendezvous.heartbeat_timeout_s);
  os << fmt::format("nodes:              {}{}\n", spec.nodes.size(),
                    spec.hostfile.empty() ? "" : fmt::format(" (from {})", spec.hostfile));
  for (size_t i = 0; i < spec.nodes.size(); ++i) {
    const NodeSpec& n = spec.nodes[i];
    std::string slots = n.slots ? fmt::format("{} slot{}", n.slots, n.slots == 1 ? "" : "s") : std::string("auto slots");
    std::string extra;
    if (!n.user.empty()) extra += fmt::format(", user {}", n.user);
    if (n.port) extra += fmt::format(", port {}", n.port);
    if (!n.gpus.empty()) extra += fmt::format(", gpus {}", fmt::join(n.gpus, ","));
    if (!n.address.empty()) extra += fmt::format(", address {}", n.address);
    os << fmt::format("{:<20}{}: {}{}, {}\n", fmt::format("  node {}:", i), n.host, slots, extra, n.local ? "local (no ssh)" : "ssh");
  }
  const SshSpec& s = spec.ssh;
  os << fmt::format("ssh:                user {}, port {}, connect timeout {} s, host keys {}\n",
                    s.user.empty() ? "(ssh default)" : s.user, s.port ? std::to_string(s.port) : std::string("(ssh default)"),
                    s.connect_timeout_s, s.host_key_checking);
  if (!s.identity_file.empty()) os << fmt::format("ssh identity:       {}\n", s.identity_file);
  if (!s.options.empty()) os << fmt::format("ssh options:        {}\n", fmt::join(s.options, " "));
  os << fmt::format("remote dtrain:      {}\n", s.dtrain_path.empty() ? "(this binary's path)" : s.dtrain_path);
  os << fmt::format("env_forward:        {}\n", spec.env_forward.empty() ? std::string("(none)") : fmt::format("{}", fmt::join(spec.env_forward, " ")));
  return os.str();
}

}  // namespace dtrain::spec
