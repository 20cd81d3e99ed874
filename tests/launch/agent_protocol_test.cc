#include <gtest/gtest.h>
#include <signal.h>

#include "dtrain/launch/agent_protocol.h"
#include "dtrain/launch/multi_node.h"

namespace dtrain::launch {
namespace {

TEST(AgentProtocol, EscapeRoundTripsEveryByte) {
  std::string all;
  for (int c = 0; c < 256; ++c) all.push_back(static_cast<char>(c));
  all += "\\n\\t\\\\ trailing backslash \\";
  std::string e = proto::escape(all);
  EXPECT_EQ(e.find('\n'), std::string::npos);
  EXPECT_EQ(e.find('\t'), std::string::npos);
  EXPECT_EQ(proto::unescape(e), all);
}

TEST(AgentProtocol, RecordIsOneLineAndParsesBack) {
  std::string rec = proto::record('O', {"3", "1", "a\tline\nwith\\ things"});
  ASSERT_EQ(rec.back(), '\n');
  EXPECT_EQ(rec.find('\n'), rec.size() - 1);
  auto r = proto::parse(std::string_view(rec).substr(0, rec.size() - 1));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->type, 'O');
  ASSERT_EQ(r->fields.size(), 3u);
  EXPECT_EQ(r->fields[2], "a\tline\nwith\\ things");
  // Empty fields survive.
  auto e = proto::parse("E\t\t\t");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->fields.size(), 3u);
}

TEST(AgentProtocol, MalformedInputIsRejectedNotTrusted) {
  EXPECT_FALSE(proto::parse(""));
  EXPECT_FALSE(proto::parse("Ogarbage"));
  auto r = proto::parse("X\t1\t2");
  ASSERT_TRUE(r);
  EXPECT_FALSE(proto::parseExit(*r));
  auto bad = proto::parse("X\tone\t0\t1\t0\t0\t0\t0\twhen\tm\ttb");
  ASSERT_TRUE(bad);
  EXPECT_FALSE(proto::parseExit(*bad));
}

// The user's Ctrl-C / SIGHUP to dtrain run reaches the workers on every node as that signal,
// as on one host; the launcher's own stops (and the user's SIGTERM) stay the plain "stop"
// every agent knows.
TEST(AgentProtocol, StopCommandCarriesTheSignalToPassOn) {
  EXPECT_EQ(proto::stopCommand(SIGTERM), "stop");
  EXPECT_EQ(proto::stopCommand(SIGINT), "stop SIGINT");
  EXPECT_EQ(proto::stopCommand(SIGHUP), "stop SIGHUP");
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) EXPECT_EQ(proto::stopSignal(proto::stopCommand(sig)), sig);
  EXPECT_EQ(proto::stopSignal("stop SIGTERM"), SIGTERM);
  // A name the agent does not know still stops (with SIGTERM): a stop is never dropped.
  EXPECT_EQ(proto::stopSignal("stop SIGFOO"), SIGTERM);
  EXPECT_EQ(proto::stopSignal("stop SIGINT extra"), SIGTERM);
  EXPECT_FALSE(proto::stopSignal("kill"));
  EXPECT_FALSE(proto::stopSignal("signal SIGUSR1"));
  EXPECT_FALSE(proto::stopSignal("stopped"));
  EXPECT_FALSE(proto::stopSignal(""));
}

TEST(AgentProtocol, StopActionsSendTheirSignal) {
  EXPECT_EQ(stopAction(SIGINT), ControlAction::kStopSigint);
  EXPECT_EQ(stopAction(SIGHUP), ControlAction::kStopSighup);
  EXPECT_EQ(stopAction(SIGTERM), ControlAction::kStop);
  EXPECT_EQ(stopAction(0), ControlAction::kStop);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) EXPECT_EQ(stopActionSignal(stopAction(sig)), sig);
  // Not graceful stops: a kill, a lost controller (its own shorter grace), a pass-on.
  for (auto a : {ControlAction::kNone, ControlAction::kKill, ControlAction::kLost, ControlAction::kPassOnUsr1})
    EXPECT_EQ(stopActionSignal(a), 0);
}

TEST(AgentProtocol, WorkerExitRoundTrips) {
  WorkerExit w;
  w.global_rank = 5;
  w.local_rank = 1;
  w.pid = 4242;
  w.exit_code = 0;
  w.signal = 9;
  w.stopped_by_dtrain = true;
  w.hung = true;
  w.when = "2026-12-02T10:00:00.000Z";
  w.error_message = "ValueError: bad";
  w.error_traceback = "Traceback:\n  line 1\n\tline 2";
  w.stderr_tail = {"first", "sec\tond", ""};
  std::string rec = proto::exitRecord(w);
  auto r = proto::parse(std::string_view(rec).substr(0, rec.size() - 1));
  ASSERT_TRUE(r);
  auto back = proto::parseExit(*r);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->global_rank, 5);
  EXPECT_EQ(back->local_rank, 1);
  EXPECT_EQ(back->pid, 4242);
  EXPECT_EQ(back->signal, 9);
  EXPECT_TRUE(back->stopped_by_dtrain);
  EXPECT_TRUE(back->hung);
  EXPECT_EQ(back->when, w.when);
  EXPECT_EQ(back->error_message, w.error_message);
  EXPECT_EQ(back->error_traceback, w.error_traceback);
  EXPECT_EQ(back->stderr_tail, w.stderr_tail);
  EXPECT_FALSE(back->start_failed);
  // The flags field carries both bits, each alone too.
  w.hung = false;
  w.start_failed = true;
  rec = proto::exitRecord(w);
  back = proto::parseExit(*proto::parse(std::string_view(rec).substr(0, rec.size() - 1)));
  ASSERT_TRUE(back);
  EXPECT_FALSE(back->hung);
  EXPECT_TRUE(back->start_failed);
  EXPECT_FALSE(back->refused_input);
  // A trainer that refused its input (exit 2): flag 4, so the launcher does not restart it.
  w.start_failed = false;
  w.refused_input = true;
  w.exit_code = 2;
  rec = proto::exitRecord(w);
  back = proto::parseExit(*proto::parse(std::string_view(rec).substr(0, rec.size() - 1)));
  ASSERT_TRUE(back);
  EXPECT_FALSE(back->start_failed);
  EXPECT_TRUE(back->refused_input);
  EXPECT_TRUE(restartCannotHelp(*back));
  EXPECT_NE(notRestartedReason(*back, spec::JobSpec{}, "h2").find("rank 5 on h2 stopped on an error no restart can fix (exit 2"),
            std::string::npos);
}

TEST(SshArgv, FollowsTheSpec) {
  spec::JobSpec s;
  s.ssh.user = "alice";
  s.ssh.port = 2222;
  s.ssh.identity_file = "/k/id";
  s.ssh.connect_timeout_s = 2.5;
  s.ssh.host_key_checking = "yes";
  s.ssh.options = {"-F", "/cfg"};
  spec::NodeSpec n;
  n.host = "h1";
  auto a = sshArgv(s, n);
  std::string joined;
  for (const auto& x : a) joined += x + " ";
  EXPECT_EQ(joined,
            "ssh -T -o BatchMode=yes -o ConnectTimeout=3 -o StrictHostKeyChecking=yes -o ServerAliveInterval=5 "
            "-o ServerAliveCountMax=3 -p 2222 -i /k/id -l alice -F /cfg h1 ");
  // Per-node user and port win over the ssh section's.
  n.user = "bob";
  n.port = 22;
  a = sshArgv(s, n);
  joined.clear();
  for (const auto& x : a) joined += x + " ";
  EXPECT_NE(joined.find("-p 22 "), std::string::npos);
  EXPECT_NE(joined.find("-l bob "), std::string::npos);
}

TEST(NodesPlan, RanksAreContiguousPerNodeInHostfileOrder) {
  spec::JobSpec s;
  s.nproc_per_node = 3;
  s.nodes.resize(3);
  s.nodes[0].host = "a";
  s.nodes[0].slots = 2;
  s.nodes[1].host = "b";  // slots 0: nproc_per_node
  s.nodes[2].host = "c";
  s.nodes[2].slots = 1;
  s.nodes[2].gpus = {3};
  Plan p = makeNodesPlan(s, "r");
  ASSERT_EQ(p.world_size, 6);
  ASSERT_EQ(p.workers.size(), 6u);
  EXPECT_EQ(p.workers[2].host, "b");
  EXPECT_EQ(p.workers[2].global_rank, 2);
  EXPECT_EQ(p.workers[2].local_rank, 0);
  EXPECT_EQ(p.workers[5].node_rank, 2);
  EXPECT_EQ(p.workers[5].device, "cuda:3");
}

}  // namespace
}  // namespace dtrain::launch
