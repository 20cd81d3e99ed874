// Multi-node spec input: hostfiles, --hosts, isLocalHost, env files, "nodes"/"ssh" keys,
// overrides and the per-node serialization.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <fstream>
#include <chrono>
#include <string>
#include <vector>

#include "dtrain/common/errors.h"
#include "dtrain/spec/job_spec.h"

namespace dtrain::spec {
namespace {

template <typename F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const SpecError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string hostfileError(const std::string& text) {
  return errorOf([&] { parseHostfile(text, "hosts"); });
}
std::string specError(const std::string& text) {
  return errorOf([&] { parseJobSpec(text, "job.json"); });
}

// A temporary file removed at the end of the test.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char tmpl[] = "/tmp/dtrain-spec-test.XXXXXX";
    int fd = ::mkstemp(tmpl);
    path_ = tmpl;
    std::ofstream(path_) << text;
    ::close(fd);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string selfName() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// ---------------------------------------------------------------------------------------
// Hostfile formats

TEST(Hostfile, OpenMpiDeepSpeedFormat) {
  auto nodes = parseHostfile("node1 slots=4\nnode2 slots=8\n", "hosts");
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].host, "node1");
  EXPECT_EQ(nodes[0].slots, 4);
  EXPECT_EQ(nodes[0].origin, "hosts:1");
  EXPECT_EQ(nodes[1].host, "node2");
  EXPECT_EQ(nodes[1].slots, 8);
  EXPECT_EQ(nodes[1].origin, "hosts:2");
  EXPECT_FALSE(nodes[0].local);
}

TEST(Hostfile, HorovodFormatAndUsers) {
  auto nodes = parseHostfile("node1:2\nalice@node2:3\nbob@node3 slots=1\nnode4\n", "hosts");
  ASSERT_EQ(nodes.size(), 4u);
  EXPECT_EQ(nodes[0].host, "node1");
  EXPECT_EQ(nodes[0].slots, 2);
  EXPECT_EQ(nodes[0].user, "");
  EXPECT_EQ(nodes[1].host, "node2");
  EXPECT_EQ(nodes[1].user, "alice");
  EXPECT_EQ(nodes[1].slots, 3);
  EXPECT_EQ(nodes[2].user, "bob");
  EXPECT_EQ(nodes[2].slots, 1);
  EXPECT_EQ(nodes[3].slots, 0);  // nproc_per_node
}

TEST(Hostfile, CommentsBlankLinesTabsAndFields) {
  auto nodes = parseHostfile(
      "# cluster A\n\n   \n\tnode1\tslots=2   gpus=0,1 # the first\nnode2 port=2222 address=10.0.0.2 gpus=3\n# end\n",
      "hosts");
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].gpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(nodes[0].origin, "hosts:4");
  EXPECT_EQ(nodes[1].port, 2222);
  EXPECT_EQ(nodes[1].address, "10.0.0.2");
  EXPECT_EQ(nodes[1].gpus, (std::vector<int>{3}));
  EXPECT_EQ(nodes[1].origin, "hosts:5");
}

TEST(Hostfile, WindowsLineEndingsAndByteOrderMark) {
  auto nodes = parseHostfile("\xEF\xBB\xBFnode1 slots=2\r\nnode2:3\r\n\r\n", "hosts");
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].host, "node1");
  EXPECT_EQ(nodes[0].slots, 2);
  EXPECT_EQ(nodes[1].slots, 3);
  EXPECT_EQ(parseEnvFile("\xEF\xBB\xBF" "A=1\r\n", "vars.env").at("A"), "1");
}

TEST(Hostfile, Ipv6Addresses) {
  auto nodes = parseHostfile("[fd00::2]:4\nfd00::3 slots=2\n", "hosts");
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].host, "fd00::2");
  EXPECT_EQ(nodes[0].slots, 4);
  EXPECT_EQ(nodes[1].host, "fd00::3");
  EXPECT_EQ(nodes[1].slots, 2);
}

TEST(Hostfile, SameHostOnOtherPortsIsNotADuplicate) {
  auto nodes = parseHostfile("h port=2201\nh port=2202\n", "hosts");
  EXPECT_EQ(nodes.size(), 2u);
}

TEST(Hostfile, LocalEntriesAreMarked) {
  auto nodes = parseHostfile("localhost:2\n127.0.0.2:1\nremote-alias-h1:1\n", "hosts");
  EXPECT_TRUE(nodes[0].local);
  EXPECT_TRUE(nodes[1].local);
  EXPECT_FALSE(nodes[2].local);
}

// A user or an ssh port on a local name asks for ssh (another account, an sshd in a
// container); run as a child it would silently be this user.
TEST(Hostfile, LocalNamesWithAUserOrPortGoThroughSsh) {
  auto nodes = parseHostfile("nobody@localhost:1\n127.0.0.1 port=2222\n127.0.0.2:1\n", "hosts");
  EXPECT_FALSE(nodes[0].local);
  EXPECT_FALSE(nodes[1].local);
  EXPECT_TRUE(nodes[2].local);
  EXPECT_FALSE(parseHostList("nobody@localhost:1")[0].local);
}

TEST(Hostfile, SpacesAroundEqualsAreNamed) {
  for (const char* line : {"h1 slots = 2\n", "h1 slots= 2\n", "h1 slots =2\n"})
    EXPECT_EQ(hostfileError(line), "hosts:1: spaces around '=' split the field \"slots\"; write it without them, e.g. slots=2")
        << line;
}

TEST(Hostfile, BadSlotCounts) {
  EXPECT_EQ(hostfileError("h1 slots=0\n"),
            "hosts:1: bad slot count \"0\" for host \"h1\"; give slots=N (or host:N) with N between 1 and 4096");
  EXPECT_EQ(hostfileError("ok\nh1 slots=x\n"),
            "hosts:2: bad slot count \"x\" for host \"h1\"; give slots=N (or host:N) with N between 1 and 4096");
  EXPECT_EQ(hostfileError("h1:-1\n"),
            "hosts:1: bad slot count \"-1\" for host \"h1\"; give slots=N (or host:N) with N between 1 and 4096");
  EXPECT_EQ(hostfileError("h1:\n"),
            "hosts:1: bad slot count \"\" for host \"h1\"; give slots=N (or host:N) with N between 1 and 4096");
  EXPECT_NE(hostfileError("h1 slots=4097\n").find("bad slot count \"4097\""), std::string::npos);
  EXPECT_NE(hostfileError("h1 slots=\n").find("bad slot count \"\""), std::string::npos);
  EXPECT_EQ(hostfileError("h1:2 slots=2\n"), "hosts:1: slots is given twice for host \"h1\"; keep one");
}

// Found by a fuzzer (helper-69): files with CR-only line ends were one line, a '#' in it
// dropping every host after it without a word; names that are neither host names nor IPv6
// addresses reached ssh.
TEST(Hostfile, CrOnlyLineEndsAndNamesNoResolverHas) {
  EXPECT_EQ(hostfileError("gpu-a slots=2\r# spare\rgpu-b slots=2\r"),
            "hosts:1: the lines end with a carriage return alone (CR, not LF or CRLF): convert the file (tr '\\r' '\\n')");
  EXPECT_EQ(parseHostfile("gpu-a slots=2\r\ngpu-b\r\n", "hosts").size(), 2u);  // CRLF is fine
  EXPECT_NE(errorOf([] { parseEnvFile("A=1\r# c\rB=2\r", "vars.env"); }).find("vars.env:1: the lines end with a carriage return alone"),
            std::string::npos);
  for (const char* bad : {"gpu-a:8:", "gpu-a:2:4", "gpu-a::8", "h%1", "%", "fe80::1%"})
    EXPECT_NE(hostfileError(std::string(bad) + "\n").find("is neither a host name nor an IPv6 address"), std::string::npos)
        << bad;
  for (const char* bad : {"1.2", ".", "1.2.3.4.5", "300.1.1.1"})
    EXPECT_NE(hostfileError(std::string(bad) + "\n").find("is not an IPv4 address"), std::string::npos) << bad;
  EXPECT_NE(hostfileError("a..b\n").find("has an empty part between dots"), std::string::npos);
  EXPECT_NE(hostfileError("::\n").find("the unspecified address"), std::string::npos);
  EXPECT_NE(hostfileError("[gpu-a]:2\n").find("brackets are for IPv6 addresses"), std::string::npos);
  for (const char* good : {"fe80::1%eth0", "::1", "[::1]:2", "10.0.0.1", "h.example.com.", "node_1", "user@gpu-a:2"})
    EXPECT_NO_THROW(parseHostfile(std::string(good) + "\n", "hosts")) << good;
  EXPECT_NE(errorOf([] { parseHostList("gpu-a::8"); }).find("neither a host name nor an IPv6 address"), std::string::npos);
  EXPECT_NE(specError(R"({"command": ["true"], "nodes": [{"host": "gpu-a:2:4"}]})").find("/nodes/0/host"), std::string::npos);
  EXPECT_NE(specError(R"({"command": ["true"], "nodes": [{"host": "localhost", "gpus": []}]})")
                .find("job.json: /nodes/0/gpus: is empty; list the GPUs"),
            std::string::npos);
}

TEST(Hostfile, Duplicates) {
  EXPECT_EQ(hostfileError("# c\nh1 slots=2\nh2\n\nh1 slots=2\n"),
            "hosts:5: host \"h1\" is listed twice (first on line 2); remove one of the lines (slots=N runs more workers "
            "on one host)");
  // Host names are case-insensitive; the user does not make another host.
  EXPECT_NE(hostfileError("H1\nalice@h1\n").find("hosts:2: host \"h1\" is listed twice (first on line 1)"), std::string::npos);
  EXPECT_NE(hostfileError("h port=22\nh port=22\n").find("host \"h\" (port 22) is listed twice"), std::string::npos);
}

TEST(Hostfile, UnknownFields) {
  EXPECT_EQ(hostfileError("h1\nh2\nh3 foo=1\n"),
            "hosts:3: unknown field \"foo=1\"; known fields: slots=N, max_slots=N, gpus=..., port=N, address=...");
  EXPECT_EQ(hostfileError("h1 slot=4\n"),
            "hosts:1: unknown field \"slot=4\"; did you mean \"slots=4\"? known fields: slots=N, max_slots=N, gpus=..., port=N, address=...");
  EXPECT_EQ(hostfileError("h1 4\n"), "hosts:1: unknown field \"4\"; known fields: slots=N, max_slots=N, gpus=..., port=N, address=...");
}

// OpenMPI's max_slots=N: taken, as a cap dtrain never needs (it runs exactly slots).
TEST(Hostfile, MaxSlots) {
  auto nodes = parseHostfile("a slots=2 max_slots=4\nb max_slots=8\nc slots=3 max_slots=3\n", "hosts");
  ASSERT_EQ(nodes.size(), 3u);
  EXPECT_EQ(nodes[0].slots, 2);
  EXPECT_EQ(nodes[0].max_slots, 4);
  EXPECT_EQ(nodes[1].slots, 0);
  EXPECT_EQ(nodes[1].max_slots, 8);
  EXPECT_EQ(nodes[2].max_slots, 3);
  EXPECT_EQ(hostfileError("a slots=4 max_slots=2\n"),
            "hosts:1: slots=4 is more than max_slots=2 for host \"a\"; dtrain runs exactly slots workers and never "
            "oversubscribes: give max_slots >= slots, or leave max_slots out");
  EXPECT_EQ(hostfileError("a:4 max_slots=2\n").rfind("hosts:1: slots=4 is more than max_slots=2", 0), 0u);
  EXPECT_EQ(hostfileError("a max_slots=x\n"),
            "hosts:1: bad max_slots \"x\" for host \"a\"; give max_slots=N with N between 1 and 4096");
  EXPECT_NE(hostfileError("a max_slots=0\n").find("bad max_slots \"0\""), std::string::npos);
  EXPECT_NE(hostfileError("a max_slots=1 max_slots=2\n").find("max_slots is given twice"), std::string::npos);
  // Without slots, the count it caps is decided in resolve: nproc_per_node, or one per GPU.
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 8})", "job.json");
  s.nodes = parseHostfile("a max_slots=4\n", "hosts");
  EXPECT_EQ(errorOf([&] { resolve(s); }),
            "hosts:1: host \"a\" would run 8 workers (nproc_per_node 8) but its max_slots is 4, and dtrain never runs "
            "more; give it slots=N with N <= 4, or lower nproc_per_node");
  s.nodes = parseHostfile("a max_slots=4 gpus=0,1,2,3,4\n", "hosts");
  EXPECT_EQ(errorOf([&] { resolve(s); }).rfind("hosts:1: host \"a\" would run 5 workers (one per GPU listed)", 0), 0u);
  s.nodes = parseHostfile("a max_slots=8\n", "hosts");
  resolve(s);
  EXPECT_EQ(s.nodes[0].slots, 8);
}

// A number is no host name: DeepSpeed's --include host:1,2 given as a host list or line.
TEST(Hostfile, NumericHostNamesAreRefused) {
  EXPECT_EQ(hostfileError("localhost\n2 slots=1\n"),
            "hosts:2: \"2\" is not a host name; DeepSpeed's --include host:1,2 (GPUs 1 and 2) is gpus=1,2 on that "
            "host's hostfile line (\"host gpus=1,2\"), and host:N means N workers");
  EXPECT_EQ(hostfileError("localhost:1,3\n"),
            "hosts:1: bad slot count \"1,3\" for host \"localhost\"; give slots=N (or host:N) with N between 1 and 4096 "
            "(GPU indices go in gpus=: \"localhost gpus=1,3\" on a hostfile line)");
  EXPECT_EQ(errorOf([] { parseHostList("localhost:1,2"); }),
            "--hosts: \"2\" is not a host name; DeepSpeed's --include localhost:1,2 (GPUs 1,2) is the hostfile line "
            "\"localhost gpus=1,2\" (--hostfile FILE); in --hosts, host:N means N workers");
  EXPECT_NE(errorOf([] { parseHostList("a:0,1,3"); }).find("\"a gpus=0,1,3\""), std::string::npos);
  EXPECT_EQ(errorOf([] { parseHostList("7"); }).rfind("--hosts: \"7\" is not a host name", 0), 0u);
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "12"}]})"),
            "job.json: /nodes/0/host: \"12\" is not a host name (a number is read as an IPv4 address); give a host name "
            "or address");
  // Addresses with dots are addresses.
  EXPECT_EQ(parseHostList("10.0.0.2:2")[0].host, "10.0.0.2");
}

TEST(Hostfile, BadFieldValues) {
  EXPECT_EQ(hostfileError("h1 gpus=0,x\n"), "hosts:1: bad GPU index \"x\" in \"0,x\" for host \"h1\"; give GPU indices like gpus=0,1");
  EXPECT_EQ(hostfileError("h1 gpus=1,1\n"), "hosts:1: GPU 1 is listed twice in \"1,1\" for host \"h1\"; give GPU indices like gpus=0,1");
  EXPECT_EQ(hostfileError("h1 port=0\n"), "hosts:1: bad ssh port \"0\" for host \"h1\"; give port=N with N between 1 and 65535");
  EXPECT_EQ(hostfileError("h1 port=70000\n"),
            "hosts:1: bad ssh port \"70000\" for host \"h1\"; give port=N with N between 1 and 65535");
  EXPECT_NE(hostfileError("h1 address=\n").find("hosts:1: bad address for host \"h1\": empty address"), std::string::npos);
  EXPECT_NE(hostfileError("h1 gpus=1024\n").find("bad GPU index \"1024\""), std::string::npos);
  EXPECT_NE(hostfileError("h1 gpus=0 gpus=1\n").find("gpus is given twice"), std::string::npos);
}

TEST(Hostfile, BadHostsAndUsers) {
  EXPECT_EQ(hostfileError("-oProxyCommand=x\n"),
            "hosts:1: host name \"-oProxyCommand=x\" starts with '-' (ssh would read it as an option); give a host name or "
            "address (user@host for a login name)");
  EXPECT_NE(hostfileError("h$(x)\n").find("hosts:1: host name \"h$(x)\" contains '$'"), std::string::npos);
  EXPECT_NE(hostfileError("@h1\n").find("hosts:1: empty user name in \"@h1\""), std::string::npos);
  EXPECT_NE(hostfileError("alice@\n").find("hosts:1: empty host name"), std::string::npos);
  EXPECT_NE(hostfileError("[fd00::1\n").find("unclosed '['"), std::string::npos);
}

TEST(Hostfile, EmptyIsAnError) {
  EXPECT_EQ(hostfileError(""), "hosts: no hosts listed; add one line per host, e.g. \"node1 slots=8\"");
  EXPECT_EQ(hostfileError("# only comments\n\n"), "hosts: no hosts listed; add one line per host, e.g. \"node1 slots=8\"");
}

TEST(Hostfile, LoadNamesMissingFile) {
  EXPECT_EQ(errorOf([] { loadHostfile("/nonexistent/hosts"); }),
            "/nonexistent/hosts: cannot open hostfile: no such file; check the path (relative to the directory dtrain runs in)");
  EXPECT_EQ(errorOf([] { loadHostfile("/tmp"); }), "/tmp: is a directory; give a hostfile (one host per line)");
  TempFile f("a:1\nb:2\n");
  auto nodes = loadHostfile(f.path());
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[1].origin, f.path() + ":2");
  TempFile bad("a:1\na:1\n");
  EXPECT_EQ(errorOf([&] { loadHostfile(bad.path()); }).rfind(bad.path() + ":2: host \"a\" is listed twice", 0), 0u);
}

// ---------------------------------------------------------------------------------------
// --hosts

TEST(HostList, Parses) {
  auto nodes = parseHostList("h1:2,user@h2:3,h3");
  ASSERT_EQ(nodes.size(), 3u);
  EXPECT_EQ(nodes[0].host, "h1");
  EXPECT_EQ(nodes[0].slots, 2);
  EXPECT_EQ(nodes[1].user, "user");
  EXPECT_EQ(nodes[1].host, "h2");
  EXPECT_EQ(nodes[1].slots, 3);
  EXPECT_EQ(nodes[2].slots, 0);
  EXPECT_EQ(nodes[2].origin, "--hosts");
  EXPECT_TRUE(parseHostList("localhost:2")[0].local);
}

TEST(HostList, Errors) {
  EXPECT_EQ(errorOf([] { parseHostList(""); }), "--hosts: expected a comma-separated list like \"h1:2,user@h2:2,h3\", got \"\"");
  EXPECT_EQ(errorOf([] { parseHostList("h1,,h2"); }),
            "--hosts: empty entry 2 in \"h1,,h2\"; give hosts like \"h1:2,user@h2:2,h3\"");
  EXPECT_EQ(errorOf([] { parseHostList("h1:0"); }),
            "--hosts: bad slot count \"0\" for host \"h1\"; give host:N with N between 1 and 4096");
  EXPECT_EQ(errorOf([] { parseHostList("h1:2,h2,h1"); }),
            "--hosts: host \"h1\" is listed twice (entries 1 and 3); give it once, with host:N for more workers");
  EXPECT_EQ(errorOf([] { parseHostList("h1 slots=2"); }).rfind("--hosts: host name \"h1 slots=2\" contains ' '", 0), 0u);
}

// ---------------------------------------------------------------------------------------
// isLocalHost

TEST(IsLocalHost, LoopbackAndOwnNames) {
  EXPECT_TRUE(isLocalHost("localhost"));
  EXPECT_TRUE(isLocalHost("LOCALHOST"));
  EXPECT_TRUE(isLocalHost("127.0.0.1"));
  EXPECT_TRUE(isLocalHost("127.1.2.3"));
  EXPECT_TRUE(isLocalHost("::1"));
  EXPECT_TRUE(isLocalHost("[::1]"));
  std::string self = selfName();
  ASSERT_FALSE(self.empty());
  EXPECT_TRUE(isLocalHost(self));
  EXPECT_TRUE(isLocalHost(self.substr(0, self.find('.'))));
}

TEST(IsLocalHost, RemoteAndUnresolvable) {
  EXPECT_FALSE(isLocalHost(""));
  EXPECT_FALSE(isLocalHost("192.0.2.1"));    // TEST-NET-1, never assigned
  EXPECT_FALSE(isLocalHost("2001:db8::1"));  // documentation prefix
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(isLocalHost("h1"));  // an ssh_config alias: does not resolve, so not local
  EXPECT_FALSE(isLocalHost("dtrain-no-such-host.invalid"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));  // bounded, not a DNS timeout each
}

TEST(IsLocalHost, InterfaceAddresses) {
  ifaddrs* list = nullptr;
  ASSERT_EQ(::getifaddrs(&list), 0);
  int checked = 0;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    EXPECT_TRUE(isLocalHost(text)) << text << " on " << i->ifa_name;
    ++checked;
  }
  ::freeifaddrs(list);
  EXPECT_GE(checked, 1);  // lo at least
}

TEST(IsLocalHost, ManyUnresolvableNamesShareOneDeadline) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "alias-" + std::to_string(i) + ".dtrain-test.invalid:1\n";
  auto start = std::chrono::steady_clock::now();
  auto nodes = parseHostfile(text, "hosts");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  for (const auto& n : nodes) EXPECT_FALSE(n.local) << n.host;
}

// ---------------------------------------------------------------------------------------
// env files

TEST(EnvFile, Parses) {
  auto env = parseEnvFile(
      "# comment\n\nA=1\nexport B=two words\n  C=\"quoted # not a comment\"\nD='single'\nE=\nF=a=b\nG=$HOME\r\nH=\"\"\n",
      "vars.env");
  EXPECT_EQ(env.at("A"), "1");
  EXPECT_EQ(env.at("B"), "two words");
  EXPECT_EQ(env.at("C"), "quoted # not a comment");
  EXPECT_EQ(env.at("D"), "single");
  EXPECT_EQ(env.at("E"), "");
  EXPECT_EQ(env.at("F"), "a=b");
  EXPECT_EQ(env.at("G"), "$HOME");  // literal, no expansion
  EXPECT_EQ(env.at("H"), "");
  EXPECT_EQ(env.size(), 8u);
}

TEST(EnvFile, Errors) {
  auto err = [](const std::string& text) { return errorOf([&] { parseEnvFile(text, "vars.env"); }); };
  EXPECT_EQ(err("A=1\nnot a pair\n"),
            "vars.env:2: expected KEY=VALUE, got \"not a pair\"; write one KEY=VALUE per line ('#' starts a comment line)");
  EXPECT_EQ(err("A B=1\n"),
            "vars.env:1: bad variable name \"A B\"; names are letters, digits and '_', not starting with a digit (no spaces "
            "around '=')");
  EXPECT_NE(err("1A=1\n").find("vars.env:1: bad variable name \"1A\""), std::string::npos);
  EXPECT_NE(err("=1\n").find("vars.env:1: bad variable name \"\""), std::string::npos);
  EXPECT_EQ(err("A=1\nB=caf\xE9\n"), "vars.env:2: the line is not valid UTF-8; save the file as UTF-8");
  EXPECT_EQ(parseEnvFile("B=caf\xC3\xA9\n", "vars.env").at("B"), "caf\xC3\xA9");
  EXPECT_EQ(err("A=\"open\n"), "vars.env:1: unterminated quote in the value of A; values are one line: close the double quote");
  EXPECT_EQ(err("A=x\nB=1\nexport A=y\n"), "vars.env:3: A is set again (first on line 1); keep one of the two lines");
}

// RANK and the other identity variables are dtrain's to set, per worker: a job setting one
// (spec env, env_file, --env) is refused, naming where. MASTER_ADDR/MASTER_PORT are allowed
// (the documented way to choose them) and said as a warning.
TEST(EnvFile, IdentityVariablesAreRefused) {
  auto err = [](const std::string& text) { return errorOf([&] { parseEnvFile(text, "vars.env"); }); };
  EXPECT_EQ(err("A=1\nRANK=0\n"),
            "vars.env:2: RANK is set by dtrain for every worker (each worker's global rank, from the job's layout), and a "
            "value here would replace it in all of them; remove it (the layout comes from nproc_per_node and the hosts' "
            "slots)");
  for (const char* v : {"LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK", "LOCAL_SIZE"})
    EXPECT_EQ(err(std::string("export ") + v + "=1\n").rfind(std::string("vars.env:1: ") + v + " is set by dtrain", 0), 0u) << v;
  EXPECT_EQ(specError(R"({"command": ["true"], "env": {"WORLD_SIZE": "4"}})").rfind(
                "job.json: /env/WORLD_SIZE: WORLD_SIZE is set by dtrain for every worker (the number of workers", 0),
            0u);
  TempFile f("X=1\nLOCAL_RANK=0\n");
  EXPECT_EQ(specError(R"({"command": ["true"], "env_file": ")" + f.path() + R"("})").rfind(f.path() + ":2: LOCAL_RANK is set", 0),
            0u);
  // ROLE_NAME is not an identity: the spec may name the role.
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"], "env": {"ROLE_NAME": "trainer"}})", "job.json").env.at("ROLE_NAME"), "trainer");

  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  Overrides o;
  o.env = {"RANK=0"};
  EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }).rfind("--env: RANK is set by dtrain for every worker", 0), 0u);
}

TEST(EnvFile, MasterAddrAndPortAreWarnings) {
  TempFile f("A=1\nMASTER_ADDR=10.0.0.9\n");
  JobSpec s = parseJobSpec(R"({"command": ["true"], "env": {"MASTER_PORT": "29501"}, "env_file": ")" + f.path() + R"("})",
                           "job.json");
  EXPECT_EQ(s.env.at("MASTER_PORT"), "29501");
  ASSERT_EQ(s.warnings.size(), 2u);
  EXPECT_EQ(s.warnings.at("MASTER_PORT").rfind("job.json: /env/MASTER_PORT: MASTER_PORT=29501 replaces the free port", 0), 0u);
  EXPECT_EQ(s.warnings.at("MASTER_ADDR").rfind(f.path() + ":2: MASTER_ADDR=10.0.0.9 replaces the address", 0), 0u);
  Overrides o;
  o.env = {"MASTER_PORT=30000"};
  applyOverrides(s, o);
  EXPECT_EQ(s.env.at("MASTER_PORT"), "30000");
  EXPECT_EQ(s.warnings.at("MASTER_PORT").rfind("--env: MASTER_PORT=30000 replaces", 0), 0u);  // the winner's line only
  EXPECT_TRUE(parseJobSpec(R"({"command": ["true"], "env": {"A": "1"}})", "job.json").warnings.empty());
}

// MASTER_PORT, wherever the job gives it, must be a port (1..65535, decimal): refused naming
// where, not passed to every worker to fail there.
TEST(EnvFile, MasterPortMustBeAPort) {
  for (const std::string bad : {"99999", "0", "notaport", "", " 80", "+80", "80.0", "123456"}) {
    const std::string said = "MASTER_PORT=\"" + bad + "\": expected a port, an integer between 1 and 65535";
    EXPECT_EQ(errorOf([&] { parseJobSpec(R"({"command": ["true"], "env": {"MASTER_PORT": ")" + bad + R"("}})", "job.json"); })
                  .rfind("job.json: /env/MASTER_PORT: " + said, 0),
              0u)
        << bad;
    JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
    Overrides o;
    o.env = {"MASTER_PORT=" + bad};
    EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }).rfind("--env: " + said, 0), 0u) << bad;
  }
  TempFile f("MASTER_PORT=65536\n");
  EXPECT_EQ(errorOf([&] { parseJobSpec(R"({"command": ["true"], "env_file": ")" + f.path() + R"("})", "job.json"); })
                .rfind(f.path() + ":1: MASTER_PORT=\"65536\": expected a port", 0),
            0u);
  // The spec's env wins over the file's: only the value used is checked.
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"], "env": {"MASTER_PORT": "1"}, "env_file": ")" + f.path() + R"("})",
                         "job.json")
                .env.at("MASTER_PORT"),
            "1");
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"], "env": {"MASTER_PORT": "65535"}})", "job.json").env.at("MASTER_PORT"),
            "65535");
}

// --env NAME (mpirun's -x NAME): the launcher's own value, refused when it has none.
TEST(SpecOverrides, EnvNameAloneTakesTheLaunchersValue) {
  ::setenv("DTRAIN_TEST_FROM_LAUNCHER", "a b=c", 1);
  ::unsetenv("DTRAIN_TEST_UNSET");
  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  Overrides o;
  o.env = {"DTRAIN_TEST_FROM_LAUNCHER"};
  applyOverrides(s, o);
  EXPECT_EQ(s.env.at("DTRAIN_TEST_FROM_LAUNCHER"), "a b=c");
  o.env = {"DTRAIN_TEST_UNSET"};
  EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }),
            "--env: DTRAIN_TEST_UNSET is not set in dtrain's environment, so there is no value to pass on; set it before "
            "dtrain run (export DTRAIN_TEST_UNSET=...), or give --env DTRAIN_TEST_UNSET=VALUE");
  o.env = {"1A"};
  EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }).rfind("--env: bad variable name \"1A\"", 0), 0u);
  o.env = {"=x"};
  EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }).rfind("--env: expected KEY=VALUE (or a NAME", 0), 0u);
  ::unsetenv("DTRAIN_TEST_FROM_LAUNCHER");
}

TEST(EnvFile, MergedUnderSpecEnv) {
  TempFile f("A=from-file\nB=from-file\n");
  JobSpec s = parseJobSpec(R"({"command": ["true"], "env": {"A": "from-spec"}, "env_file": ")" + f.path() + R"("})", "job.json");
  EXPECT_EQ(s.env.at("A"), "from-spec");
  EXPECT_EQ(s.env.at("B"), "from-file");
  EXPECT_EQ(s.env_file, f.path());
  EXPECT_EQ(specError(R"({"command": ["true"], "env_file": "/nonexistent/vars"})"),
            "job.json: /env_file: file \"/nonexistent/vars\" does not exist; the path is relative to the directory dtrain "
            "runs in");
  TempFile bad("A=1\nB\n");
  EXPECT_EQ(specError(R"({"command": ["true"], "env_file": ")" + bad.path() + R"("})"),
            bad.path() + ":2: expected KEY=VALUE, got \"B\"; write one KEY=VALUE per line ('#' starts a comment line)");
}

// ---------------------------------------------------------------------------------------
// Spec keys

TEST(SpecNodes, ParsesEveryField) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nodes": [
      {"host": "node1", "slots": 4, "user": "alice", "port": 2222, "address": "10.0.0.1", "gpus": [0, 1, 2, 3]},
      {"host": "bob@node2"},
      {"host": "localhost", "slots": 1}]})",
                           "job.json");
  ASSERT_EQ(s.nodes.size(), 3u);
  EXPECT_EQ(s.nodes[0].host, "node1");
  EXPECT_EQ(s.nodes[0].slots, 4);
  EXPECT_EQ(s.nodes[0].user, "alice");
  EXPECT_EQ(s.nodes[0].port, 2222);
  EXPECT_EQ(s.nodes[0].address, "10.0.0.1");
  EXPECT_EQ(s.nodes[0].gpus, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(s.nodes[0].origin, "job.json: /nodes/0");
  EXPECT_FALSE(s.nodes[0].local);
  EXPECT_EQ(s.nodes[1].host, "node2");
  EXPECT_EQ(s.nodes[1].user, "bob");
  EXPECT_EQ(s.nodes[1].slots, 0);
  EXPECT_TRUE(s.nodes[2].local);
  EXPECT_TRUE(s.hostfile.empty());
  EXPECT_EQ(s.env_forward, kDefaultEnvForward);
}

TEST(SpecNodes, Errors) {
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1", "slots": 0}]})"),
            "job.json: /nodes/0/slots: expected a worker count between 1 and 4096, got 0");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1", "slot": 2}]})"),
            "job.json: /nodes/0/slot: unknown key \"slot\"; did you mean \"slots\"?");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"slots": 2}]})"),
            "job.json: /nodes/0/host: missing; give the host name or address, e.g. \"host\": \"node1\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": ""}]})"),
            "job.json: /nodes/0/host: expected a non-empty string, got \"\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h 1"}]})"),
            "job.json: /nodes/0/host: host name \"h 1\" contains ' '; give a host name or address");
  EXPECT_EQ(specError("{\"command\": [\"true\"], \"nodes\": [{\"host\": \"h\\n1\"}]}"),
            "job.json: /nodes/0/host: host name \"h\\x0a1\" contains '\\x0a'; give a host name or address");  // one line
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1:4"}]})"),
            "job.json: /nodes/0/host: \"h1:4\" looks like host:slots; write \"host\": \"h1\", \"slots\": 4");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "a@h1", "user": "b"}]})"),
            "job.json: /nodes/0/user: \"b\" contradicts \"a@\" in host; give the user once");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1", "port": 0}]})"),
            "job.json: /nodes/0/port: expected an ssh port between 1 and 65535, got 0");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1", "gpus": [0, -1]}]})"),
            "job.json: /nodes/0/gpus/1: expected a GPU index between 0 and 1023, got -1");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1", "gpus": [0, 1, 0]}]})"),
            "job.json: /nodes/0/gpus/2: GPU 0 is listed twice (also /nodes/0/gpus/0); list each GPU once");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1"}, {"host": "h2"}, {"host": "H1"}]})"),
            "job.json: /nodes/2: host \"H1\" is listed twice (first at /nodes/0); merge the entries (\"slots\" runs more "
            "workers on one host)");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": []})"),
            "job.json: /nodes: is empty; list at least one host, or remove \"nodes\" to run on this machine only");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": ["h1"]})"),
            "job.json: /nodes/0: expected an object like {\"host\": \"node1\", \"slots\": 8}, got the string \"h1\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "nodes": [{"host": "h1"}], "hostfile": "hosts"})"),
            "job.json: /hostfile: \"nodes\" and \"hostfile\" both list the hosts; keep one of them");
}

TEST(SpecHostfile, ReadsRelativeToCwdAndNamesTheHostfileInErrors) {
  TempFile f("h1 slots=2\nlocalhost slots=1\n");
  JobSpec s = parseJobSpec(R"({"command": ["true"], "hostfile": ")" + f.path() + R"("})", "job.json");
  ASSERT_EQ(s.nodes.size(), 2u);
  EXPECT_EQ(s.hostfile, f.path());
  EXPECT_EQ(s.nodes[0].origin, f.path() + ":1");
  EXPECT_FALSE(s.nodes[0].local);
  EXPECT_TRUE(s.nodes[1].local);
  EXPECT_EQ(specError(R"({"command": ["true"], "hostfile": "/nonexistent/hosts"})"),
            "job.json: /hostfile: hostfile \"/nonexistent/hosts\" does not exist; the path is relative to the directory "
            "dtrain runs in");
  EXPECT_EQ(specError(R"({"command": ["true"], "hostfile": "/tmp"})"), "job.json: /hostfile: \"/tmp\" is a directory; give a hostfile");
  TempFile bad("h1\nh2 foo=1\n");
  EXPECT_EQ(specError(R"({"command": ["true"], "hostfile": ")" + bad.path() + R"("})"),
            bad.path() + ":2: unknown field \"foo=1\"; known fields: slots=N, max_slots=N, gpus=..., port=N, address=...");
}

TEST(SpecSsh, ParsesAndChecks) {
  TempFile key("not really a key");
  JobSpec s = parseJobSpec(R"({"command": ["true"], "ssh": {"user": "alice", "port": 2222, "identity_file": ")" + key.path() +
                               R"(", "connect_timeout_s": 2.5, "options": ["-F", "cfg"], "host_key_checking": "no",
                                "dtrain_path": "/opt/dtrain/bin/dtrain"}})",
                           "job.json");
  EXPECT_EQ(s.ssh.user, "alice");
  EXPECT_EQ(s.ssh.port, 2222);
  EXPECT_EQ(s.ssh.identity_file, key.path());
  EXPECT_DOUBLE_EQ(s.ssh.connect_timeout_s, 2.5);
  EXPECT_EQ(s.ssh.options, (std::vector<std::string>{"-F", "cfg"}));
  EXPECT_EQ(s.ssh.host_key_checking, "no");
  EXPECT_EQ(s.ssh.dtrain_path, "/opt/dtrain/bin/dtrain");

  JobSpec d = parseJobSpec(R"({"command": ["true"]})", "job.json");
  EXPECT_EQ(d.ssh.host_key_checking, "accept-new");
  EXPECT_DOUBLE_EQ(d.ssh.connect_timeout_s, 10);

  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"identity_file": "/nonexistent/id"}})"),
            "job.json: /ssh/identity_file: file \"/nonexistent/id\" does not exist; give the private key ssh should use (-i)");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"host_key_checking": "accept_new"}})"),
            "job.json: /ssh/host_key_checking: \"accept_new\" is not one of yes, no, accept-new; did you mean \"accept-new\"?");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"connect_timeout_s": 0}})"),
            "job.json: /ssh/connect_timeout_s: expected seconds between 0.1 and 3600, got 0");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"option": []}})"),
            "job.json: /ssh/option: unknown key \"option\"; did you mean \"options\"?");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"options": "-F cfg"}})"),
            "job.json: /ssh/options: expected an array of ssh arguments like [\"-F\", \"ssh_config\"], got the string \"-F cfg\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"dtrain_path": ""}})"),
            "job.json: /ssh/dtrain_path: expected a non-empty string, got \"\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "ssh": {"port": 65536}})"),
            "job.json: /ssh/port: expected an ssh port between 1 and 65535, got 65536");
}

TEST(SpecRendezvous, AddrAndMasterAddr) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "rendezvous": {"addr": "10.0.0.1", "master_addr": "node1-ib"}})", "job.json");
  EXPECT_EQ(s.rendezvous.addr, "10.0.0.1");
  EXPECT_EQ(s.rendezvous.master_addr, "node1-ib");
  EXPECT_EQ(specError(R"({"command": ["true"], "rendezvous": {"addr": ""}})"),
            "job.json: /rendezvous/addr: expected a non-empty string, got \"\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "rendezvous": {"master_addr": 5}})"),
            "job.json: /rendezvous/master_addr: expected a string, got 5");
  EXPECT_EQ(specError(R"({"command": ["true"], "rendezvous": {"master_adr": "x"}})"),
            "job.json: /rendezvous/master_adr: unknown key \"master_adr\"; did you mean \"master_addr\"?");
}

TEST(SpecEnvForward, DefaultAndExplicit) {
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"]})", "job.json").env_forward, kDefaultEnvForward);
  EXPECT_EQ(JobSpec{}.env_forward, kDefaultEnvForward);  // a command-line job (dtrain run --hosts ... -- CMD) too
  // --env-forward adds to the spec's list (or the default), once each.
  JobSpec s = parseJobSpec(R"({"command": ["true"], "env_forward": ["NCCL_"]})", "job.json");
  Overrides o;
  o.env_forward = {"MY_", "NCCL_", "MY_"};
  applyOverrides(s, o);
  EXPECT_EQ(s.env_forward, (std::vector<std::string>{"NCCL_", "MY_"}));
  o.env_forward = {"1X"};
  EXPECT_EQ(errorOf([&] { applyOverrides(s, o); }).rfind("--env-forward: bad variable-name prefix \"1X\"", 0), 0u);
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"], "env_forward": ["MY_", "NCCL_"]})", "job.json").env_forward,
            (std::vector<std::string>{"MY_", "NCCL_"}));
  EXPECT_TRUE(parseJobSpec(R"({"command": ["true"], "env_forward": []})", "job.json").env_forward.empty());
  EXPECT_EQ(specError(R"({"command": ["true"], "env_forward": "NCCL_"})"),
            "job.json: /env_forward: expected an array of variable-name prefixes like [\"NCCL_\"], got the string \"NCCL_\"");
  EXPECT_EQ(specError(R"({"command": ["true"], "env_forward": ["A", ""]})"),
            "job.json: /env_forward/1: expected a non-empty string, got \"\"");
}

// ---------------------------------------------------------------------------------------
// Overrides and resolve

TEST(SpecOverrides, HostfileAndHosts) {
  TempFile f("a slots=2\nb slots=2\n");
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nodes": [{"host": "x"}]})", "job.json");
  Overrides o;
  o.hostfile = f.path();
  applyOverrides(s, o);
  ASSERT_EQ(s.nodes.size(), 2u);
  EXPECT_EQ(s.nodes[0].host, "a");
  EXPECT_EQ(s.hostfile, f.path());

  Overrides h;
  h.hosts = "c:1,d:1,e:1";
  applyOverrides(s, h);
  EXPECT_EQ(s.nodes.size(), 3u);
  EXPECT_TRUE(s.hostfile.empty());

  Overrides both;
  both.hostfile = f.path();
  both.hosts = "c";
  EXPECT_EQ(errorOf([&] { applyOverrides(s, both); }), "--hostfile and --hosts both list the hosts; give one of them");
  Overrides missing;
  missing.hostfile = "/nonexistent/hosts";
  EXPECT_EQ(errorOf([&] { applyOverrides(s, missing); }),
            "--hostfile: /nonexistent/hosts: cannot open hostfile: no such file; check the path (relative to the directory "
            "dtrain runs in)");
  Overrides badHosts;
  badHosts.hosts = "a:x";
  EXPECT_EQ(errorOf([&] { applyOverrides(s, badHosts); }).rfind("--hosts: bad slot count \"x\"", 0), 0u);
}

TEST(SpecResolve, SlotsAndConsoleRanks) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 3,
      "nodes": [{"host": "a", "slots": 2}, {"host": "b"}]})",
                           "job.json");
  resolve(s);
  EXPECT_EQ(s.nodes[0].slots, 2);
  EXPECT_EQ(s.nodes[1].slots, 3);  // nproc_per_node

  JobSpec a = parseJobSpec(R"({"command": ["true"], "nproc_per_node": "auto", "nodes": [{"host": "a"}, {"host": "b", "slots": 4}]})",
                           "job.json");
  resolve(a);
  EXPECT_EQ(a.nodes[0].slots, 0);  // counted on that node
  EXPECT_EQ(a.nodes[1].slots, 4);

  JobSpec bad = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 4, "console_ranks": [0, 2],
      "nodes": [{"host": "a", "slots": 4}, {"host": "b", "slots": 2}]})",
                             "job.json");
  EXPECT_EQ(errorOf([&] { resolve(bad); }),
            "job.json: /console_ranks: local rank 2 does not exist on host \"b\" (job.json: /nodes/1), which runs 2 workers; "
            "use ranks 0..1");
  // Single node: unchanged.
  JobSpec one = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2, "console_ranks": [2]})", "job.json");
  EXPECT_NE(errorOf([&] { resolve(one); }).find("local rank 2 does not exist with nproc_per_node 2"), std::string::npos);
}

// A pipeline job's world size, where the launcher knows it, must be D x pipeline_stages:
// refused before any worker starts (dtrain validate and run), naming the field, the world
// size and the fix; every node count of an elastic range is checked.
TEST(SpecResolve, PipelineStagesMustDivideEveryKnownWorldSize) {
  const std::string trainer = R"("trainer": {"model": {"layers": [8, 16, 16, 3]}, "parallel": {"pipeline_stages": 2}})";
  JobSpec one = parseJobSpec("{\"nproc_per_node\": 1, " + trainer + "}", "job.json");
  resolve(one);
  EXPECT_EQ(possibleWorldSizes(one), (std::map<int, std::vector<long long>>{{1, {1}}}));
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(one); }),
            "job.json: /trainer/parallel/pipeline_stages: 2 stages do not divide the world size 1 (nproc_per_node 1); "
            "a pipeline job runs D x 2 workers (D data-parallel replicas of the pipeline): set nproc_per_node to a "
            "multiple of 2 (e.g. 2), or drop trainer.parallel (one worker runs no pipeline)");
  Overrides flag;
  flag.nproc_per_node = "3";
  applyOverrides(one, flag);
  resolve(one, flag);
  EXPECT_NE(errorOf([&] { checkPipelineWorld(one, flag); })
                .find("the world size 3 (--nproc-per-node 3); a pipeline job runs D x 2 workers (D data-parallel "
                      "replicas of the pipeline): set --nproc-per-node to a multiple of 2 (e.g. 4), or set "
                      "pipeline_stages to a divisor of 3"),
            std::string::npos);
  flag.nproc_per_node = "4";
  applyOverrides(one, flag);
  resolve(one, flag);
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(one, flag); }), "(no error)");
  // Not a pipeline, or no trainer: nothing to check.
  JobSpec plain = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 3})", "job.json");
  resolve(plain);
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(plain); }), "(no error)");

  // Across hosts: all of them.
  JobSpec hosts = parseJobSpec(
      "{\"nproc_per_node\": 1, \"nodes\": [{\"host\": \"a\", \"slots\": 2}, "
      "{\"host\": \"b\", \"slots\": 2}, {\"host\": \"c\", \"slots\": 3}], " +
          trainer + "}",
      "job.json");
  resolve(hosts);
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(hosts); }),
            "job.json: /trainer/parallel/pipeline_stages: 2 stages do not divide the world size 7 (3 hosts with 2+2+3 "
            "workers); a pipeline job runs D x 2 workers (D data-parallel replicas of the pipeline): give the hosts "
            "workers (slots, or nproc_per_node) adding up to a multiple of 2 (each host a multiple of 2 keeps every "
            "pipeline on one host), or set pipeline_stages to a divisor of 7");
  // An elastic range: every count of hosts in it, any of them (2 of a, b, c: 4 or 6).
  hosts.nodes[2].slots = 4;
  hosts.min_nodes = 1;
  EXPECT_EQ(possibleWorldSizes(hosts), (std::map<int, std::vector<long long>>{{1, {2, 4}}, {2, {4, 6}}, {3, {8}}}));
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(hosts); }), "(no error)");
  hosts.nodes[0].slots = 1;  // 1 + 2 + 4 = 7: all hosts fail
  EXPECT_NE(errorOf([&] { checkPipelineWorld(hosts); }).find("do not divide the world size 7 (3 hosts with 1+2+4 "),
            std::string::npos);
  JobSpec ring = parseJobSpec(
      "{\"nproc_per_node\": 1, \"min_nodes\": 2, \"nodes\": [{\"host\": \"a\"}, "
      "{\"host\": \"b\"}, {\"host\": \"c\"}, {\"host\": \"d\"}], " +
          trainer + "}",
      "job.json");
  resolve(ring);
  EXPECT_EQ(possibleWorldSizes(ring), (std::map<int, std::vector<long long>>{{2, {2}}, {3, {3}}, {4, {4}}}));
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(ring); }),
            "job.json: /trainer/parallel/pipeline_stages: 2 stages do not divide every world size of the elastic "
            "range (2..4 nodes): 3 nodes: 3 workers; a pipeline job runs D x 2 workers (D data-parallel replicas of "
            "the pipeline), and a round of such a size (after a node is lost) would stop the job (a trainer's exit 2 "
            "is not restarted): raise min_nodes to 4, or give every host a multiple of 2 workers");
  Overrides nn;
  nn.nnodes = "2:4";
  applyOverrides(ring, nn);
  resolve(ring, nn);
  EXPECT_NE(errorOf([&] { checkPipelineWorld(ring, nn); }).find(": give --nnodes 4:4, or give every host"),
            std::string::npos);
  // A host whose count is decided on it ("auto"): left to the trainer.
  JobSpec autoHosts = parseJobSpec(
      "{\"nproc_per_node\": \"auto\", \"nodes\": [{\"host\": \"a\"}, "
      "{\"host\": \"b\", \"slots\": 1}], " +
          trainer + "}",
      "job.json");
  resolve(autoHosts);
  EXPECT_TRUE(possibleWorldSizes(autoHosts).empty());
  EXPECT_EQ(errorOf([&] { checkPipelineWorld(autoHosts); }), "(no error)");
}

// A host's worker count: its slots; without them one per GPU it lists; else nproc_per_node.
// The spec's nproc_per_node is that default; --nproc-per-node is an override, and one a
// host's own count contradicts is refused, naming the host (not silently ignored).
TEST(SpecResolve, SlotsGpusAndTheNprocFlag) {
  JobSpec g = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 8})", "job.json");
  g.nodes = parseHostfile("localhost gpus=1,3\nb slots=1 gpus=0,1\nc\n", "hosts");
  resolve(g);
  EXPECT_EQ(g.nodes[0].slots, 2);  // DeepSpeed's --include localhost:1,3
  EXPECT_EQ(g.nodes[1].slots, 1);  // slots win: one worker seeing two GPUs
  EXPECT_EQ(g.nodes[2].slots, 8);
  EXPECT_TRUE(g.warnings.empty());

  // More workers than GPUs listed: a warning naming the line.
  JobSpec w = parseJobSpec(R"({"command": ["true"]})", "job.json");
  w.nodes = parseHostfile("a slots=4 gpus=0,1\n", "hosts");
  resolve(w);
  ASSERT_EQ(w.warnings.size(), 1u);
  EXPECT_EQ(w.warnings.begin()->second.rfind("hosts:1: host \"a\" runs 4 workers on 2 GPUs (gpus=0,1): they share GPUs", 0),
            0u);

  auto withFlag = [](const std::string& hostfile, const std::string& nproc) {
    JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
    Overrides o;
    o.nproc_per_node = nproc;
    applyOverrides(s, o);
    s.nodes = parseHostfile(hostfile, "hosts");
    resolve(s, o);
    return s;
  };
  EXPECT_EQ(errorOf([&] { withFlag("localhost slots=2\n", "1"); }),
            "--nproc-per-node 1: host \"localhost\" (hosts:1) has 2 slots, not 1; drop --nproc-per-node or the host's "
            "slots (hosts without slots run --nproc-per-node workers)");
  EXPECT_EQ(errorOf([&] { withFlag("a gpus=1,3\n", "1"); }),
            "--nproc-per-node 1: host \"a\" (hosts:1) lists 2 GPUs (gpus=1,3) and no slots, so it runs one worker per "
            "GPU, not 1; drop --nproc-per-node, or give the host slots=1 (then its 1 worker sees all these GPUs)");
  JobSpec ok = withFlag("a slots=2\nb\n", "2");  // agrees; b takes it
  EXPECT_EQ(ok.nodes[1].slots, 2);
  JobSpec autoFlag = withFlag("a slots=2\nb\n", "auto");  // "auto" only fills hosts without slots
  EXPECT_EQ(autoFlag.nodes[0].slots, 2);
  EXPECT_EQ(autoFlag.nodes[1].slots, 0);
  // The flag against a spec's nodes, too; the spec's own nproc_per_node stays a default.
  JobSpec n = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 1, "nodes": [{"host": "a", "slots": 4}]})", "t.json");
  resolve(n);
  EXPECT_EQ(n.nodes[0].slots, 4);
  Overrides o;
  o.nproc_per_node = "2";
  applyOverrides(n, o);
  EXPECT_EQ(errorOf([&] { resolve(n, o); }).rfind("--nproc-per-node 2: host \"a\" (t.json: /nodes/0) has 4 slots, not 2", 0),
            0u);
}

// Node range and console rank errors name where the value came from: min_nodes when
// max_nodes was left out (it defaults to min_nodes then), the flag when a flag set it.
TEST(SpecResolve, ErrorsNameTheFieldOrFlagGiven) {
  const std::string two = R"("command": ["true"], "nodes": [{"host": "a", "slots": 1}, {"host": "b", "slots": 1}])";
  JobSpec minOnly = parseJobSpec("{" + two + R"(, "min_nodes": 3})", "t.json");
  EXPECT_EQ(errorOf([&] { resolve(minOnly); }),
            "t.json: /min_nodes: at least 3 node(s), but 2 host(s) given; list more hosts (hostfile, nodes, --hosts) or "
            "lower min_nodes");
  JobSpec maxOnly = parseJobSpec("{" + two + R"(, "max_nodes": 3})", "t.json");
  EXPECT_EQ(errorOf([&] { resolve(maxOnly); }).rfind("t.json: /max_nodes: 3 node(s) asked for but 2 host(s) given", 0), 0u);
  JobSpec both = parseJobSpec("{" + two + R"(, "min_nodes": 2, "max_nodes": 1})", "t.json");
  EXPECT_EQ(errorOf([&] { resolve(both); }).rfind("t.json: /min_nodes: 2 is more than max_nodes 1", 0), 0u);

  JobSpec s = parseJobSpec("{" + two + "}", "t.json");
  Overrides o;
  o.nnodes = "3";
  applyOverrides(s, o);
  EXPECT_EQ(errorOf([&] { resolve(s, o); }),
            "--nnodes: 3 node(s) asked for but 2 host(s) given; list more hosts (hostfile, nodes, --hosts) or lower --nnodes");
  JobSpec f = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2})", "t.json");
  Overrides lr;
  lr.local_ranks_filter = "5";
  applyOverrides(f, lr);
  EXPECT_EQ(errorOf([&] { resolve(f, lr); }),
            "--local-ranks-filter: local rank 5 does not exist with nproc_per_node 2; use ranks 0..1");
  JobSpec m = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2,
      "nodes": [{"host": "a", "slots": 4}, {"host": "b", "slots": 2}]})", "t.json");
  applyOverrides(m, lr);
  EXPECT_EQ(errorOf([&] { resolve(m, lr); }).rfind("--local-ranks-filter: local rank 5 does not exist on host \"b\"", 0), 0u);
}

TEST(SpecDescribe, ListsNodesAndSsh) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2, "ssh": {"user": "alice", "port": 2200},
      "nodes": [{"host": "localhost", "slots": 1}, {"host": "bob@node2", "port": 2222, "gpus": [0, 1]}]})",
                           "job.json");
  resolve(s);
  std::string d = describe(s);
  EXPECT_NE(d.find("nodes:              2\n"), std::string::npos) << d;
  EXPECT_NE(d.find("localhost: 1 slot, local (no ssh)"), std::string::npos) << d;
  EXPECT_NE(d.find("node2: 2 slots, user bob, port 2222, gpus 0,1, ssh"), std::string::npos) << d;
  EXPECT_NE(d.find("ssh:                user alice, port 2200, connect timeout 10 s, host keys accept-new"), std::string::npos) << d;
  EXPECT_NE(d.find("env_forward:        NCCL_ GLOO_"), std::string::npos) << d;
  EXPECT_EQ(describe(parseJobSpec(R"({"command": ["true"]})", "job.json")).find("nodes:"), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// serializeForNode

void expectRoundTrip(const JobSpec& s) {
  std::string once = serializeForNode(s);
  JobSpec back = parseJobSpec(once, "node-spec");
  EXPECT_EQ(serializeForNode(back), once);
  EXPECT_EQ(back.name, s.name);
  EXPECT_EQ(back.command, s.command);
  EXPECT_EQ(back.env, s.env);
  EXPECT_EQ(back.cwd, s.cwd);
  EXPECT_EQ(back.nproc_auto, s.nproc_auto);
  if (!s.nproc_auto) {
    EXPECT_EQ(back.nproc_per_node, s.nproc_per_node);
  }
  EXPECT_EQ(back.log_dir, s.log_dir);
  EXPECT_EQ(back.max_restarts, s.max_restarts);
  EXPECT_EQ(back.rendezvous.port, s.rendezvous.port);
  EXPECT_EQ(back.rendezvous.timeout_s, s.rendezvous.timeout_s);
  EXPECT_EQ(back.rendezvous.addr, s.rendezvous.addr);
  EXPECT_EQ(back.rendezvous.master_addr, s.rendezvous.master_addr);
  EXPECT_EQ(back.shutdown_timeout_s, s.shutdown_timeout_s);
  EXPECT_EQ(back.prefix_output, s.prefix_output);
  EXPECT_EQ(back.console_ranks, s.console_ranks);
  EXPECT_EQ(back.env_forward, s.env_forward);
  EXPECT_TRUE(back.nodes.empty());
  EXPECT_TRUE(back.hostfile.empty());
  EXPECT_TRUE(back.env_file.empty());
  ASSERT_EQ(back.trainer.has_value(), s.trainer.has_value());
  if (!s.trainer) return;
  const TrainerSpec& a = *back.trainer;
  const TrainerSpec& b = *s.trainer;
  EXPECT_EQ(a.model.type, b.model.type);
  EXPECT_EQ(a.model.layers, b.model.layers);
  EXPECT_EQ(a.model.activation, b.model.activation);
  EXPECT_EQ(a.model.loss, b.model.loss);
  EXPECT_EQ(a.data.type, b.data.type);
  EXPECT_EQ(a.data.train_samples, b.data.train_samples);
  EXPECT_EQ(a.data.eval_samples, b.data.eval_samples);
  EXPECT_EQ(a.data.seed, b.data.seed);
  EXPECT_EQ(a.data.path, b.data.path);
  EXPECT_EQ(a.data.labels_path, b.data.labels_path);
  EXPECT_EQ(a.data.eval_path, b.data.eval_path);
  EXPECT_EQ(a.data.eval_labels_path, b.data.eval_labels_path);
  EXPECT_EQ(a.data.label_column, b.data.label_column);
  EXPECT_EQ(a.data.header, b.data.header);
  EXPECT_EQ(a.data.prefetch, b.data.prefetch);
  EXPECT_EQ(a.data.loader_threads, b.data.loader_threads);
  EXPECT_EQ(a.batch_size, b.batch_size);
  EXPECT_EQ(a.epochs, b.epochs);
  EXPECT_EQ(a.max_steps, b.max_steps);
  EXPECT_EQ(a.optimizer.type, b.optimizer.type);
  EXPECT_EQ(a.optimizer.lr, b.optimizer.lr);
  EXPECT_EQ(a.optimizer.momentum, b.optimizer.momentum);
  EXPECT_EQ(a.optimizer.nesterov, b.optimizer.nesterov);
  EXPECT_EQ(a.optimizer.weight_decay, b.optimizer.weight_decay);
  EXPECT_EQ(a.optimizer.beta1, b.optimizer.beta1);
  EXPECT_EQ(a.optimizer.beta2, b.optimizer.beta2);
  EXPECT_EQ(a.optimizer.eps, b.optimizer.eps);
  EXPECT_EQ(a.lr_schedule.type, b.lr_schedule.type);
  EXPECT_EQ(a.lr_schedule.step_size, b.lr_schedule.step_size);
  EXPECT_EQ(a.lr_schedule.gamma, b.lr_schedule.gamma);
  EXPECT_EQ(a.lr_schedule.warmup_steps, b.lr_schedule.warmup_steps);
  EXPECT_EQ(a.lr_schedule.min_lr, b.lr_schedule.min_lr);
  EXPECT_EQ(a.grad_clip_norm, b.grad_clip_norm);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.bucket_mb, b.bucket_mb);
  EXPECT_EQ(a.overlap, b.overlap);
  EXPECT_EQ(a.log_every_steps, b.log_every_steps);
  EXPECT_EQ(a.checkpoint.dir, b.checkpoint.dir);
  EXPECT_EQ(a.checkpoint.every_steps, b.checkpoint.every_steps);
  EXPECT_EQ(a.checkpoint.async, b.checkpoint.async);
}

TEST(SerializeForNode, CommandJobRoundTrips) {
  TempFile envFile("FROM_FILE=1\nA=file\n");
  JobSpec s = parseJobSpec(R"({"name": "cmd", "command": ["sh", "-c", "echo 'x y' \\\"$A\\\"", ""], "env": {"A": "spec", "Q": "\"q\""},
      "cwd": "/tmp", "nproc_per_node": 3, "log_dir": "/tmp/dtrain-serialize-logs", "max_restarts": 2,
      "rendezvous": {"port": 29500, "timeout_s": 60, "addr": "10.0.0.1", "master_addr": "node1"},
      "shutdown_timeout_s": 2.5, "prefix_output": false, "console_ranks": [0, 1],
      "env_forward": ["NCCL_", "MY_"], "env_file": ")" + envFile.path() + R"(",
      "nodes": [{"host": "h1", "slots": 2}, {"host": "h2", "slots": 3}], "ssh": {"user": "alice"}})",
                           "job.json");
  resolve(s);
  expectRoundTrip(s);
  std::string text = serializeForNode(s);
  EXPECT_EQ(text.find("\"nodes\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"ssh\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"env_file\""), std::string::npos) << text;
  EXPECT_EQ(text.find("\"hostfile\""), std::string::npos) << text;
  JobSpec back = parseJobSpec(text, "node-spec");
  EXPECT_EQ(back.env.at("FROM_FILE"), "1");  // merged already
  EXPECT_EQ(back.env.at("A"), "spec");
}

TEST(SerializeForNode, NonUtf8EnvIsASpecError) {
  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  Overrides o;
  o.env = {"A=caf\xE9"};
  applyOverrides(s, o);
  EXPECT_EQ(errorOf([&] { serializeForNode(s); }),
            "a value of the job (env, --env) is not valid UTF-8 and cannot be sent to remote nodes; use UTF-8 text");
}

TEST(SerializeForNode, DefaultsAndAutoRoundTrip) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": "auto"})", "job.json");
  resolve(s);
  expectRoundTrip(s);
  EXPECT_NE(serializeForNode(s).find("\"nproc_per_node\":\"auto\""), std::string::npos);
  JobSpec none = parseJobSpec(R"({"command": ["true"], "env_forward": []})", "job.json");
  expectRoundTrip(none);
}

TEST(SerializeForNode, TrainerEveryFieldRoundTrips) {
  JobSpec s = parseJobSpec(R"({"name": "t", "nproc_per_node": 2, "trainer": {
      "model": {"type": "mlp", "layers": [20, 33, 17, 5], "activation": "gelu", "loss": "mse"},
      "data": {"type": "synthetic", "train_samples": 1234, "eval_samples": 0, "seed": 18446744073},
      "batch_size": 7, "epochs": 3, "max_steps": 99,
      "optimizer": {"type": "sgd", "lr": 0.123456789012345, "momentum": 0.85, "nesterov": true, "weight_decay": 0.0001},
      "lr_schedule": {"type": "step", "step_size": 10, "gamma": 0.3},
      "grad_clip_norm": 1.5, "device": "cpu", "seed": 42, "bucket_mb": 0.5, "overlap": false, "log_every_steps": 3,
      "checkpoint": {"dir": "/tmp/dtrain-serialize-ckpt", "every_steps": 5, "async": true}}})",
                           "job.json");
  resolve(s);
  expectRoundTrip(s);
}

TEST(SerializeForNode, AdamwWarmupCosineRoundTrips) {
  JobSpec s = parseJobSpec(R"({"trainer": {"model": {"layers": [8, 4, 3]},
      "optimizer": {"type": "adamw", "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05},
      "lr_schedule": {"type": "warmup_cosine", "warmup_steps": 100, "min_lr": 1e-5}}})",
                           "job.json");
  expectRoundTrip(s);
  JobSpec d = parseJobSpec(R"({"trainer": {"model": {"layers": [8, 3]}, "optimizer": {"type": "adamw"}}})", "job.json");
  expectRoundTrip(d);
  EXPECT_DOUBLE_EQ(parseJobSpec(serializeForNode(d), "x").trainer->optimizer.weight_decay, 0.01);
}

TEST(SerializeForNode, PipelineParallelRoundTrips) {
  JobSpec s = parseJobSpec(R"({"trainer": {"model": {"layers": [8, 6, 5, 3]}, "batch_size": 32,
      "parallel": {"pipeline_stages": 2, "micro_batches": 8, "schedule": "gpipe", "stage_layers": [1, 2]}}})",
                           "job.json");
  expectRoundTrip(s);
  auto t = *parseJobSpec(serializeForNode(s), "x").trainer;
  EXPECT_EQ(t.parallel.pipeline_stages, 2);
  EXPECT_EQ(t.parallel.micro_batches, 8);
  EXPECT_EQ(t.parallel.schedule, "gpipe");
  EXPECT_EQ(t.parallel.stage_layers, (std::vector<int>{1, 2}));
  // Defaults: M = P, 1f1b.
  auto d = *parseJobSpec(R"({"trainer": {"model": {"layers": [8, 6, 3]}, "parallel": {"pipeline_stages": 2}}})", "j").trainer;
  EXPECT_EQ(d.parallel.micro_batches, 2);
  EXPECT_EQ(d.parallel.schedule, "1f1b");
}

TEST(SerializeForNode, CsvDataRoundTrips) {
  TempFile train("a,b,label\n1,2,0\n3,4,1\n");
  TempFile eval("a,b,label\n1,2,0\n");
  JobSpec s = parseJobSpec(R"({"trainer": {"model": {"layers": [2, 2]},
      "data": {"type": "csv", "path": ")" + train.path() + R"(", "eval_path": ")" + eval.path() + R"(",
               "label_column": 2, "header": false, "seed": 3, "prefetch": false,
               "loader_threads": 4}}})",
                           "job.json");
  expectRoundTrip(s);
  EXPECT_EQ(s.trainer->data.prefetch, std::optional<bool>(false));
  EXPECT_EQ(parseJobSpec(R"({"trainer": {"model": {"layers": [2, 2]}, "data": {"prefetch": "auto"}}})", "j").trainer->data.prefetch,
            std::nullopt);
  EXPECT_EQ(parseJobSpec(serializeForNode(s), "x").trainer->data.label_column, "2");
  EXPECT_TRUE(parseJobSpec(serializeForNode(s), "x").trainer->data.label_column_is_index);
  // A string of digits is a header name first (data.cc): it stays a string on other nodes.
  JobSpec digits = parseJobSpec(R"({"trainer": {"model": {"layers": [2, 2]},
      "data": {"type": "csv", "path": ")" +
                                    train.path() + R"(", "label_column": "2"}}})",
                                "job.json");
  EXPECT_FALSE(digits.trainer->data.label_column_is_index);
  expectRoundTrip(digits);
  JobSpec named = parseJobSpec(R"({"trainer": {"model": {"layers": [2, 2]},
      "data": {"type": "csv", "path": ")" + train.path() + R"(", "label_column": "label"}}})",
                               "job.json");
  expectRoundTrip(named);
}

TEST(SerializeForNode, IdxDataRoundTrips) {
  TempFile images("x");
  TempFile labels("y");
  JobSpec s = parseJobSpec(R"({"trainer": {"model": {"layers": [784, 10]},
      "data": {"type": "idx", "path": ")" + images.path() + R"(", "labels_path": ")" + labels.path() + R"(",
               "eval_path": ")" + images.path() + R"(", "eval_labels_path": ")" + labels.path() + R"("}}})",
                           "job.json");
  expectRoundTrip(s);
}

}  // namespace
TEST(Hostfile, ControlCharactersAreShownAndLongNamesRefused) {
  // A NUL in a line cut the message there, with the fix lost (security audit).
  EXPECT_EQ(hostfileError(std::string("h1 slots=1\0\n", 12)),
            "hosts:1: bad slot count \"1\\x00\" for host \"h1\"; give slots=N (or host:N) with N between 1 and 4096");
  // A 10-million-character name was taken.
  EXPECT_EQ(hostfileError(std::string(254, 'a') + " slots=1\n"),
            "hosts:1: a host name of 254 characters (at most 253 in DNS); give a host name or address (user@host for a "
            "login name)");
  EXPECT_EQ(parseHostfile("user@" + std::string(253, 'a') + " slots=1\n", "hosts").at(0).slots, 1);
}

}  // namespace dtrain::spec
