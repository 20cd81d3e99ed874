#include "dtrain/launch/agent_protocol.h"

#include <signal.h>

#include <charconv>

#include "dtrain/common/strings.h"

namespace dtrain::launch::proto {

std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      // (the reader's line splitter takes a CR for a progress line's restart: a raw one cut
      // the record to its tail, and an exit record so cut was lost, the job waiting for good)
      case '\r': out += "\\r"; break;
      default: out += c;
    }
  }
  return out;
}

std::string unescape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c != '\\' || i + 1 == s.size()) {
      out += c;
      continue;
    }
    char n = s[++i];
    out += n == 't' ? '\t' : n == 'n' ? '\n' : n == 'r' ? '\r' : n;
  }
  return out;
}

std::string record(char type, const std::vector<std::string>& fields) {
  std::string out(1, type);
  for (const auto& f : fields) {
    out += '\t';
    out += escape(f);
  }
  out += '\n';
  return out;
}

std::optional<Record> parse(std::string_view line) {
  if (line.empty()) return std::nullopt;
  Record r;
  r.type = line[0];
  if (line.size() > 1 && line[1] != '\t') return std::nullopt;
  size_t pos = 1;
  while (pos < line.size()) {
    size_t start = pos + 1;
    size_t end = line.find('\t', start);
    if (end == std::string_view::npos) end = line.size();
    r.fields.push_back(unescape(line.substr(start, end - start)));
    pos = end;
  }
  return r;
}

namespace {
bool toInt(const std::string& s, int& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}
}  // namespace

std::string stopCommand(int sig) {
  return sig == SIGINT || sig == SIGHUP || sig == SIGQUIT ? "stop " + signalName(sig) : std::string("stop");
}

std::optional<int> stopSignal(std::string_view command) {
  auto words = split(command, ' ');
  if (words.empty() || words[0] != "stop") return std::nullopt;
  if (words.size() == 2 && words[1] == "SIGINT") return SIGINT;
  if (words.size() == 2 && words[1] == "SIGHUP") return SIGHUP;
  if (words.size() == 2 && words[1] == "SIGQUIT") return SIGQUIT;
  return SIGTERM;
}

std::string exitRecord(const WorkerExit& w) {
  std::vector<std::string> f = {std::to_string(w.global_rank), std::to_string(w.local_rank), std::to_string(w.pid),
                                std::to_string(w.exit_code),   std::to_string(w.signal),     w.stopped_by_dtrain ? "1" : "0",
                                // flags: 1 hung, 2 could not be started, 4 a trainer refused its
                                // input, bits 8..15 after_stop's signal (an agent of before knew
                                // only 1)
                                std::to_string((w.hung ? 1 : 0) | (w.start_failed ? 2 : 0) | (w.refused_input ? 4 : 0) |
                                               ((w.after_stop & 0xff) << 8)),
                                w.when,                        w.error_message,              w.error_traceback};
  for (const auto& l : w.stderr_tail) f.push_back(l);
  return record('X', f);
}

std::optional<WorkerExit> parseExit(const Record& r) {
  if (r.type != 'X' || r.fields.size() < 10) return std::nullopt;
  WorkerExit w;
  int stopped = 0, hung = 0;
  if (!toInt(r.fields[0], w.global_rank) || !toInt(r.fields[1], w.local_rank) || !toInt(r.fields[2], w.pid) ||
      !toInt(r.fields[3], w.exit_code) || !toInt(r.fields[4], w.signal) || !toInt(r.fields[5], stopped) ||
      !toInt(r.fields[6], hung))
    return std::nullopt;
  w.stopped_by_dtrain = stopped != 0;
  w.hung = (hung & 1) != 0;
  w.start_failed = (hung & 2) != 0;
  w.refused_input = (hung & 4) != 0;
  w.after_stop = (hung >> 8) & 0xff;
  w.when = r.fields[7];
  w.error_message = r.fields[8];
  w.error_traceback = r.fields[9];
  w.stderr_tail.assign(r.fields.begin() + 10, r.fields.end());
  return w;
}

}  // namespace dtrain::launch::proto
