#include "dtrain/launch/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <tuple>

#include "dtrain/common/errors.h"

namespace dtrain::launch {

std::pair<Fd, Fd> makePipe() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throwErrno("pipe");
  return {Fd(p[0]), Fd(p[1])};
}

Spawned spawnProcess(const SpawnOptions& opts) {
  auto [outR, outW] = makePipe();
  auto [errR, errW] = makePipe();
  Fd inR, inW;
  if (opts.stdin_pipe) std::tie(inR, inW) = makePipe();
  // Everything the child needs is built before fork(): only async-signal-safe calls after.
  std::vector<std::string> envStrings = opts.env;
  std::vector<std::string> args = opts.argv;
  std::vector<char*> envp, argv;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string execError = "dtrain: error: cannot run '" + opts.argv.at(0) + "': ";
  const char* cwd = opts.cwd.empty() ? nullptr : opts.cwd.c_str();
  pid_t parent = ::getpid();

  sigset_t all, old;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &old);  // no handler of ours may run in the child
  pid_t pid = ::fork();
  if (pid < 0) {
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    throwErrno("fork");
  }
  if (pid == 0) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) ::signal(sig, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    ::setpgid(0, 0);
    // The child dies with dtrain; the getppid check closes the race where dtrain died
    // before prctl ran.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::dup2(outW.get(), STDOUT_FILENO);
    ::dup2(errW.get(), STDERR_FILENO);
    if (inR) {
      ::dup2(inR.get(), STDIN_FILENO);
    } else {
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    }
    if (cwd && ::chdir(cwd) != 0) {
      const char* e = std::strerror(errno);
      (void)!::write(STDERR_FILENO, "dtrain: error: cannot chdir to cwd: ", 36);
      (void)!::write(STDERR_FILENO, e, std::strlen(e));
      (void)!::write(STDERR_FILENO, "\n", 1);
      ::_exit(126);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    int code = errno == ENOENT ? 127 : 126;
    const char* e = std::strerror(errno);
    (void)!::write(STDERR_FILENO, execError.data(), execError.size());
    (void)!::write(STDERR_FILENO, e, std::strlen(e));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(code);
  }
  ::setpgid(pid, pid);  // both sides set it, so it holds whichever runs first
  ::sigprocmask(SIG_SETMASK, &old, nullptr);
  Spawned s;
  s.pid = pid;
  s.in = std::move(inW);
  s.out = std::move(outR);
  s.err = std::move(errR);
  return s;
}

}  // namespace dtrain::launch
