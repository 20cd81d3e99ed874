#include "dtrain/spec/job_spec.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/spec/error_file.h"
#include "dtrain/spec/summary.h"

namespace dtrain::spec {
namespace {

std::string errorOf(const std::string& text) {
  try {
    parseJobSpec(text, "job.json");
  } catch (const SpecError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(JobSpec, ParsesAllKeys) {
  JobSpec s = parseJobSpec(R"({"name": "n", "command": ["python3", "t.py", ""], "env": {"A": "1"},
      "cwd": "/tmp", "nproc_per_node": 4, "log_dir": "/tmp/x-logs", "max_restarts": 3,
      "rendezvous": {"port": 1234, "timeout_s": 60}, "shutdown_timeout_s": 2.5,
      "prefix_output": false, "console_ranks": [0, 2]})",
                           "job.json");
  EXPECT_EQ(s.name, "n");
  EXPECT_EQ(s.command, (std::vector<std::string>{"python3", "t.py", ""}));
  EXPECT_EQ(s.env.at("A"), "1");
  EXPECT_EQ(s.cwd, "/tmp");
  EXPECT_EQ(s.nproc_per_node, 4);
  EXPECT_FALSE(s.nproc_auto);
  EXPECT_EQ(s.log_dir, "/tmp/x-logs");
  EXPECT_EQ(s.max_restarts, 3);
  EXPECT_EQ(s.rendezvous.port, 1234);
  EXPECT_EQ(s.rendezvous.timeout_s, 60);
  EXPECT_DOUBLE_EQ(s.shutdown_timeout_s, 2.5);
  EXPECT_FALSE(s.prefix_output);
  EXPECT_EQ(s.console_ranks, (std::vector<int>{0, 2}));
}

TEST(JobSpec, DefaultsAreTorchrunLike) {
  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  EXPECT_EQ(s.nproc_per_node, 1);
  EXPECT_EQ(s.max_restarts, 0);
  EXPECT_EQ(s.rendezvous.port, 0);  // a free port, chosen at start
  EXPECT_DOUBLE_EQ(s.shutdown_timeout_s, 30);
  EXPECT_TRUE(s.prefix_output);
}

TEST(JobSpec, GpuMeansCuda) {
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [4, 3]}, "device": "gpu"}})"),
            "job.json: /trainer/device: \"gpu\" is not one of auto, cpu, cuda; did you mean \"cuda\"?");
}

TEST(JobSpec, ErrorsNameFilePointerAndFix) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nproc_per_node": -1})"),
            "job.json: /nproc_per_node: expected a worker count between 1 and 4096 or \"auto\", got -1");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "max_restart": 1})"),
            "job.json: /max_restart: unknown key \"max_restart\"; did you mean \"max_restarts\"?");
  EXPECT_EQ(errorOf("{\n  \"command\": [\"true\"\n}"),
            "job.json:3:1: invalid JSON: syntax error while parsing array - unexpected '}'; expected ']'");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nproc_per_node": 18446744073709551615})"),
            "job.json: /nproc_per_node: expected a worker count between 1 and 4096 or \"auto\", got 18446744073709551615");
}

TEST(JobSpec, AutoResolvesToCpusWithoutGpus) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": "auto"})", "job.json");
  EXPECT_TRUE(s.nproc_auto);
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  resolve(s);
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_EQ(visibleGpuCount() >= 0, true);
  EXPECT_GE(s.nproc_per_node, 1);
}

TEST(JobSpec, OverridesWinAndAreChecked) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "env": {"A": "spec"}})", "job.json");
  Overrides o;
  o.nproc_per_node = "3";
  o.max_restarts = 2;
  o.env = {"A=cli", "B=x=y"};
  o.local_ranks_filter = "0,2";
  o.no_prefix = true;
  applyOverrides(s, o);
  EXPECT_EQ(s.nproc_per_node, 3);
  EXPECT_EQ(s.max_restarts, 2);
  EXPECT_EQ(s.env.at("A"), "cli");
  EXPECT_EQ(s.env.at("B"), "x=y");
  EXPECT_EQ(s.console_ranks, (std::vector<int>{0, 2}));
  EXPECT_FALSE(s.prefix_output);

  Overrides bad;
  bad.nproc_per_node = "2x";
  EXPECT_THROW(applyOverrides(s, bad), SpecError);
  Overrides badEnv;
  badEnv.env = {"=v"};
  EXPECT_THROW(applyOverrides(s, badEnv), SpecError);
  Overrides badFilter;
  badFilter.local_ranks_filter = "0,,1";
  EXPECT_THROW(applyOverrides(s, badFilter), SpecError);
}

TEST(JobSpec, ConsoleRanksMustExist) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2, "console_ranks": [2]})", "job.json");
  EXPECT_THROW(resolve(s), SpecError);
}

TEST(JobSpec, ParsesMultiNodeKeys) {
  JobSpec s = parseJobSpec(R"({"command": ["true"], "nproc_per_node": 2,
      "nodes": [{"host": "alice@node1", "slots": 4, "gpus": [0, 1, 2, 3]}, {"host": "node2", "port": 2222, "address": "10.1.0.2"}],
      "ssh": {"user": "bob", "port": 22, "connect_timeout_s": 5, "options": ["-o", "Compression=no"],
              "host_key_checking": "yes", "dtrain_path": "/opt/dtrain"},
      "rendezvous": {"port": 29400, "addr": "10.1.0.1", "master_addr": "10.1.0.1"},
      "env_forward": ["NCCL_", "MY_APP_"]})",
                           "job.json");
  ASSERT_EQ(s.nodes.size(), 2u);
  EXPECT_EQ(s.nodes[0].user, "alice");
  EXPECT_EQ(s.nodes[0].host, "node1");
  EXPECT_EQ(s.nodes[0].slots, 4);
  EXPECT_EQ(s.nodes[1].port, 2222);
  EXPECT_EQ(s.nodes[1].address, "10.1.0.2");
  EXPECT_EQ(s.ssh.user, "bob");
  EXPECT_EQ(s.ssh.port, 22);
  EXPECT_DOUBLE_EQ(s.ssh.connect_timeout_s, 5);
  EXPECT_EQ(s.ssh.options, (std::vector<std::string>{"-o", "Compression=no"}));
  EXPECT_EQ(s.ssh.host_key_checking, "yes");
  EXPECT_EQ(s.ssh.dtrain_path, "/opt/dtrain");
  EXPECT_EQ(s.rendezvous.addr, "10.1.0.1");
  EXPECT_EQ(s.rendezvous.master_addr, "10.1.0.1");
  EXPECT_EQ(s.env_forward, (std::vector<std::string>{"NCCL_", "MY_APP_"}));
  resolve(s);
  EXPECT_EQ(s.nodes[1].slots, 2);
}

// A command written as one string gets the array it most likely means.
TEST(JobSpec, CommandAsAStringGetsTheArray) {
  EXPECT_EQ(errorOf(R"({"command": "python3  train.py --lr 0.1"})"),
            "job.json: /command: expected an array of strings (argv), got the string \"python3  train.py --lr 0.1\"; "
            "write it as an array: [\"python3\", \"train.py\", \"--lr\", \"0.1\"]");
  EXPECT_EQ(errorOf(R"({"command": "python3 train.py > out.txt"})"),
            "job.json: /command: expected an array of strings (argv), got the string \"python3 train.py > out.txt\"; "
            "write it as an array, and to have a shell read it: [\"sh\", \"-c\", \"python3 train.py > out.txt\"]");
}

TEST(JobSpec, MultiNodeKeysAreChecked) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "host_file": "h"})"),
            "job.json: /host_file: unknown key \"host_file\"; did you mean \"hostfile\"?");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "env_forwards": []})"),
            "job.json: /env_forwards: unknown key \"env_forwards\"; did you mean \"env_forward\"?");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nodes": [{"host": "h", "adress": "1.2.3.4"}]})"),
            "job.json: /nodes/0/adress: unknown key \"adress\"; did you mean \"address\"?");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nodes": {"host": "h"}})"),
            "job.json: /nodes: expected an array of hosts like [{\"host\": \"node1\", \"slots\": 8}], got an object");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "ssh": "alice"})"), "job.json: /ssh: expected an object, got the string \"alice\"");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "hostfile": ""})"), "job.json: /hostfile: expected a non-empty string, got \"\"");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "env_file": 3})"), "job.json: /env_file: expected a string, got 3");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "rendezvous": {"addr": "a b"}})"),
            "job.json: /rendezvous/addr: host name \"a b\" contains ' '; give an IP address or host name");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "env_forward": ["A=B"]})"),
            "job.json: /env_forward/0: bad variable-name prefix \"A=B\"; prefixes are letters, digits and '_', not starting with a "
            "digit");
}

TEST(JobSpec, FuzzedValuesThatPassedAreRefused) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "worker_timeout_s": 1e-300})"),
            "job.json: /worker_timeout_s: 1e-300 s is too short for any worker to show it is alive; give 0 (off) or at "
            "least 1, more than a step takes");
  EXPECT_NO_THROW(parseJobSpec(R"({"command": ["true"], "worker_timeout_s": 1})", "job.json"));
  EXPECT_NO_THROW(parseJobSpec(R"({"command": ["true"], "worker_timeout_s": 0})", "job.json"));
  for (const char* ch : {"\\u2028", "\\u2029", "\\u202e", "\\u2066"})
    EXPECT_NE(errorOf(std::string(R"({"command": ["true"], "name": "a)") + ch + "b\"}").find("/name: contains U+"),
              std::string::npos)
        << ch;
  EXPECT_NO_THROW(parseJobSpec(R"({"command": ["true"], "name": "r\u00e9sum\u00e9 \u2014 run"})", "job.json"));
}

// validate's listing: one value per line, whatever the values hold.
TEST(JobSpec, DescribeShowsControlCharactersEscaped) {
  JobSpec s = parseJobSpec(R"({"command": ["true", "\u001b[31mred"], "log_dir": "a\nb", "env": {"X": "1\n2"}})", "job.json");
  const std::string d = describe(s);
  EXPECT_EQ(d.find('\x1b'), std::string::npos) << d;
  EXPECT_NE(d.find("a\\nb\nmax_restarts:"), std::string::npos) << d;  // (the path made absolute)
  EXPECT_NE(d.find("X=1\\n2\n"), std::string::npos) << d;
  EXPECT_NE(d.find("\\x1b[31mred"), std::string::npos) << d;
}

TEST(JobSpec, DuplicateKeysAreRefusedWithPathAndPosition) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nproc_per_node": 2, "nproc_per_node": 8})"),
            "job.json: /: key \"nproc_per_node\" is given twice (line 1, column 23, then line 1, column 44); the second would "
            "silently override the first; keep one of them");
  EXPECT_EQ(errorOf("{\"command\": [\"true\"],\n \"env\": {\"A\": \"1\",\n         \"A\": \"2\"}}"),
            "job.json: /env: key \"A\" is given twice (line 2, column 10, then line 3, column 10); the second would silently "
            "override the first; keep one of them");
  // Paths through arrays, and keys with escapes (the position is the key's opening quote).
  EXPECT_NE(errorOf(R"({"command": ["true"], "nodes": [{"host": "a"}, {"host": "b", "slots": 1, "slots": 2}]})")
                .find("job.json: /nodes/1: key \"slots\" is given twice"),
            std::string::npos);
  EXPECT_NE(errorOf(R"({"command": ["true"], "env": {"a\"b": "1", "a\"b": "2"}})")
                .find("job.json: /env: key \"a\\\"b\" is given twice (line 1, column 31, then line 1, column 44)"),
            std::string::npos);
  // The same key in different objects is fine.
  EXPECT_NO_THROW(parseJobSpec(R"({"command": ["true"], "rendezvous": {"port": 0}, "ssh": {"port": 22}})", "job.json"));
}

TEST(JobSpec, NulInAnyStringIsRefused) {
  const std::string nul = "contains a NUL character (\\u0000), which a command line, environment or path cannot carry; remove it";
  EXPECT_EQ(errorOf(R"({"command": ["x\u0000y"]})"), "job.json: /command/0: " + nul);
  EXPECT_EQ(errorOf(R"({"command": ["true"], "env": {"A": "x\u0000"}})"), "job.json: /env/A: " + nul);
  EXPECT_EQ(errorOf(R"({"command": ["true"], "cwd": "/tmp\u0000/x"})"), "job.json: /cwd: " + nul);
  EXPECT_EQ(errorOf(R"({"command": ["true"], "name": "a\u0000"})"), "job.json: /name: " + nul);
  // Keys: env names follow the name rule; other keys are unknown keys. Either way, one line.
  EXPECT_NE(errorOf(R"({"command": ["true"], "env": {"A\u0000B": "1"}})").find("/env/A\\x00B: bad variable name \"A\\u0000B\""),
            std::string::npos);
}

TEST(JobSpec, RangeMessagesStateTheRange) {
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 100000000, 4]}}})"),
            "job.json: /trainer/model/layers/1: expected a layer width between 1 and 1048576, got 100000000");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "max_restarts": 18446744073709551615})"),
            "job.json: /max_restarts: expected an integer between 0 and 1000000, got 18446744073709551615");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "epochs": 1e9}})"),
            "job.json: /trainer/epochs: expected an integer between 1 and 1000000, got 1000000000.0");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "epochs": 2.0}})"),
            "job.json: /trainer/epochs: expected an integer between 1 and 1000000, got 2.0; write it as 2, without a decimal "
            "point or exponent");
  // 1e3 is parsed as the decimal 1000.0: the fix names the integer to write.
  EXPECT_EQ(errorOf(R"({"command": ["true"], "max_restarts": 1e3})"),
            "job.json: /max_restarts: expected an integer between 0 and 1000000, got 1000.0; write it as 1000, without a "
            "decimal point or exponent");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "seed": 1e30}})"),
            "job.json: /trainer/seed: expected an integer between 0 and 9223372036854775807, got 1e+30");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "optimizer": {"lr": 1e300}}})"),
            "job.json: /trainer/optimizer/lr: expected a learning rate in (0, 1000000], got 1e+300");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "optimizer": {"momentum": 1}}})"),
            "job.json: /trainer/optimizer/momentum: expected a momentum in [0, 1), got 1");
  EXPECT_EQ(errorOf(R"({"trainer": {"model": {"layers": [16, 4]}, "optimizer": {"type": "adamw", "eps": 0}}})"),
            "job.json: /trainer/optimizer/eps: expected an epsilon in (0, 1], got 0");
  // Half-open ranges take everything up to the open end.
  EXPECT_NO_THROW(parseJobSpec(R"({"trainer": {"model": {"layers": [16, 4]}, "optimizer": {"momentum": 0.9999999}}})", "job.json"));
}

TEST(JobSpec, NumbersAreJsonNumbers) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nproc_per_node": "2"})"),
            "job.json: /nproc_per_node: expected a worker count between 1 and 4096 or \"auto\", got the string \"2\"; numbers "
            "are JSON numbers: write it without quotes");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "max_restarts": "3"})"),
            "job.json: /max_restarts: expected an integer between 0 and 1000000, got the string \"3\"; numbers are JSON "
            "numbers: write it without quotes");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "shutdown_timeout_s": "2.5"})"),
            "job.json: /shutdown_timeout_s: expected seconds between 0 and 86400, got the string \"2.5\"; numbers are JSON "
            "numbers: write it without quotes");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "nproc_per_node": "many"})"),
            "job.json: /nproc_per_node: expected a worker count between 1 and 4096 or \"auto\", got the string \"many\"");
  EXPECT_TRUE(parseJobSpec(R"({"command": ["true"], "nproc_per_node": "auto"})", "job.json").nproc_auto);
}

TEST(JobSpec, OneVariableNameRuleForEnvEnvFileAndCli) {
  const std::string rule = "bad variable name \"1A\"; names are letters, digits and '_', not starting with a digit";
  EXPECT_EQ(errorOf(R"({"command": ["true"], "env": {"1A": "x"}})"), "job.json: /env/1A: " + rule);
  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  Overrides o;
  o.env = {"1A=x"};
  try {
    applyOverrides(s, o);
    ADD_FAILURE() << "--env 1A=x accepted";
  } catch (const SpecError& e) {
    EXPECT_EQ(std::string(e.what()), "--env: " + rule);
  }
  try {
    parseEnvFile("1A=x\n", "vars.env");
    ADD_FAILURE() << "1A=x accepted in an env file";
  } catch (const SpecError& e) {
    EXPECT_EQ(std::string(e.what()), "vars.env:1: " + rule + " (no spaces around '=')");
  }
  for (const char* name : {"A.B", "A-B", "A B", "É"})
    EXPECT_NE(errorOf(std::string(R"({"command": ["true"], "env": {")") + name + R"(": "x"}})").find("bad variable name"),
              std::string::npos)
        << name;
  EXPECT_EQ(parseJobSpec(R"({"command": ["true"], "env": {"_a1": "x"}})", "job.json").env.at("_a1"), "x");
}

TEST(JobSpec, CwdThatIsAFileIsNotADirectory) {
  EXPECT_EQ(errorOf(R"({"command": ["true"], "cwd": "/etc/passwd"})"),
            "job.json: /cwd: \"/etc/passwd\" is not a directory; give the directory the workers start in");
  EXPECT_EQ(errorOf(R"({"command": ["true"], "cwd": "/nonexistent/dir"})"), "job.json: /cwd: directory \"/nonexistent/dir\" does not exist");
}

TEST(JobSpec, CliRangesAreStated) {
  JobSpec s = parseJobSpec(R"({"command": ["true"]})", "job.json");
  auto cliError = [&](const Overrides& o) -> std::string {
    try {
      applyOverrides(s, o);
    } catch (const SpecError& e) {
      return e.what();
    }
    return "(no error)";
  };
  Overrides nproc;
  nproc.nproc_per_node = "5000";
  EXPECT_EQ(cliError(nproc), "--nproc-per-node: expected a worker count between 1 and 4096 or \"auto\", got \"5000\"");
  Overrides restarts;
  restarts.max_restarts = 2000000;
  EXPECT_EQ(cliError(restarts), "--max-restarts: expected an integer between 0 and 1000000, got 2000000");
  Overrides nnodes;
  nnodes.nnodes = "1:5000";
  EXPECT_EQ(cliError(nnodes), "--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX <= 4096, got \"1:5000\"");
}

TEST(Strings, ClosestMatch) {
  EXPECT_EQ(closestMatch("comand", {"command", "cwd", "env"}), "command");
  EXPECT_EQ(closestMatch("zzzzzz", {"command", "cwd", "env"}), "");
  EXPECT_EQ(editDistance("kitten", "sitting"), 3u);
}

TEST(Strings, SignalNames) {
  EXPECT_EQ(signalName(11), "SIGSEGV");
  EXPECT_EQ(signalName(9), "SIGKILL");
}

TEST(ErrorFile, ReadsRecordFormatAndPlainText) {
  std::string path = ::testing::TempDir() + "/dtrain_error_file_test.json";
  {
    std::ofstream f(path);
    f << R"({"message": {"message": "RuntimeError: x", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1"}}})";
  }
  auto e = readWorkerErrorFile(path);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "RuntimeError: x");
  EXPECT_EQ(e->traceback, "Traceback...");
  {
    std::ofstream f(path);
    f << "not json";
  }
  e = readWorkerErrorFile(path);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "not json");
  EXPECT_FALSE(readWorkerErrorFile(path + ".missing"));
}

// A message or traceback of megabytes (a worker that dumped its state into it) is cut to
// what a report can show: the message's beginning, the traceback's end (the exception).
TEST(ErrorFile, CutsHugeMessagesAndTracebacks) {
  std::string path = ::testing::TempDir() + "/dtrain_error_file_big.json";
  std::string msg = "RuntimeError: boom " + std::string(3 << 20, 'm');
  std::string tb = "Traceback (most recent call last):\n" + std::string(3 << 20, 't') + "\nValueError: the end";
  ASSERT_TRUE(writeWorkerErrorFile(path, {msg, tb}));
  auto e = readWorkerErrorFile(path);
  ASSERT_TRUE(e);
  EXPECT_LT(e->message.size(), 70u << 10);
  EXPECT_EQ(e->message.rfind("RuntimeError: boom mmm", 0), 0u);
  EXPECT_NE(e->message.find(" bytes more cut)"), std::string::npos) << e->message.substr(e->message.size() - 80);
  EXPECT_LT(e->traceback.size(), 70u << 10);
  EXPECT_EQ(e->traceback.rfind("(... ", 0), 0u);
  EXPECT_NE(e->traceback.find("\nValueError: the end"), std::string::npos);
  EXPECT_EQ(e->traceback.substr(e->traceback.size() - 20), "\nValueError: the end");
  // Over 16 MiB: not parsed (it would be cut mid-JSON), said, with its beginning.
  ASSERT_TRUE(writeWorkerErrorFile(path, {std::string(17 << 20, 'x'), ""}));
  e = readWorkerErrorFile(path);
  ASSERT_TRUE(e);
  EXPECT_LT(e->message.size(), 70u << 10);
  EXPECT_EQ(e->message.rfind("(the error file is over 16 MiB; not read as a record; its beginning:) {\"message\"", 0), 0u)
      << e->message.substr(0, 120);
}

TEST(Summary, TrainerOutcomeRoundTripsAStoppedRun) {
  const std::string path = ::testing::TempDir() + "/dtrain_outcome_test.json";
  TrainerOutcome stopped;
  stopped.steps = 41;
  stopped.checkpoint = "/ck/ckpt-0000000041.bin";
  stopped.stopped = true;
  writeTrainerOutcome(path, stopped);
  auto back = readTrainerOutcome(path);
  ASSERT_TRUE(back);
  EXPECT_TRUE(back->stopped);
  EXPECT_EQ(back->steps, 41);
  EXPECT_EQ(back->checkpoint, "/ck/ckpt-0000000041.bin");
  EXPECT_EQ(back->weights_sha256, "");
  EXPECT_FALSE(back->final_loss);
  RunSummary sum;
  sum.trainer = *back;
  const std::string j = toJson(sum);
  EXPECT_NE(j.find("\"weights_sha256\": null"), std::string::npos) << j;
  EXPECT_NE(j.find("\"stopped\": true"), std::string::npos) << j;
  TrainerOutcome done;
  done.steps = 150;
  done.weights_sha256 = "ab";
  writeTrainerOutcome(path, done);
  back = readTrainerOutcome(path);
  ASSERT_TRUE(back);
  EXPECT_FALSE(back->stopped);
  EXPECT_EQ(back->checkpoint, "");
  EXPECT_EQ(back->weights_sha256, "ab");
  std::filesystem::remove(path);
}

TEST(ErrorFile, WritesWhatItReads) {
  std::string path = ::testing::TempDir() + "/dtrain_error_file_write_test.json";
  ASSERT_TRUE(writeWorkerErrorFile(path, {"job.json: /trainer/checkpoint/dir: \"ck\" cannot be written\nsecond", ""}));
  auto e = readWorkerErrorFile(path);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->message, "job.json: /trainer/checkpoint/dir: \"ck\" cannot be written\nsecond");
  EXPECT_EQ(e->traceback, "");
  EXPECT_FALSE(writeWorkerErrorFile("/nonexistent-dir/x.json", {"m", ""}));
}

}  // namespace
}  // namespace dtrain::spec

// AdamW takes PyTorch's defaults (lr 1e-3, weight decay 0.01), not SGD's lr of 0.05.
TEST(JobSpec, AdamWDefaultsArePyTorchs) {
  using dtrain::spec::parseJobSpec;
  auto s = parseJobSpec(R"({"trainer": {"model": {"layers": [4, 3]}, "optimizer": {"type": "adamw"}}})", "job.json");
  EXPECT_DOUBLE_EQ(s.trainer->optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(s.trainer->optimizer.weight_decay, 0.01);
  auto g = parseJobSpec(R"({"trainer": {"model": {"layers": [4, 3]}, "optimizer": {"type": "adamw", "lr": 0.01}}})", "job.json");
  EXPECT_DOUBLE_EQ(g.trainer->optimizer.lr, 0.01);
  auto d = parseJobSpec(R"({"trainer": {"model": {"layers": [4, 3]}}})", "job.json");
  EXPECT_DOUBLE_EQ(d.trainer->optimizer.lr, 0.05);
}
