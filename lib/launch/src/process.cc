#include "dtrain/launch/process.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
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

namespace {

// Output for the child between clone and exec: it shares our memory while other threads of
// ours (the job store's io thread) keep running, so it must not touch malloc, locale or
// stdio locks, which rules out strerror there. The texts are fetched before the first clone,
// for the errors execve and chdir can give.
struct ErrnoTexts {
  static constexpr int kMax = 134;  // > every errno execve/chdir return on Linux
  const char* text[kMax] = {};
  ErrnoTexts() {
    for (int e : {E2BIG, EACCES, EFAULT, EINVAL, EIO, EISDIR, ELIBBAD, ELOOP, EMFILE, ENAMETOOLONG,
                  ENFILE, ENOENT, ENOEXEC, ENOMEM, ENOTDIR, EPERM, ETXTBSY})
      if (e < kMax) text[e] = ::strdup(std::strerror(e));
  }
};

const ErrnoTexts& errnoTexts() {
  static const ErrnoTexts texts;  // strdup'ed once, never freed
  return texts;
}

void writeStr(int fd, const char* s) { (void)!::write(fd, s, std::strlen(s)); }

// "errno N" for the rare error without a prepared text, without snprintf.
void writeErrno(int fd, const ErrnoTexts& texts, int e) {
  if (e > 0 && e < ErrnoTexts::kMax && texts.text[e]) return writeStr(fd, texts.text[e]);
  char buf[24];
  char* p = buf + sizeof(buf);
  *--p = '\0';
  unsigned v = e < 0 ? 0u : static_cast<unsigned>(e);
  do *--p = static_cast<char>('0' + v % 10); while ((v /= 10) != 0);
  writeStr(fd, "errno ");
  writeStr(fd, p);
}

// What the child reads between clone and exec; prepared by the parent, never written by
// the child.
struct ChildArgs {
  char* const* argv;
  char* const* envp;
  const char* cwd;  // nullptr = ours
  int outFd, errFd, inFd;  // inFd < 0: /dev/null
  pid_t parent;
  sigset_t mask;  // the caller's, restored in the child before exec
  const std::string* execError;
  const ErrnoTexts* texts;
};

// Runs on its own stack in our address space (CLONE_VM | CLONE_VFORK) until it exec's or
// exits: system calls only, no writes to memory of ours but its own stack (and errno).
int childMain(void* p) {
  const ChildArgs& a = *static_cast<const ChildArgs*>(p);
  // Signal dispositions are the child's own (no CLONE_SIGHAND): reset ours while every signal
  // is still blocked, so that no handler of dtrain's ever runs here.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(sig, &dfl, nullptr);
  }
  ::sigprocmask(SIG_SETMASK, &a.mask, nullptr);
  ::setpgid(0, 0);
  // The child dies with dtrain; the getppid check closes the race where dtrain died before
  // prctl ran.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != a.parent) ::_exit(1);
  ::dup2(a.outFd, STDOUT_FILENO);
  ::dup2(a.errFd, STDERR_FILENO);
  if (a.inFd >= 0) {
    ::dup2(a.inFd, STDIN_FILENO);
  } else {
    int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
  }
  if (a.cwd && ::chdir(a.cwd) != 0) {
    int e = errno;
    writeStr(STDERR_FILENO, "dtrain: error: cannot chdir to cwd: ");
    writeErrno(STDERR_FILENO, *a.texts, e);
    writeStr(STDERR_FILENO, "\n");
    ::_exit(126);
  }
  ::execvpe(a.argv[0], a.argv, a.envp);
  int e = errno;
  (void)!::write(STDERR_FILENO, a.execError->data(), a.execError->size());
  writeErrno(STDERR_FILENO, *a.texts, e);
  writeStr(STDERR_FILENO, "\n");
  ::_exit(e == ENOENT ? 127 : 126);
}

// The child's stack: execvpe puts the PATH candidate (<= PATH_MAX + NAME_MAX) and, for a
// script without #!, a copy of argv on it.
constexpr size_t kChildStack = 256 * 1024;

}  // namespace

Spawned spawnProcess(const SpawnOptions& opts) {
  auto [outR, outW] = makePipe();
  auto [errR, errW] = makePipe();
  Fd inR, inW;
  if (opts.stdin_pipe) std::tie(inR, inW) = makePipe();
  std::vector<std::string> envStrings = opts.env;
  std::vector<std::string> args = opts.argv;
  std::vector<char*> envp, argv;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string execError = "dtrain: error: cannot run '" + opts.argv.at(0) + "': ";
  ChildArgs ca{};
  ca.argv = argv.data();
  ca.envp = envp.data();
  ca.cwd = opts.cwd.empty() ? nullptr : opts.cwd.c_str();
  ca.outFd = outW.get();
  ca.errFd = errW.get();
  ca.inFd = inR ? inR.get() : -1;
  ca.parent = ::getpid();
  ca.execError = &execError;
  ca.texts = &errnoTexts();

  void* stack = ::mmap(nullptr, kChildStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) throwErrno("mmap (child stack)");
  // clone(CLONE_VM | CLONE_VFORK) as posix_spawn does, not fork: the child borrows our
  // address space until exec, so no page tables are copied and no copy-on-write faults
  // follow; the launcher's cost per worker fell from ~4.5 ms to ~1 ms (docs/PERFORMANCE.md).
  // We are suspended until the child has exec'ed or exited. posix_spawn itself cannot set
  // PR_SET_PDEATHSIG.
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &ca.mask);  // no handler of ours may run in the child
  pid_t pid = ::clone(childMain, static_cast<char*>(stack) + kChildStack, CLONE_VM | CLONE_VFORK | SIGCHLD, &ca);
  int cloneErrno = errno;  // the child shares our errno until it exec'ed: read only on failure
  ::pthread_sigmask(SIG_SETMASK, &ca.mask, nullptr);
  ::munmap(stack, kChildStack);
  if (pid < 0) {
    errno = cloneErrno;
    throwErrno("clone");
  }
  // The child put itself in its own process group before exec (setpgid from here would
  // fail with EACCES now that it has exec'ed).
  Spawned s;
  s.pid = pid;
  s.in = std::move(inW);
  s.out = std::move(outR);
  s.err = std::move(errR);
  return s;
}

}  // namespace dtrain::launch
