#include "dtrain/launch/process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::launch {
namespace {

std::string readAll(const Fd& fd) {
  std::string s;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd.get(), buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
  return s;
}

int waitExit(pid_t pid) {
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

SpawnOptions shell(const std::string& script) {
  SpawnOptions so;
  so.argv = {"sh", "-c", script};
  for (char** e = environ; *e; ++e) so.env.emplace_back(*e);
  return so;
}

// One field of /proc/PID/status, e.g. "SigIgn".
std::string procStatus(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return line.substr(field.size() + 1);
  return "";
}

TEST(SpawnProcess, PipesEnvironmentAndExitCode) {
  SpawnOptions so = shell("echo out $DTRAIN_T; echo err >&2; exit 3");
  so.env.push_back("DTRAIN_T=42");
  Spawned c = spawnProcess(so);
  EXPECT_FALSE(c.in);
  EXPECT_EQ(readAll(c.out), "out 42\n");
  EXPECT_EQ(readAll(c.err), "err\n");
  EXPECT_EQ(waitExit(c.pid), 3);
}

// announce_fd: the child writes "W <its pid>\n" there itself, before exec (a guard learns of
// its group before the program can start anything), and the descriptor does not reach the
// program. A pipe with no reader costs the child nothing (its SIGPIPE is taken back).
TEST(SpawnProcess, AnnouncesItsGroupBeforeExec) {
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  Fd r(p[0]), w(p[1]);
  SpawnOptions so = shell("ls /proc/self/fd/" + std::to_string(w.get()) + " 2>/dev/null && echo leaked; echo ran");
  so.announce_fd = w.get();
  Spawned c = spawnProcess(so);
  w.reset();
  EXPECT_EQ(readAll(r), "W " + std::to_string(c.pid) + "\n");  // (written before spawnProcess returned)
  EXPECT_EQ(readAll(c.out), "ran\n");
  EXPECT_EQ(waitExit(c.pid), 0);

  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  Fd r2(p[0]), w2(p[1]);
  r2.reset();
  struct sigaction ign {}, old {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, &old);  // (as in dtrain)
  so = shell("echo ran");
  so.announce_fd = w2.get();
  Spawned d = spawnProcess(so);
  EXPECT_EQ(readAll(d.out), "ran\n");
  EXPECT_EQ(waitExit(d.pid), 0);
  ::sigaction(SIGPIPE, &old, nullptr);
}

// keep_fds: the child inherits those (at the same numbers), and nothing else of ours.
TEST(SpawnProcess, KeepsOnlyTheDescriptorsAskedFor) {
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  Fd r(p[0]), w(p[1]);
  const std::string probe = "for f in " + std::to_string(r.get()) + " " + std::to_string(w.get()) +
                            "; do if [ -e /proc/self/fd/$f ]; then echo yes; else echo no; fi; done";
  SpawnOptions so = shell(probe);
  so.keep_fds = {r.get()};
  Spawned c = spawnProcess(so);
  EXPECT_EQ(readAll(c.out), "yes\nno\n");
  EXPECT_EQ(waitExit(c.pid), 0);
  // (ours stays close-on-exec)
  EXPECT_EQ(::fcntl(r.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  Spawned d = spawnProcess(shell(probe));
  EXPECT_EQ(readAll(d.out), "no\nno\n");
  EXPECT_EQ(waitExit(d.pid), 0);
  // Nor one opened without O_CLOEXEC (by a library: Boost.Asio's acceptor was the store's
  // listening socket in every worker, and in what they left running), at any number.
  Fd plain(::open("/dev/null", O_RDONLY));
  ASSERT_TRUE(plain);
  Fd high(::fcntl(plain.get(), F_DUPFD, 700));
  ASSERT_TRUE(high);
  const std::string probe2 = "for f in " + std::to_string(plain.get()) + " " + std::to_string(high.get()) +
                             "; do if [ -e /proc/self/fd/$f ]; then echo yes; else echo no; fi; done";
  Spawned e = spawnProcess(shell(probe2));
  EXPECT_EQ(readAll(e.out), "no\nno\n");
  EXPECT_EQ(waitExit(e.pid), 0);
  EXPECT_EQ(::fcntl(plain.get(), F_GETFD) & FD_CLOEXEC, 0);  // (ours unchanged)
}

TEST(SpawnProcess, StdinIsDevNullOrAPipe) {
  Spawned a = spawnProcess(shell("cat; echo done"));
  EXPECT_EQ(readAll(a.out), "done\n");
  EXPECT_EQ(waitExit(a.pid), 0);

  SpawnOptions so = shell("cat");
  so.stdin_pipe = true;
  Spawned b = spawnProcess(so);
  ASSERT_TRUE(b.in);
  ASSERT_EQ(::write(b.in.get(), "hello\n", 6), 6);
  b.in.reset();
  EXPECT_EQ(readAll(b.out), "hello\n");
  EXPECT_EQ(waitExit(b.pid), 0);
}

TEST(SpawnProcess, WorkingDirectory) {
  SpawnOptions so = shell("pwd");
  so.cwd = "/";
  Spawned c = spawnProcess(so);
  EXPECT_EQ(readAll(c.out), "/\n");
  EXPECT_EQ(waitExit(c.pid), 0);

  so.cwd = "/no/such/dir";
  Spawned d = spawnProcess(so);
  EXPECT_EQ(readAll(d.err), "dtrain: error: cannot chdir to cwd: No such file or directory\n");
  EXPECT_EQ(waitExit(d.pid), 126);
}

TEST(SpawnProcess, ProgramThatCannotRunExitsLikeAShell) {
  SpawnOptions so = shell("");
  so.argv = {"dtrain-no-such-program"};
  Spawned c = spawnProcess(so);
  EXPECT_EQ(readAll(c.err), "dtrain: error: cannot run 'dtrain-no-such-program': No such file or directory\n");
  EXPECT_EQ(waitExit(c.pid), 127);

  char path[] = "/tmp/dtrain-spawn-XXXXXX";  // exists, not executable
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  so.argv = {path};
  Spawned d = spawnProcess(so);
  EXPECT_EQ(readAll(d.err), std::string("dtrain: error: cannot run '") + path + "': Permission denied\n");
  EXPECT_EQ(waitExit(d.pid), 126);
  ::unlink(path);
}

// A script whose #! interpreter is missing: exec's ENOENT would blame the script itself; the
// child names the interpreter (for what the launch's pre-check did not see).
TEST(SpawnProcess, MissingInterpreterIsNamed) {
  char path[] = "/tmp/dtrain-spawn-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string body = "#!/nonexistent/python -u\nprint(1)\n";
  ASSERT_EQ(::write(fd, body.data(), body.size()), static_cast<ssize_t>(body.size()));
  ::fchmod(fd, 0700);
  ::close(fd);
  EXPECT_EQ(shebangProblem(path, "/usr/bin:/bin", ""), "its interpreter /nonexistent/python (#! line) does not exist");
  SpawnOptions so = shell("");
  so.argv = {path};
  Spawned c = spawnProcess(so);
  EXPECT_EQ(readAll(c.err), std::string("dtrain: error: cannot run '") + path +
                                "': its interpreter /nonexistent/python (#! line) does not exist\n");
  EXPECT_TRUE(c.start_failed);
  EXPECT_EQ(waitExit(c.pid), 127);
  ::unlink(path);
}

TEST(ShebangProblem, InterpreterChecks) {
  char path[] = "/tmp/dtrain-shebang-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  auto with = [&](const std::string& body) {
    std::ofstream(path, std::ios::trunc) << body;
    return shebangProblem(path, "/usr/bin:/bin", "");
  };
  EXPECT_EQ(with("echo no interpreter line\n"), "");
  EXPECT_EQ(with("#!/bin/sh\necho hi\n"), "");
  EXPECT_EQ(with("#! /bin/sh -e\n"), "");
  EXPECT_EQ(with("#!/usr/bin/env sh\n"), "");
  EXPECT_EQ(with("#!\n"), "its #! line names no interpreter");
  EXPECT_EQ(with("#!/etc/passwd\n"), "its interpreter /etc/passwd (#! line) is not an executable file");
  EXPECT_EQ(with("#!/usr/bin/env dtrain-no-such-interp\n"),
            "its #! line runs dtrain-no-such-interp through /usr/bin/env, and there is no dtrain-no-such-interp on PATH");
  EXPECT_EQ(with("#!/usr/bin/env sh -e \n"),
            "its #! line gives /usr/bin/env \"sh -e\" as one word (Linux does not split the #! line), a program that "
            "does not exist; write #!/usr/bin/env -S sh -e, or run the interpreter itself");
  EXPECT_EQ(with("#!/usr/bin/env -S sh -e\n"), "");
  EXPECT_EQ(with("#!/bin/sh -e\r\n"), "");  // the '\r' is the argument's: exec runs sh (sh may object)
  EXPECT_NE(with("#!/bin/sh\r\n").find("its interpreter /bin/sh\\r (#! line) does not exist (the #! line ends in \\r"),
            std::string::npos);
  ::unlink(path);
}

// The child gets its own process group and none of our signal state: dtrain ignores SIGPIPE
// and blocks every signal around the spawn, a worker must see neither.
TEST(SpawnProcess, OwnProcessGroupAndDefaultSignals) {
  struct sigaction ign {}, oldPipe {};
  ign.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ign, &oldPipe);
  sigset_t usr1, before, after;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ::pthread_sigmask(SIG_BLOCK, &usr1, &before);

  Spawned c = spawnProcess(shell("read x"));  // waits for stdin: /dev/null ends it at once
  Spawned s = spawnProcess([] {
    SpawnOptions so = shell("read x");
    so.stdin_pipe = true;  // runs until we close it
    return so;
  }());
  EXPECT_EQ(waitExit(c.pid), 1);
  EXPECT_EQ(::getpgid(s.pid), s.pid);
  // SIGPIPE is bit 13 of SigIgn: dash itself ignores nothing.
  unsigned long long ignored = std::stoull(procStatus(s.pid, "SigIgn"), nullptr, 16);
  EXPECT_EQ(ignored & (1ull << (SIGPIPE - 1)), 0u);
  unsigned long long blocked = std::stoull(procStatus(s.pid, "SigBlk"), nullptr, 16);
  EXPECT_EQ(blocked, 1ull << (SIGUSR1 - 1)) << "the caller's mask, and only it";
  s.in.reset();
  EXPECT_EQ(waitExit(s.pid), 1);

  ::pthread_sigmask(SIG_SETMASK, nullptr, &after);
  EXPECT_EQ(sigismember(&after, SIGUSR1), 1);
  EXPECT_EQ(sigismember(&after, SIGTERM), 0) << "our own mask is restored";
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  ::sigaction(SIGPIPE, &oldPipe, nullptr);
}

// Spawns from several threads at once (the child borrows the spawning thread's memory):
// every child runs its own command and every parent gets its own pipes.
TEST(SpawnProcess, ConcurrentSpawnsFromThreads) {
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([t, &bad] {
      for (int i = 0; i < 25; ++i) {
        std::string tag = std::to_string(t) + "." + std::to_string(i);
        Spawned c = spawnProcess(shell("echo " + tag + "; exit " + std::to_string(i % 7)));
        if (readAll(c.out) != tag + "\n") ++bad;
        int status = 0;
        if (::waitpid(c.pid, &status, 0) != c.pid || !WIFEXITED(status) || WEXITSTATUS(status) != i % 7) ++bad;
      }
    });
  for (auto& th : ts) th.join();
  EXPECT_EQ(bad.load(), 0);
}


// Runs body() in a forked process in a process group of its own (so that it may signal its
// whole group) and returns its exit code; a body still running after 60 s is killed and
// reported as 99 (a spawn that never returned).
template <typename F>
int inOwnProcessGroup(F body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::_exit(body());
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-pid, SIGCONT);
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return 99;
    }
    ::usleep(10000);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

pid_t gStressMain = 0;
std::atomic<int> gHandlerInChild{0};
void stressHandler(int) {
  if (static_cast<pid_t>(::syscall(SYS_getpid)) != gStressMain) gHandlerInChild.fetch_add(1);
}

// The child shares our memory until exec: no handler of ours may run in it, though signals
// for our process group (which it is in until it makes its own) keep arriving. Nor may they
// kill or stop it: a stopped child would hold the spawning thread forever. Three threads
// spawn while a fourth sends SIGUSR2, SIGWINCH and SIGTSTP (all caught here) to the group.
TEST(SpawnProcess, SignalsForOurGroupNeverReachTheChildBeforeExec) {
  int rc = inOwnProcessGroup([] {
    gStressMain = ::getpid();
    struct sigaction sa {};
    sa.sa_handler = stressHandler;
    sa.sa_flags = SA_RESTART;
    for (int sig : {SIGUSR2, SIGWINCH, SIGTSTP}) ::sigaction(sig, &sa, nullptr);
    std::atomic<bool> stop{false};
    std::thread killer([&] {
      while (!stop)
        for (int sig : {SIGUSR2, SIGWINCH, SIGTSTP}) ::kill(0, sig);
    });
    std::atomic<int> bad{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 3; ++t)
      ts.emplace_back([&] {
        for (int i = 0; i < 100; ++i) {
          SpawnOptions so;
          so.argv = {"/bin/true"};
          Spawned c = spawnProcess(so);
          int st = 0;
          if (::waitpid(c.pid, &st, 0) != c.pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) ++bad;
        }
      });
    for (auto& th : ts) th.join();
    stop = true;
    killer.join();
    if (gHandlerInChild.load() != 0) return 1;
    return bad.load() == 0 ? 0 : 2;
  });
  EXPECT_NE(rc, 1) << "a handler of ours ran in a child before its exec";
  EXPECT_NE(rc, 2) << "a child was killed or failed by a signal meant for us";
  EXPECT_NE(rc, 99) << "a spawn never returned (a child stopped before exec?)";
  EXPECT_EQ(rc, 0);
}

// A program that cannot be run is reported as such, whatever its exit code; one that runs
// and exits 127 itself is not.
TEST(SpawnProcess, ReportsAProgramThatCannotBeStarted) {
  SpawnOptions so = shell("");
  so.argv = {"dtrain-no-such-program-xyz"};
  Spawned c = spawnProcess(so);
  EXPECT_TRUE(c.start_failed);
  EXPECT_EQ(c.start_errno, ENOENT);
  EXPECT_NE(readAll(c.err).find("cannot run 'dtrain-no-such-program-xyz'"), std::string::npos);
  EXPECT_EQ(waitExit(c.pid), 127);

  so = shell("");
  so.argv = {"true"};
  so.cwd = "/nonexistent-dtrain-dir";
  Spawned d = spawnProcess(so);
  EXPECT_TRUE(d.start_failed);
  EXPECT_EQ(waitExit(d.pid), 126);

  Spawned e = spawnProcess(shell("exit 127"));
  EXPECT_FALSE(e.start_failed);
  EXPECT_EQ(waitExit(e.pid), 127);
}

// merge_stderr: one pipe, in the order written.
TEST(SpawnProcess, MergedStderrKeepsOrder) {
  SpawnOptions so = shell("for i in 1 2 3; do echo out$i; echo err$i >&2; done");
  so.merge_stderr = true;
  Spawned c = spawnProcess(so);
  EXPECT_FALSE(c.err);
  EXPECT_EQ(readAll(c.out), "out1\nerr1\nout2\nerr2\nout3\nerr3\n");
  EXPECT_EQ(waitExit(c.pid), 0);
}

// dtrain started with stdin and stdout closed: pipe2 then returns 0 and 1, and the child's
// dup2s must neither leave them close-on-exec nor overwrite one with another.
TEST(SpawnProcess, WorksWithStdioClosed) {
  int rc = inOwnProcessGroup([] {
    ::close(STDIN_FILENO);
    ::close(STDOUT_FILENO);
    Spawned c = spawnProcess(shell("echo out; echo err >&2"));
    if (readAll(c.out) != "out\n") return 1;
    if (readAll(c.err) != "err\n") return 2;
    int st = 0;
    return ::waitpid(c.pid, &st, 0) == c.pid && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 3;
  });
  EXPECT_EQ(rc, 0) << "1: stdout lost, 2: stderr lost, 3: bad exit";
}

// An executable without #! runs under /bin/sh (execvpe copies argv onto the child's stack
// for it: the stack is sized by argc), as a shell would.
TEST(SpawnProcess, ScriptWithoutInterpreterLineAndManyArguments) {
  char path[] = "/tmp/dtrain-script-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  std::string body = "echo $# \"$1\" \"$40000\"\n";
  ASSERT_EQ(::write(fd, body.data(), body.size()), static_cast<ssize_t>(body.size()));
  ::fchmod(fd, 0700);
  ::close(fd);
  SpawnOptions so = shell("");
  so.argv = {path};
  for (int i = 1; i <= 40000; ++i) so.argv.push_back("a" + std::to_string(i));
  Spawned c = spawnProcess(so);
  EXPECT_EQ(readAll(c.out), "40000 a1 a40000\n");
  EXPECT_EQ(waitExit(c.pid), 0);
  ::unlink(path);
}
}  // namespace
}  // namespace dtrain::launch
