#include "store_cmd.h"

#include <arpa/inet.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"

namespace dtrain::app {
namespace {

struct StoreArgs {
  CLI::App* store = nullptr;
  CLI::App *serve = nullptr, *set = nullptr, *get = nullptr, *add = nullptr, *wait = nullptr, *check = nullptr,
           *del = nullptr;
  // Numbers are taken as text and parsed here (parseInteger, parseSeconds): CLI11's own
  // conversion clamps out-of-range values and reads "010" as octal.
  // serve
  std::string port = "29400";
  std::string bind = "127.0.0.1";
  // client
  std::string endpoint;
  std::string token_file;
  std::string timeout_s = "30";
  std::string connect_timeout_s = "10";
  std::string key;                // single-key verbs
  std::vector<std::string> keys;  // wait, check
  std::string value;
  std::string delta = "1";
};

// Longest --timeout / --connect-timeout: a year. Bounded so that seconds * 1000 fits the
// millisecond durations and the deadlines computed from them.
constexpr double kMaxTimeoutS = 365 * 86400.0;

StoreArgs gArgs;

std::string token(bool serving) {
  auto& a = gArgs;
  if (!a.token_file.empty()) {
    try {
      // Created only when nothing is there; anything else (a directory, a dangling link, a
      // path we may not search) goes to readTokenFile or the O_EXCL create, which name it.
      if (serving && ::access(a.token_file.c_str(), F_OK) != 0 && errno == ENOENT)
        return store::createTokenFile(a.token_file);
      return store::readTokenFile(a.token_file);
    } catch (const SpecError& e) {
      throw SpecError(fmt::format("--token-file {}", e.what()));
    }
  }
  if (const char* t = std::getenv("DTRAIN_STORE_TOKEN"); t && *t) {
    store::checkTokenStrength(t, "DTRAIN_STORE_TOKEN", "set a new one: export DTRAIN_STORE_TOKEN=$(openssl rand -hex 32)");
    return t;
  }
  throw SpecError("no store token: set DTRAIN_STORE_TOKEN or pass --token-file FILE");
}

// A port from 1 to 65535, or 0 when `text` is not one.
int parsePort(const std::string& text) {
  try {
    return static_cast<int>(parseInteger(text, "port", 1, 65535));
  } catch (const SpecError&) {
    return 0;
  }
}

// "[v6]" -> "v6": brackets only set an IPv6 literal apart from the port.
std::string unbracket(std::string host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

store::TcpStoreOptions clientOptions() {
  auto& a = gArgs;
  store::TcpStoreOptions o;
  if (a.endpoint.empty()) {
    // Inside dtrain run: the job's store. Errors name the variable the bad part came from,
    // since the user passed no --endpoint.
    const char* addr = std::getenv("DTRAIN_STORE_ADDR");
    const char* port = std::getenv("DTRAIN_STORE_PORT");
    if (!addr && !port) throw SpecError("no store endpoint: pass --endpoint HOST:PORT (or run inside dtrain run, which sets DTRAIN_STORE_ADDR/PORT)");
    o.port = port ? parsePort(port) : 0;
    if (port && o.port == 0)
      throw SpecError(fmt::format("DTRAIN_STORE_PORT: expected a port from 1 to 65535, got \"{}\"; fix it, or pass "
                                  "--endpoint HOST:PORT", port));
    if (!addr || !*addr)
      throw SpecError(fmt::format("DTRAIN_STORE_ADDR: {}; set it to the store's host, or pass --endpoint HOST:PORT",
                                  addr ? "empty" : "not set, though DTRAIN_STORE_PORT is"));
    if (!port)
      throw SpecError("DTRAIN_STORE_PORT: not set, though DTRAIN_STORE_ADDR is; set it to the store's port, or pass "
                      "--endpoint HOST:PORT");
    o.host = unbracket(addr);
  } else {
    const std::string& ep = a.endpoint;
    auto colon = ep.rfind(':');
    o.port = colon == std::string::npos ? 0 : parsePort(ep.substr(colon + 1));
    std::string host = colon == std::string::npos ? std::string() : ep.substr(0, colon);
    // A colon left in the host is a second port (127.0.0.1:1:2) or an IPv6 literal without
    // brackets, whose last group would be taken for the port: both are refused, not guessed.
    bool bracketed = host.size() > 2 && host.front() == '[' && host.back() == ']';
    if (o.port == 0 || host.empty() || (!bracketed && host.find_first_of(":[]") != std::string::npos))
      throw SpecError(fmt::format("--endpoint: expected HOST:PORT with a port from 1 to 65535 (an IPv6 address in "
                                  "brackets: [::1]:PORT), got \"{}\"", ep));
    o.host = unbracket(host);
  }
  o.token = token(false);
  o.timeout = store::Duration(static_cast<long long>(parseSeconds(a.timeout_s, "--timeout", kMaxTimeoutS) * 1000));
  o.connect_timeout = store::Duration(
      static_cast<long long>(parseSeconds(a.connect_timeout_s, "--connect-timeout", kMaxTimeoutS) * 1000));
  return o;
}

int serve() {
  auto& a = gArgs;
  store::TcpStoreServerOptions o;
  // (a name, "localhost" too, is not resolved: which of its addresses would be meant is not
  // clear, and the server binds one address)
  in6_addr ip{};
  if (::inet_pton(AF_INET, a.bind.c_str(), &ip) != 1 && ::inet_pton(AF_INET6, a.bind.c_str(), &ip) != 1)
    throw SpecError(fmt::format(
        "--bind: {} is not an IP address; give one: 127.0.0.1 (this host only), 0.0.0.0 "
        "(every interface, for remote nodes) or one of this host's addresses",
        a.bind.empty() ? std::string("the value is empty (an unset variable?), which") : "\"" + a.bind + "\""));
  o.bind = a.bind;
  o.port = static_cast<int>(parseInteger(a.port, "--port", 0, 65535));
  o.token = token(true);
  // Signals are taken synchronously below; block them before the server thread starts so
  // that it inherits the mask.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  store::TcpStoreServer server(o);
  server.start();
  std::cout << fmt::format("dtrain store: serving on {}:{}",
                           a.bind.find(':') == std::string::npos ? a.bind : "[" + a.bind + "]", server.port())
            << std::endl;
  int sig = 0;
  sigwait(&set, &sig);
  server.stop();
  return 0;
}

}  // namespace

void addStoreCommands(CLI::App& app) {
  auto& a = gArgs;
  a.store = app.add_subcommand("store", "Rendezvous store: serve one, or talk to one from scripts");
  a.store->require_subcommand(1);
  a.serve = a.store->add_subcommand("serve", "Serve a store until SIGINT/SIGTERM (then exit 0); prints 'serving on ADDR:PORT'");
  a.serve->add_option("--port", a.port, "TCP port; 0 picks a free one (default 29400)");
  a.serve->add_option("--bind", a.bind, "Address to bind (default 127.0.0.1; 0.0.0.0 for remote nodes)");
  a.serve->add_option("--token-file", a.token_file, "Token file (mode 0600); created with a new token if absent");
  auto client = [&](CLI::App* c) {
    c->add_option("--endpoint", a.endpoint, "HOST:PORT (default: DTRAIN_STORE_ADDR:DTRAIN_STORE_PORT)");
    c->add_option("--token-file", a.token_file, "Token file (default: DTRAIN_STORE_TOKEN)");
    // (accepted by every verb, so that a script can give all of them the same flags)
    const bool waits = c == a.get || c == a.wait;
    c->add_option("--timeout", a.timeout_s,
                  waits ? "Seconds to wait for keys (default 30; at most a year, 31536000)"
                        : "Not used by this verb, which waits for no key (get and wait do)");
    c->add_option("--connect-timeout", a.connect_timeout_s,
                  "Seconds to keep retrying the connection (default 10; 0 tries once; at most 31536000)");
  };
  a.set = a.store->add_subcommand("set", "Set KEY to VALUE");
  a.set->add_option("key", a.key, "Key")->required();
  a.set->add_option("value", a.value, "Value")->required();
  a.get = a.store->add_subcommand("get", "Print KEY's value, waiting for it up to --timeout");
  a.get->add_option("key", a.key, "Key")->required();
  a.add = a.store->add_subcommand("add", "Add DELTA (default 1) to the counter at KEY; prints the new value");
  a.add->add_option("key", a.key, "Key")->required();
  a.add->add_option("delta", a.delta, "Delta: an integer; the sum must fit in int64");
  a.wait = a.store->add_subcommand("wait", "Wait until every KEY exists (exit 3 on timeout)");
  a.wait->add_option("keys", a.keys, "Keys")->required();
  a.check = a.store->add_subcommand("check", "Exit 0 when every KEY exists, 1 otherwise");
  a.check->add_option("keys", a.keys, "Keys")->required();
  a.del = a.store->add_subcommand("delete", "Delete KEY; exit 1 when it was absent");
  a.del->add_option("key", a.key, "Key")->required();
  for (auto* c : {a.set, a.get, a.add, a.wait, a.check, a.del}) client(c);
}

std::string storeParseHint(const std::vector<std::string>& args) {
  auto word = [](const std::string& w) { return w.empty() || w[0] != '-'; };
  auto store = std::find_if(args.begin(), args.end(), word);
  if (store == args.end() || *store != "store") return "";
  auto verb = std::find_if(store + 1, args.end(), word);
  std::string example = verb == args.end() ? "set" : *verb;
  for (auto it = store; it != args.end() && *it != "--"; ++it) {
    const std::string& w = *it;
    // Negative numbers (add k -2) already parse as positionals; an unknown --word is more
    // likely a mistyped option than a key.
    if (w.size() < 2 || w[0] != '-' || w[1] == '-' || (w[1] >= '0' && w[1] <= '9')) continue;
    std::string name = w.substr(0, w.find('='));
    bool known = false;
    for (auto* c : gArgs.store->get_subcommands({}))
      known = known || c->get_option_no_throw(name) != nullptr;
    if (!known && name != "-h" && name != "--help")
      return fmt::format("; a key or value that starts with '-' goes after the options and --, as in: dtrain store "
                         "{} [options] -- {}", example, w);
  }
  return "";
}

int runStoreCommand() {
  auto& a = gArgs;
  if (!a.store || !a.store->parsed()) return -1;
  // serve is not a client verb: its errors take main's codes (2 bad flags or token file,
  // 1 cannot listen), not "store unreachable".
  if (a.serve->parsed()) return serve();
  // Arguments are checked before connecting, so that bad input is exit 2 even when the
  // store is down.
  int64_t delta = a.add->parsed() ? parseInteger(a.delta, "delta") : 0;
  try {
    store::TcpStore s(clientOptions());
    std::string unprinted = "the value was not printed";
    if (a.set->parsed()) {
      s.set(a.key, a.value);
    } else if (a.get->parsed()) {
      std::string v = s.get(a.key);
      std::cout << v;
      if (v.empty() || v.back() != '\n') std::cout << '\n';
    } else if (a.add->parsed()) {
      const int64_t now = s.add(a.key, delta);
      std::cout << now << '\n';
      // (a script that retries on exit 1 would add twice: the add is said as done)
      unprinted = fmt::format("the add was done, the key is now {}, but that was not printed", now);
    } else if (a.wait->parsed()) {
      s.wait(a.keys);
    } else if (a.check->parsed()) {
      return s.check(a.keys) ? 0 : 1;
    } else if (a.del->parsed()) {
      return s.deleteKey(a.key) ? 0 : 1;
    }
    // (a reader that went away, `dtrain store get K | true`: the value was not delivered)
    if (!(std::cout << std::flush)) {
      std::cerr << fmt::format("dtrain: error: cannot write to stdout: {} ({})\n", std::strerror(errno), unprinted);
      return 1;
    }
    return 0;
  } catch (const TimeoutError& e) {
    std::cerr << "dtrain: error: " << oneLine(e.what()) << "\n";
    return 3;
  } catch (const store::AuthError& e) {
    std::cerr << "dtrain: error: " << oneLine(e.what()) << "\n";
    return 5;
  } catch (const IoError& e) {
    std::cerr << "dtrain: error: " << oneLine(e.what()) << "\n";
    return 4;
  } catch (const store::RequestRefusedError& e) {
    // Refused as given (add on a value that is not a number, a sum beyond int64, a key over
    // the limits): retrying cannot help, so it is bad input.
    std::cerr << "dtrain: error: " << oneLine(e.what()) << "\n";
    return kExitUsage;
  } catch (const store::StoreError& e) {
    // Other server errors: QUOTA, also a store too busy to take the connection
    // (StoreBusyError), which is not a token problem (5).
    std::cerr << "dtrain: error: " << oneLine(e.what()) << "\n";
    return kExitFailure;
  }
}

}  // namespace dtrain::app
