// Hostfiles, --hosts lists and "is this host this machine?".
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/signal_mask.h"
#include "dtrain/common/strings.h"
#include "dtrain/spec/job_spec.h"
#include "input_file.h"
#include "node_checks.h"

namespace dtrain::spec {
namespace detail {

namespace {
std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

// Messages are one line: control and non-ASCII bytes are shown as \xNN.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) out += ch >= 0x20 && ch < 0x7f ? std::string(1, static_cast<char>(ch)) : fmt::format("\\x{:02x}", ch);
  return out;
}

std::string nameProblem(const std::string& value, const char* what, const std::string& extra) {
  if (value.empty()) return fmt::format("empty {}", what);
  if (value[0] == '-') return fmt::format("{} \"{}\" starts with '-' (ssh would read it as an option)", what, printable(value));
  for (char ch : value) {
    bool ok = std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' || ch == '_' ||
              extra.find(ch) != std::string::npos;
    if (!ok) return fmt::format("{} \"{}\" contains '{}'", what, printable(value), printable(std::string(1, ch)));
  }
  return "";
}
}  // namespace

bool allDigits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char ch) { return std::isdigit(ch); });
}

std::string hostProblem(const std::string& host) {
  // "2" would be taken for the IPv4 address 0.0.0.2 (inet_aton's short forms): never meant.
  if (allDigits(host)) return fmt::format("\"{}\" is not a host name (a number is read as an IPv4 address)", host);
  // (a user@ part aside: DNS names end at 253 characters)
  const size_t at = host.rfind('@');
  const size_t name = host.size() - (at == std::string::npos ? 0 : at + 1);
  if (name > 253) return fmt::format("a host name of {} characters (at most 253 in DNS)", name);
  if (auto p = nameProblem(host, "host name", ":%"); !p.empty()) return p;
  const std::string h = host.substr(at == std::string::npos ? 0 : at + 1);
  // ':' and '%' belong to IPv6 addresses (fe80::1%eth0) alone: "gpu-a:2:4", "gpu-a::8" or
  // "h%1" would reach ssh as a name no resolver has.
  if (h.find(':') != std::string::npos || h.find('%') != std::string::npos) {
    const size_t pct = h.find('%');
    const std::string addr = h.substr(0, pct);
    in6_addr a{};
    if (h.find(':') == std::string::npos || ::inet_pton(AF_INET6, addr.c_str(), &a) != 1 ||
        (pct != std::string::npos && pct + 1 == h.size()))
      return fmt::format("\"{}\" is neither a host name nor an IPv6 address (':' and '%' belong to IPv6 addresses; "
                         "host:N means N workers)",
                         printable(h));
    if (IN6_IS_ADDR_UNSPECIFIED(&a)) return fmt::format("\"{}\" is the unspecified address, no host", printable(h));
    // The zone is an interface's name or index: "fe80::1%eth0:2" meant 2 workers, not a zone
    // "eth0:2" (the count was dropped, and ssh was given a zone no interface has).
    if (pct != std::string::npos) {
      const std::string zone = h.substr(pct + 1);
      if (!std::all_of(zone.begin(), zone.end(),
                       [](unsigned char ch) { return std::isalnum(ch) || ch == '_' || ch == '.' || ch == '-'; }))
        return fmt::format("\"{}\": \"{}\" after '%' is not an interface name (a zone is eth0, ib0 or an index); N "
                           "workers on an IPv6 address are written [{}]:N",
                           printable(h), printable(zone), printable(h.substr(0, h.find_first_of(":%", pct + 1))));
    }
    return "";
  }
  // Digits and dots alone are an IPv4 address, whole: inet_aton reads "1.2" as 1.0.0.2.
  if (std::all_of(h.begin(), h.end(), [](unsigned char ch) { return std::isdigit(ch) || ch == '.'; })) {
    in_addr a{};
    if (::inet_pton(AF_INET, h.c_str(), &a) != 1)
      return fmt::format("\"{}\" is not an IPv4 address (four numbers 0-255: a.b.c.d) nor a host name", printable(h));
    return "";
  }
  if (h[0] == '.' || h.find("..") != std::string::npos)
    return fmt::format("host name \"{}\" has an empty part between dots", printable(h));
  return "";
}
std::string userProblem(const std::string& user) { return nameProblem(user, "user name", ""); }

int parseSlotCount(const std::string& text) {
  if (text.empty() || text.size() > 5) return -1;
  for (char ch : text)
    if (!std::isdigit(static_cast<unsigned char>(ch))) return -1;
  int v = std::stoi(text);
  return v >= 1 && v <= 4096 ? v : -1;
}

std::string parseGpuList(const std::string& text, std::vector<int>& out) {
  out.clear();
  for (const auto& part : split(text, ',')) {
    bool digits = !part.empty() && part.size() <= 4 &&
                  std::all_of(part.begin(), part.end(), [](unsigned char ch) { return std::isdigit(ch); });
    if (!digits) return fmt::format("bad GPU index \"{}\" in \"{}\"", part, text);
    int g = std::stoi(part);
    if (g > 1023) return fmt::format("bad GPU index \"{}\" in \"{}\"", part, text);
    if (std::find(out.begin(), out.end(), g) != out.end()) return fmt::format("GPU {} is listed twice in \"{}\"", g, text);
    out.push_back(g);
  }
  return "";
}

int findDuplicate(const std::vector<NodeSpec>& nodes, const NodeSpec& n) {
  std::string h = lower(n.host);
  for (size_t i = 0; i < nodes.size(); ++i)
    if (lower(nodes[i].host) == h && nodes[i].port == n.port) return static_cast<int>(i);
  return -1;
}

std::string hostLabel(const NodeSpec& n) {
  return n.port ? fmt::format("host \"{}\" (port {})", n.host, n.port) : fmt::format("host \"{}\"", n.host);
}

}  // namespace detail

namespace {

using Fail = std::function<void(const std::string&)>;

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

// "[user@]host[:N]", "[user@][v6addr]:N" or "[user@]v6addr". Sets slots when ":N" is there
// and returns whether it was.
bool parseHostToken(const std::string& token, NodeSpec& n, const Fail& fail, const std::string& slotsFix) {
  std::string rest = token;
  if (auto at = token.find('@'); at != std::string::npos) {
    n.user = token.substr(0, at);
    rest = token.substr(at + 1);
    if (n.user.empty()) fail(fmt::format("empty user name in \"{}\"; write user@host, or just host", token));
    if (auto p = detail::userProblem(n.user); !p.empty()) fail(fmt::format("{} in \"{}\"; fix the user name", p, token));
  }
  std::string slots;
  bool hasSlots = false;
  if (!rest.empty() && rest[0] == '[') {
    auto close = rest.find(']');
    if (close == std::string::npos) fail(fmt::format("unclosed '[' in \"{}\"; write an IPv6 address as [addr] or [addr]:N", token));
    n.host = rest.substr(1, close - 1);
    if (n.host.find(':') == std::string::npos)
      fail(fmt::format("\"[{}]\": brackets are for IPv6 addresses; write {} without them", n.host, n.host));
    std::string after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') fail(fmt::format("unexpected \"{}\" after \"{}\"; write [addr]:N", after, rest.substr(0, close + 1)));
      hasSlots = true;
      slots = after.substr(1);
    }
  } else if (std::count(rest.begin(), rest.end(), ':') == 1) {
    auto colon = rest.find(':');
    n.host = rest.substr(0, colon);
    hasSlots = true;
    slots = rest.substr(colon + 1);
  } else {
    n.host = rest;  // a plain name, or an IPv6 address without slots
  }
  if (detail::allDigits(n.host))
    fail(fmt::format("\"{}\" is not a host name; DeepSpeed's --include host:1,2 (GPUs 1 and 2) is gpus=1,2 on that "
                     "host's hostfile line (\"host gpus=1,2\"), and host:N means N workers",
                     n.host));
  if (auto p = detail::hostProblem(n.host); !p.empty())
    fail(fmt::format("{}; give a host name or address{}", p, n.host.empty() ? "" : " (user@host for a login name)"));
  if (hasSlots) {
    n.slots = detail::parseSlotCount(slots);
    if (n.slots < 0)
      fail(fmt::format("bad slot count \"{}\" for host \"{}\"; {}{}", slots, n.host, slotsFix,
                       slots.find(',') != std::string::npos
                           ? fmt::format(" (GPU indices go in gpus=: \"{} gpus={}\" on a hostfile line)", n.host, slots)
                           : std::string()));
  }
  return hasSlots;
}

const char* kKnownFields = "slots=N, max_slots=N, gpus=..., port=N, address=...";

}  // namespace

std::vector<NodeSpec> parseHostfile(const std::string& text, const std::string& source) {
  std::vector<NodeSpec> nodes;
  std::vector<int> lineOf;
  // A UTF-8 byte-order mark (some Windows editors write one) is not part of the first host.
  std::istringstream in(text.rfind("\xEF\xBB\xBF", 0) == 0 ? text.substr(3) : text);
  std::string raw;
  int lineNo = 0;
  while (std::getline(in, raw)) {
    ++lineNo;
    // Old Mac line ends (CR alone): the whole file is one line, and a '#' in it would drop
    // the hosts after it without a word.
    if (!raw.empty() && raw.back() == '\r') raw.pop_back();
    if (raw.find('\r') != std::string::npos)
      throw SpecError(fmt::format("{}:{}: the lines end with a carriage return alone (CR, not LF or CRLF): convert "
                                  "the file (tr '\\r' '\\n')",
                                  source, lineNo));
    if (auto hash = raw.find('#'); hash != std::string::npos) raw.erase(hash);
    auto tokens = words(raw);
    if (tokens.empty()) continue;
    const std::string where = fmt::format("{}:{}", source, lineNo);
    // (what the line holds is quoted in the messages: a control character or a NUL in it is
    // shown escaped, not cutting the message short)
    Fail fail = [&](const std::string& msg) { throw SpecError(oneLine(fmt::format("{}: {}", where, msg))); };
    NodeSpec n;
    n.origin = where;
    const std::string slotsFix = "give slots=N (or host:N) with N between 1 and 4096";
    bool slotsSeen = parseHostToken(tokens[0], n, fail, slotsFix);
    std::vector<std::string> seen;
    if (slotsSeen) seen.push_back("slots");
    for (size_t i = 1; i < tokens.size(); ++i) {
      const std::string& tok = tokens[i];
      auto eq = tok.find('=');
      std::string key = eq == std::string::npos ? tok : tok.substr(0, eq);
      std::string value = eq == std::string::npos ? "" : tok.substr(eq + 1);
      static const std::vector<std::string> kFields = {"slots", "max_slots", "gpus", "port", "address"};
      // "slots = 2", "slots= 2", "slots =2": spaces around '=' split a field in two.
      const std::string next = i + 1 < tokens.size() ? tokens[i + 1] : std::string();
      if ((eq == std::string::npos && !next.empty() && next[0] == '=') || eq == 0 ||
          (eq != std::string::npos && eq + 1 == tok.size() && i + 1 < tokens.size()))
      {
        const std::string field = eq == 0 && i > 1 ? tokens[i - 1] : key;
        // The value as given: after the '=' in this word or the next ones.
        std::string val = eq != std::string::npos ? tok.substr(eq + 1) : std::string();
        for (size_t j = i + 1; val.empty() && j < tokens.size() && j <= i + 2; ++j)
          val = tokens[j][0] == '=' ? tokens[j].substr(1) : (tokens[j - 1].back() == '=' || j == i + 2 ? tokens[j] : "");
        fail(fmt::format("spaces around '=' split the field \"{}\"; write it without them, e.g. {}={}", field, field,
                         val.empty() ? "N" : val));
      }
      if (eq == std::string::npos || std::find(kFields.begin(), kFields.end(), key) == kFields.end()) {
        std::string hint = eq == std::string::npos ? "" : closestMatch(key, kFields);
        if (!hint.empty())
          fail(fmt::format("unknown field \"{}\"; did you mean \"{}={}\"? known fields: {}", tok, hint, value, kKnownFields));
        fail(fmt::format("unknown field \"{}\"; known fields: {}", tok, kKnownFields));
      }
      if (std::find(seen.begin(), seen.end(), key) != seen.end())
        fail(fmt::format("{} is given twice for host \"{}\"; keep one", key, n.host));
      seen.push_back(key);
      if (key == "slots") {
        n.slots = detail::parseSlotCount(value);
        if (n.slots < 0) fail(fmt::format("bad slot count \"{}\" for host \"{}\"; {}", value, n.host, slotsFix));
      } else if (key == "max_slots") {  // OpenMPI's cap on oversubscription; dtrain runs exactly slots
        n.max_slots = detail::parseSlotCount(value);
        if (n.max_slots < 0)
          fail(fmt::format("bad max_slots \"{}\" for host \"{}\"; give max_slots=N with N between 1 and 4096", value,
                           n.host));
      } else if (key == "gpus") {
        if (auto p = detail::parseGpuList(value, n.gpus); !p.empty())
          fail(fmt::format("{} for host \"{}\"; give GPU indices like gpus=0,1", p, n.host));
      } else if (key == "port") {
        int port = -1;
        if (!value.empty() && value.size() <= 5 &&
            std::all_of(value.begin(), value.end(), [](unsigned char ch) { return std::isdigit(ch); }))
          port = std::stoi(value);
        if (port < 1 || port > 65535)
          fail(fmt::format("bad ssh port \"{}\" for host \"{}\"; give port=N with N between 1 and 65535", value, n.host));
        n.port = port;
      } else {  // address
        if (auto p = detail::hostProblem(value); !p.empty())
          fail(fmt::format("bad address for host \"{}\": {}; give address=IP or a name the other nodes resolve", n.host,
                           value.empty() ? "empty address" : p));
        n.address = value;
      }
    }
    if (n.max_slots > 0 && n.slots > n.max_slots)
      fail(fmt::format("slots={} is more than max_slots={} for host \"{}\"; dtrain runs exactly slots workers and never "
                       "oversubscribes: give max_slots >= slots, or leave max_slots out",
                       n.slots, n.max_slots, n.host));
    if (int dup = detail::findDuplicate(nodes, n); dup >= 0)
      fail(fmt::format("{} is listed twice (first on line {}); remove one of the lines (slots=N runs more workers on one host)",
                       detail::hostLabel(n), lineOf[dup]));
    nodes.push_back(std::move(n));
    lineOf.push_back(lineNo);
  }
  if (nodes.empty())
    throw SpecError(fmt::format("{}: no hosts listed; add one line per host, e.g. \"node1 slots=8\"", source));
  detail::markLocal(nodes);
  return nodes;
}

std::vector<NodeSpec> loadHostfile(const std::string& path) {
  return parseHostfile(detail::readInputOrThrow(path, "hostfile", "give a hostfile (one host per line)"), path);
}

std::vector<NodeSpec> parseHostList(const std::string& list) {
  std::vector<NodeSpec> nodes;
  auto items = split(list, ',');
  for (size_t i = 0; i < items.size(); ++i) {
    std::string item = trim(items[i]);
    Fail fail = [&](const std::string& msg) { throw SpecError("--hosts: " + msg); };
    if (item.empty())
      fail(list.empty() ? std::string("expected a comma-separated list like \"h1:2,user@h2:2,h3\", got \"\"")
                        : fmt::format("empty entry {} in \"{}\"; give hosts like \"h1:2,user@h2:2,h3\"", i + 1, list));
    NodeSpec n;
    n.origin = "--hosts";
    // DeepSpeed's --include localhost:0,2 given here: "2" is no host (and "localhost:0" no
    // slot count), said before either.
    const std::string next = i + 1 < items.size() ? trim(items[i + 1]) : std::string();
    if (detail::allDigits(next) && std::count(item.begin(), item.end(), ':') == 1 &&
        detail::allDigits(item.substr(item.find(':') + 1))) {
      const std::string host = item.substr(0, item.find(':'));
      std::string gpus = item.substr(item.find(':') + 1);
      for (size_t k = i + 1; k < items.size() && detail::allDigits(trim(items[k])); ++k) gpus += "," + trim(items[k]);
      fail(fmt::format("\"{}\" is not a host name; DeepSpeed's --include {}:{} (GPUs {}) is the hostfile line \"{} "
                       "gpus={}\" (--hostfile FILE); in --hosts, host:N means N workers",
                       next, host, gpus, gpus, host, gpus));
    }
    parseHostToken(item, n, fail, "give host:N with N between 1 and 4096");
    if (int dup = detail::findDuplicate(nodes, n); dup >= 0)
      fail(fmt::format("{} is listed twice (entries {} and {}); give it once, with host:N for more workers",
                       detail::hostLabel(n), dup + 1, i + 1));
    nodes.push_back(std::move(n));
  }
  detail::markLocal(nodes);
  return nodes;
}

// ---------------------------------------------------------------------------------------
// isLocalHost

namespace {

struct Address {
  int family = 0;
  unsigned char bytes[16] = {};
  bool operator==(const Address& o) const {
    return family == o.family && std::memcmp(bytes, o.bytes, family == AF_INET ? 4 : 16) == 0;
  }
};

bool fromSockaddr(const sockaddr* sa, Address& out) {
  if (sa == nullptr) return false;
  if (sa->sa_family == AF_INET) {
    out.family = AF_INET;
    std::memcpy(out.bytes, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, 4);
    return true;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* a6 = &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(a6)) {  // ::ffff:a.b.c.d is the IPv4 address
      out.family = AF_INET;
      std::memcpy(out.bytes, a6->s6_addr + 12, 4);
    } else {
      out.family = AF_INET6;
      std::memcpy(out.bytes, a6->s6_addr, 16);
    }
    return true;
  }
  return false;
}

bool isLoopback(const Address& a) {
  if (a.family == AF_INET) return a.bytes[0] == 127;
  static const unsigned char kV6Loopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  return std::memcmp(a.bytes, kV6Loopback, 16) == 0;
}

std::vector<Address> interfaceAddresses() {
  std::vector<Address> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    Address a;
    if (fromSockaddr(i->ifa_addr, a)) out.push_back(a);
  }
  ::freeifaddrs(list);
  return out;
}

std::vector<Address> lookup(const std::string& host, bool numericOnly) {
  std::vector<Address> out;
  addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (numericOnly) hints.ai_flags = AI_NUMERICHOST;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* r = res; r != nullptr; r = r->ai_next) {
    Address a;
    if (fromSockaddr(r->ai_addr, a)) out.push_back(a);
  }
  ::freeaddrinfo(res);
  return out;
}

// Name lookups run on detached threads: getaddrinfo cannot be cancelled, and a hostfile of
// ssh aliases must not cost a DNS timeout per line. All names of a list are looked up at
// once under one deadline; a name that does not resolve by then is not this machine's (ssh
// still reaches it). Results, timeouts included, are cached so that answers stay consistent.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::vector<Address> addrs;
};

std::shared_ptr<Pending> startLookup(const std::string& host) {
  auto p = std::make_shared<Pending>();
  // The thread starts with every signal blocked (it inherits the mask set here): it may
  // outlive its deadline in a hung getaddrinfo, and a process-directed signal delivered to it
  // would bypass the mask dtrain's own thread keeps at the end of a run.
  const AllSignalsBlocked blocked;
  try {
    std::thread([p, host] {
      auto addrs = lookup(host, false);
      std::lock_guard<std::mutex> lock(p->mu);
      p->addrs = std::move(addrs);
      p->done = true;
      p->cv.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    std::lock_guard<std::mutex> lock(p->mu);
    p->done = true;  // no thread to spare: treat the name as remote
  }
  return p;
}

constexpr auto kLookupLimit = std::chrono::milliseconds(1500);
// Threads in flight at once: a hostfile of ssh_config aliases (which DNS does not know) waits
// the limit once per batch: 500 of them took 12 s at 64 a batch.
constexpr size_t kLookupBatch = 256;

std::mutex cacheMu;
std::map<std::string, std::vector<Address>>& lookupCache() {
  static std::map<std::string, std::vector<Address>> cache;
  return cache;
}

std::string normalized(const std::string& hostIn) {
  std::string host = detail::lower(hostIn);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

// Decided without a name lookup: 1 local, 0 not, -1 needs one (addrs filled when numeric).
int quickAnswer(const std::string& host, std::vector<Address>& addrs) {
  if (host.empty()) return 0;
  if (host == "localhost" || host == "localhost.localdomain" || host == "ip6-localhost" || host == "ip6-loopback")
    return 1;
  addrs = lookup(host, true);
  if (!addrs.empty()) return 2;  // numeric: compare addresses
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) == 0 && buf[0] != '\0') {
    std::string self = detail::lower(buf);
    if (host == self || host == self.substr(0, self.find('.'))) return 1;
  }
  return -1;
}

bool addressesAreLocal(const std::vector<Address>& addrs, const std::vector<Address>& mine) {
  for (const auto& a : addrs)
    if (isLoopback(a) || std::find(mine.begin(), mine.end(), a) != mine.end()) return true;
  return false;
}

std::atomic<bool> nameLookups{true};

std::vector<bool> localFlags(const std::vector<std::string>& hostsIn) {
  std::vector<bool> out(hostsIn.size(), false);
  std::vector<std::vector<Address>> addrs(hostsIn.size());
  std::vector<size_t> toResolve;
  for (size_t i = 0; i < hostsIn.size(); ++i) {
    std::string host = normalized(hostsIn[i]);
    int quick = quickAnswer(host, addrs[i]);
    if (quick == 1) out[i] = true;
    if (quick != -1 || !nameLookups) continue;
    std::lock_guard<std::mutex> lock(cacheMu);
    if (auto it = lookupCache().find(host); it != lookupCache().end())
      addrs[i] = it->second;
    else
      toResolve.push_back(i);
  }
  for (size_t b = 0; b < toResolve.size(); b += kLookupBatch) {
    size_t e = std::min(toResolve.size(), b + kLookupBatch);
    std::vector<std::shared_ptr<Pending>> pending;
    for (size_t k = b; k < e; ++k) pending.push_back(startLookup(normalized(hostsIn[toResolve[k]])));
    auto deadline = std::chrono::steady_clock::now() + kLookupLimit;
    for (size_t k = b; k < e; ++k) {
      auto& p = pending[k - b];
      std::unique_lock<std::mutex> lock(p->mu);
      if (p->cv.wait_until(lock, deadline, [&] { return p->done; })) addrs[toResolve[k]] = p->addrs;
      std::lock_guard<std::mutex> cacheLock(cacheMu);
      lookupCache()[normalized(hostsIn[toResolve[k]])] = addrs[toResolve[k]];
    }
  }
  std::vector<Address> mine;
  bool fetched = false;
  for (size_t i = 0; i < hostsIn.size(); ++i) {
    if (out[i] || addrs[i].empty()) continue;
    if (!fetched) {
      mine = interfaceAddresses();
      fetched = true;
    }
    out[i] = addressesAreLocal(addrs[i], mine);
  }
  return out;
}

}  // namespace

namespace detail {
void setNameLookups(bool enabled) { nameLookups = enabled; }

void markLocal(std::vector<NodeSpec>& nodes) {
  std::vector<std::string> hosts;
  for (const auto& n : nodes) hosts.push_back(n.host);
  auto flags = localFlags(hosts);
  // An entry that names a user or an ssh port asks for ssh, even to this machine (another
  // account, an sshd in a container): run as a child, it would silently be this user.
  for (size_t i = 0; i < nodes.size(); ++i) nodes[i].local = flags[i] && nodes[i].user.empty() && nodes[i].port == 0;
}
}  // namespace detail

bool isLocalHost(const std::string& host) { return localFlags({host})[0]; }

}  // namespace dtrain::spec
