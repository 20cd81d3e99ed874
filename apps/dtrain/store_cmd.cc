#include "store_cmd.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/store/tcp_store.h"
#include "dtrain/store/token.h"

namespace dtrain::app {
namespace {

struct StoreArgs {
  CLI::App* store = nullptr;
  CLI::App *serve = nullptr, *set = nullptr, *get = nullptr, *add = nullptr, *wait = nullptr, *check = nullptr,
           *del = nullptr;
  // serve
  int port = 29400;
  std::string bind = "127.0.0.1";
  // client
  std::string endpoint;
  std::string token_file;
  double timeout_s = 30;
  double connect_timeout_s = 10;
  std::string key;                // single-key verbs
  std::vector<std::string> keys;  // wait, check
  std::string value;
  long long delta = 1;
};

StoreArgs gArgs;

std::string token(bool serving) {
  auto& a = gArgs;
  if (!a.token_file.empty()) {
    if (serving && ::access(a.token_file.c_str(), F_OK) != 0) return store::createTokenFile(a.token_file);
    return store::readTokenFile(a.token_file);
  }
  if (const char* t = std::getenv("DTRAIN_STORE_TOKEN"); t && *t) return t;
  throw SpecError("no store token: set DTRAIN_STORE_TOKEN or pass --token-file FILE");
}

store::TcpStoreOptions clientOptions() {
  auto& a = gArgs;
  store::TcpStoreOptions o;
  std::string ep = a.endpoint;
  if (ep.empty()) {
    const char* addr = std::getenv("DTRAIN_STORE_ADDR");
    const char* port = std::getenv("DTRAIN_STORE_PORT");
    if (!addr || !port) throw SpecError("no store endpoint: pass --endpoint HOST:PORT (or run inside dtrain run, which sets DTRAIN_STORE_ADDR/PORT)");
    ep = fmt::format("{}:{}", addr, port);
  }
  auto colon = ep.rfind(':');
  int port = 0;
  try {
    port = colon == std::string::npos ? 0 : std::stoi(ep.substr(colon + 1));
  } catch (...) {
    port = 0;
  }
  if (colon == std::string::npos || colon == 0 || port < 1 || port > 65535)
    throw SpecError(fmt::format("--endpoint: expected HOST:PORT, got \"{}\"", ep));
  o.host = ep.substr(0, colon);
  if (o.host.size() > 2 && o.host.front() == '[' && o.host.back() == ']') o.host = o.host.substr(1, o.host.size() - 2);
  o.port = port;
  o.token = token(false);
  if (!(a.timeout_s >= 0)) throw SpecError("--timeout: expected seconds >= 0");
  o.timeout = store::Duration(static_cast<long long>(a.timeout_s * 1000));
  o.connect_timeout = store::Duration(static_cast<long long>(a.connect_timeout_s * 1000));
  return o;
}

int serve() {
  auto& a = gArgs;
  if (a.port < 0 || a.port > 65535) throw SpecError(fmt::format("--port: expected 0..65535, got {}", a.port));
  store::TcpStoreServerOptions o;
  o.bind = a.bind;
  o.port = a.port;
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
  std::cout << fmt::format("dtrain store: serving on {}:{}", a.bind, server.port()) << std::endl;
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
  a.serve = a.store->add_subcommand("serve", "Serve a store until SIGINT/SIGTERM; prints 'serving on ADDR:PORT'");
  a.serve->add_option("--port", a.port, "TCP port; 0 picks a free one (default 29400)");
  a.serve->add_option("--bind", a.bind, "Address to bind (default 127.0.0.1; 0.0.0.0 for remote nodes)");
  a.serve->add_option("--token-file", a.token_file, "Token file (mode 0600); created with a new token if absent");
  auto client = [&](CLI::App* c) {
    c->add_option("--endpoint", a.endpoint, "HOST:PORT (default: DTRAIN_STORE_ADDR:DTRAIN_STORE_PORT)");
    c->add_option("--token-file", a.token_file, "Token file (default: DTRAIN_STORE_TOKEN)");
    c->add_option("--timeout", a.timeout_s, "Seconds to wait for keys (default 30)");
    c->add_option("--connect-timeout", a.connect_timeout_s, "Seconds to keep retrying the connection (default 10)");
  };
  a.set = a.store->add_subcommand("set", "Set KEY to VALUE");
  a.set->add_option("key", a.key, "Key")->required();
  a.set->add_option("value", a.value, "Value")->required();
  a.get = a.store->add_subcommand("get", "Print KEY's value, waiting for it up to --timeout");
  a.get->add_option("key", a.key, "Key")->required();
  a.add = a.store->add_subcommand("add", "Add DELTA (default 1) to the counter at KEY; prints the new value");
  a.add->add_option("key", a.key, "Key")->required();
  a.add->add_option("delta", a.delta, "Delta");
  a.wait = a.store->add_subcommand("wait", "Wait until every KEY exists (exit 3 on timeout)");
  a.wait->add_option("keys", a.keys, "Keys")->required();
  a.check = a.store->add_subcommand("check", "Exit 0 when every KEY exists, 1 otherwise");
  a.check->add_option("keys", a.keys, "Keys")->required();
  a.del = a.store->add_subcommand("delete", "Delete KEY; exit 1 when it was absent");
  a.del->add_option("key", a.key, "Key")->required();
  for (auto* c : {a.set, a.get, a.add, a.wait, a.check, a.del}) client(c);
}

int runStoreCommand() {
  auto& a = gArgs;
  if (!a.store || !a.store->parsed()) return -1;
  try {
    if (a.serve->parsed()) return serve();
    store::TcpStore s(clientOptions());
    if (a.set->parsed()) {
      s.set(a.key, a.value);
    } else if (a.get->parsed()) {
      std::string v = s.get(a.key);
      std::cout << v;
      if (v.empty() || v.back() != '\n') std::cout << '\n';
    } else if (a.add->parsed()) {
      std::cout << s.add(a.key, a.delta) << '\n';
    } else if (a.wait->parsed()) {
      s.wait(a.keys);
    } else if (a.check->parsed()) {
      return s.check(a.keys) ? 0 : 1;
    } else if (a.del->parsed()) {
      return s.deleteKey(a.key) ? 0 : 1;
    }
    return 0;
  } catch (const TimeoutError& e) {
    std::cerr << "dtrain: error: " << e.what() << "\n";
    return 3;
  } catch (const store::AuthError& e) {
    std::cerr << "dtrain: error: " << e.what() << "\n";
    return 5;
  } catch (const IoError& e) {
    std::cerr << "dtrain: error: " << e.what() << "\n";
    return 4;
  } catch (const store::StoreError& e) {
    std::cerr << "dtrain: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace dtrain::app
