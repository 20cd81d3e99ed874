#include "dtrain/launch/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/fd_limit.h"
#include "dtrain/common/strings.h"

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
  const char* path;  // the program exec runs, resolved by the parent; nullptr = not found
  char* const* argv;
  char* const* envp;
  const char* cwd;  // nullptr = ours
  int outFd, errFd, inFd;  // inFd < 0: /dev/null
  int statusFd;            // close-on-exec: closed by a successful exec, else gets errno
  pid_t parent;
  sigset_t mask;  // the caller's, restored in the child before exec
  const std::string* execError;
  const std::string* shebangError;  // the whole line for a failed exec, when the #! line is why
  const ErrnoTexts* texts;
  const int* keepFds;  // SpawnOptions::keep_fds
  size_t keepCount;
  int maxFd;  // the highest descriptor number possible (RLIMIT_NOFILE), for the fallback below
  int announceFd;  // SpawnOptions::announce_fd
  const rlimit* fdLimit;  // the descriptor limit dtrain found (fd_limit.h), restored; nullptr = ours
  const int* blockedSigs;  // SpawnOptions::blocked_signals
  size_t blockedCount;
};

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
constexpr unsigned kCloseRangeCloexec = 1u << 2;  // CLOSE_RANGE_CLOEXEC (linux/close_range.h)

// The highest descriptor number open in this process (from /proc/self/fd; where that cannot
// be read, the limit's highest).
int highestOpenFd() {
  int highest = STDERR_FILENO;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return static_cast<int>(std::clamp<long>(::sysconf(_SC_OPEN_MAX), 1024, 1 << 20)) - 1;
  while (const dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0') highest = std::max(highest, static_cast<int>(fd));
  }
  ::closedir(d);
  // (descriptors opened by other threads between now and the child's loop: close-on-exec
  // ones all, O_CLOEXEC everywhere in dtrain, but for Asio's sockets: a margin for those)
  return highest + 64;
}

[[noreturn]] void childFail(const ChildArgs& a, const char* what, int e, int code) {
  // The parent reads this once clone returns (the child has exited by then): whatever the
  // exit code, it then knows the program never ran.
  (void)!::write(a.statusFd, &e, sizeof(e));
  writeStr(STDERR_FILENO, what);
  writeErrno(STDERR_FILENO, *a.texts, e);
  writeStr(STDERR_FILENO, "\n");
  ::_exit(code);
}

// Runs on its own stack in our address space (CLONE_VM | CLONE_VFORK) until it exec's or
// exits: system calls only, no writes to memory of ours but its own stack (and errno).
// Every signal stays blocked until just before exec.
int childMain(void* p) {
  const ChildArgs& a = *static_cast<const ChildArgs*>(p);
  // Signal dispositions are the child's own (no CLONE_SIGHAND). A handler of ours (dtrain's,
  // or a library's) must never run here, on our memory: every caught signal goes back to
  // SIG_DFL, and SIGPIPE, which dtrain ignores, too, as a worker expects. What arrives for
  // those before exec was meant for dtrain (sent to its process group, which the child is
  // in until setsid), so it is dropped below rather than delivered with the default action;
  // so are terminal stop signals, which would stop the child while we wait for its exec.
  sigset_t drop;
  sigemptyset(&drop);
  for (int sig : {SIGTSTP, SIGTTIN, SIGTTOU}) sigaddset(&drop, sig);
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction cur {};
    if (::sigaction(sig, nullptr, &cur) != 0) continue;  // glibc's internal ones: EINVAL
    if (cur.sa_handler == SIG_DFL || (cur.sa_handler == SIG_IGN && sig != SIGPIPE)) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(sig, &dfl, nullptr);
    if (sig != SIGPIPE) sigaddset(&drop, sig);
  }
  // Its own session, and so its own process group, so that dtrain can signal a worker with
  // everything it started. A session rather than only a group (as torchrun's
  // start_new_session): without a controlling terminal, a worker that opens /dev/tty (getpass,
  // an ssh password prompt) gets ENXIO and its library's fallback, where a background group of
  // dtrain's session read it and was stopped by SIGTTIN, silently and for good.
  if (::setsid() < 0) childFail(a, "dtrain: error: cannot start a worker: setsid: ", errno, 126);
  // The child dies with dtrain; the getppid check closes the race where dtrain died before
  // prctl ran.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != a.parent) ::_exit(1);
  // The guard learns of this group before the program can start anything (one write, far
  // below PIPE_BUF: whole). A guard that is gone only costs its protection: the SIGPIPE
  // that write raised (blocked here, and SIGPIPE now at its default) is taken back.
  if (a.announceFd >= 0) {
    char line[32];
    char* e = line + sizeof(line);
    char* q = e;
    *--q = '\n';
    unsigned long v = static_cast<unsigned long>(::syscall(SYS_getpid));
    do *--q = static_cast<char>('0' + v % 10); while ((v /= 10) != 0);
    *--q = ' ';
    *--q = 'W';
    if (::write(a.announceFd, q, static_cast<size_t>(e - q)) < 0 && errno == EPIPE) {
      sigset_t pipeSet;
      sigemptyset(&pipeSet);
      sigaddset(&pipeSet, SIGPIPE);
      struct timespec zero {};
      ::sigtimedwait(&pipeSet, nullptr, &zero);
    }
  }
  // The parent keeps these three above 2, so no dup2 below overwrites a later source.
  if (::dup2(a.outFd, STDOUT_FILENO) < 0 || ::dup2(a.errFd, STDERR_FILENO) < 0)
    childFail(a, "dtrain: error: cannot start a worker: dup2: ", errno, 126);
  int in = a.inFd >= 0 ? a.inFd : ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (in < 0 || ::dup2(in, STDIN_FILENO) < 0) childFail(a, "dtrain: error: cannot start a worker: stdin: ", errno, 126);
  if (a.cwd && ::chdir(a.cwd) != 0) childFail(a, "dtrain: error: cannot chdir to cwd: ", errno, 126);
  // (our descriptor table is the child's own copy: no CLONE_FILES)
  // Nothing of ours but keep_fds reaches the program, whoever opened it without O_CLOEXEC
  // (Boost.Asio's acceptor: the store's listening port lived on in an orphaned worker's
  // child, and the next run could not bind it). Kernels before 5.11: one fcntl a number.
  if (::syscall(SYS_close_range, 3u, ~0u, kCloseRangeCloexec) != 0)
    for (int fd = 3; fd <= a.maxFd; ++fd) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  for (size_t i = 0; i < a.keepCount; ++i)
    if (::fcntl(a.keepFds[i], F_SETFD, 0) != 0) childFail(a, "dtrain: error: cannot start a worker: fcntl: ", errno, 126);
  if (a.fdLimit) ::setrlimit(RLIMIT_NOFILE, a.fdLimit);  // (lowering the soft limit cannot fail)
  struct timespec zero {};
  while (::sigtimedwait(&drop, nullptr, &zero) > 0) {
  }
  sigset_t mask = a.mask;
  for (size_t i = 0; i < a.blockedCount; ++i) sigaddset(&mask, a.blockedSigs[i]);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  // execvpe with a path that has a '/' does not search PATH (our PATH, not the worker's:
  // the parent searched the worker's); it still hands a script without #! to /bin/sh.
  int e = ENOENT;
  if (a.path) {
    ::execvpe(a.path, a.argv, a.envp);
    e = errno;
  }
  if (a.path && !a.shebangError->empty() && (e == ENOENT || e == EACCES)) {
    // The script exists: ENOENT is its interpreter's, which strerror alone would blame on it.
    (void)!::write(a.statusFd, &e, sizeof(e));
    (void)!::write(STDERR_FILENO, a.shebangError->data(), a.shebangError->size());
    ::_exit(e == ENOENT ? 127 : 126);
  }
  (void)!::write(STDERR_FILENO, a.execError->data(), a.execError->size());
  childFail(a, "", e, e == ENOENT ? 127 : 126);
}

// The child's stack, with a PROT_NONE guard page below it. execvpe puts the PATH candidate
// (<= PATH_MAX + NAME_MAX) on it and, for a script without #!, a copy of argv.
class ChildStack {
 public:
  explicit ChildStack(size_t argc) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    size_t want = 64 * 1024 + PATH_MAX + NAME_MAX + (argc + 3) * sizeof(char*);
    size_ = (want + page - 1) / page * page + page;
    base_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (base_ == MAP_FAILED) throwErrno("mmap (a stack to start a worker on)");
    ::mprotect(base_, page, PROT_NONE);
  }
  ~ChildStack() { ::munmap(base_, size_); }
  ChildStack(const ChildStack&) = delete;
  ChildStack& operator=(const ChildStack&) = delete;
  void* top() const { return static_cast<char*>(base_) + size_; }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
};

// Moves fd above stdin/stdout/stderr (dtrain may have been started with some of them
// closed, and then pipe2 hands those numbers out), keeping it close-on-exec.
void aboveStdio(Fd& fd) {
  if (!fd || fd.get() > STDERR_FILENO) return;
  int moved = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, STDERR_FILENO + 1);
  if (moved < 0) throwErrno("fcntl(F_DUPFD_CLOEXEC)");
  fd = Fd(moved);
}

// The PATH a worker's bare program name is looked up on: its environment's, else ours.
const char* workerPath(const char* fromEnv) {
  if (fromEnv) return fromEnv;
  const char* ours = std::getenv("PATH");
  return ours ? ours : "/bin:/usr/bin";
}

}  // namespace

Spawned spawnProcess(const SpawnOptions& opts) {
  auto [outR, outW] = makePipe();
  Fd errR, errW;
  if (!opts.merge_stderr) std::tie(errR, errW) = makePipe();
  // Non-blocking: with CLONE_VFORK the child has written (or exec'ed) before we read, and a
  // write end inherited by another thread's child must not make the read wait.
  int sp[2];
  if (::pipe2(sp, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("pipe");
  Fd statusR(sp[0]), statusW(sp[1]);
  Fd inR, inW;
  if (opts.stdin_pipe) std::tie(inR, inW) = makePipe();
  aboveStdio(outW);
  aboveStdio(errW);
  aboveStdio(inR);
  aboveStdio(statusW);
  std::vector<std::string> envStrings = opts.env;
  std::vector<std::string> args = opts.argv;
  std::vector<char*> envp, argv;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string execError = "dtrain: error: cannot run '" + opts.argv.at(0) + "': ";
  // A bare name is looked up on the worker's PATH (its environment's, as a shell started with
  // that environment would), not on dtrain's, which is what execvpe would search.
  std::string program = opts.argv.at(0);
  if (program.find('/') == std::string::npos) {
    const char* pathVar = nullptr;
    for (const auto& kv : opts.env)
      if (kv.rfind("PATH=", 0) == 0) pathVar = kv.c_str() + 5;
    program = findProgram(program, workerPath(pathVar), opts.cwd);
  }
  // Prepared here, as the child may not allocate: a small read of the program's first bytes.
  std::string shebangError;
  if (!program.empty()) {
    const char* pathVar = nullptr;
    for (const auto& kv : opts.env)
      if (kv.rfind("PATH=", 0) == 0) pathVar = kv.c_str() + 5;
    if (std::string why = shebangProblem(program, workerPath(pathVar), opts.cwd); !why.empty())
      shebangError = "dtrain: error: cannot run '" + opts.argv.at(0) + "': " + why + "\n";
  }
  ChildArgs ca{};
  ca.path = program.empty() ? nullptr : program.c_str();
  ca.argv = argv.data();
  ca.envp = envp.data();
  ca.cwd = opts.cwd.empty() ? nullptr : opts.cwd.c_str();
  ca.outFd = outW.get();
  ca.errFd = opts.merge_stderr ? outW.get() : errW.get();
  ca.statusFd = statusW.get();
  ca.inFd = inR ? inR.get() : -1;
  ca.parent = ::getpid();
  ca.execError = &execError;
  ca.shebangError = &shebangError;
  ca.texts = &errnoTexts();
  for (int fd : opts.keep_fds) DTRAIN_CHECK(fd > STDERR_FILENO);
  ca.keepFds = opts.keep_fds.data();
  ca.keepCount = opts.keep_fds.size();
  // For the child's fallback where close_range cannot set close-on-exec (kernels before
  // 5.11): the highest descriptor open now, not the limit (raised to 65536, a loop of that
  // many fcntl calls per spawn).
  static const bool closeRangeWorks =
      ::syscall(SYS_close_range, static_cast<unsigned>(INT_MAX) - 1, static_cast<unsigned>(INT_MAX), kCloseRangeCloexec) == 0;
  ca.maxFd = closeRangeWorks ? 0 : highestOpenFd();
  ca.announceFd = opts.announce_fd;
  const std::optional<rlimit> fdLimit = fdLimitToRestore();
  ca.fdLimit = fdLimit ? &*fdLimit : nullptr;
  ca.blockedSigs = opts.blocked_signals.data();
  ca.blockedCount = opts.blocked_signals.size();

  ChildStack stack(argv.size());
  // clone(CLONE_VM | CLONE_VFORK) as posix_spawn does, not fork: the child borrows our
  // address space until exec, so no page tables are copied and no copy-on-write faults
  // follow (docs/PERFORMANCE.md: 8 workers launched in 31 ms instead of 50 ms).
  // posix_spawn itself cannot set PR_SET_PDEATHSIG. This thread is suspended until the
  // child has exec'ed or exited (an exec from a hung network mount holds it up too).
  sigset_t all;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &ca.mask);  // no handler of ours may run in the child
  pid_t pid = ::clone(childMain, stack.top(), CLONE_VM | CLONE_VFORK | SIGCHLD, &ca);
  int cloneErrno = errno;  // the child shares our errno until it exec'ed: read only on failure
  ::pthread_sigmask(SIG_SETMASK, &ca.mask, nullptr);
  if (pid < 0) {
    errno = cloneErrno;
    throwErrno("clone");
  }
  // The child put itself in its own session and process group before exec (setpgid from
  // here would fail with EACCES now that it has exec'ed).
  Spawned s;
  statusW.reset();
  int childErrno = 0;
  if (::read(statusR.get(), &childErrno, sizeof(childErrno)) == static_cast<ssize_t>(sizeof(childErrno))) {
    // Only what another attempt would meet again: not a program being rewritten (ETXTBSY)
    // or a machine short of memory, processes or fds, which a restart may get past.
    s.start_errno = childErrno;
    for (int e : {ENOENT, ENOTDIR, EACCES, ENOEXEC, ELOOP, ENAMETOOLONG, EISDIR, E2BIG, EPERM})
      if (childErrno == e) s.start_failed = true;
  }
  s.pid = pid;
  s.in = std::move(inW);
  s.out = std::move(outR);
  s.err = std::move(errR);
  return s;
}

std::string findWorkerProgram(const std::string& program, const std::map<std::string, std::string>& env,
                              const std::string& cwd) {
  auto it = env.find("PATH");
  return findProgram(program, workerPath(it != env.end() ? it->second.c_str() : nullptr), cwd);
}

std::string shebangProblem(const std::string& program, const std::string& pathVar, const std::string& cwd) {
  // The kernel reads at most this much of the #! line (BINPRM_BUF_SIZE).
  char head[256];
  const int fd = ::open(program.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return "";
  const ssize_t got = ::read(fd, head, sizeof(head));
  ::close(fd);
  if (got < 2 || head[0] != '#' || head[1] != '!') return "";
  std::string line(head + 2, static_cast<size_t>(got - 2));
  line = line.substr(0, line.find('\n'));
  const bool crlf = !line.empty() && line.back() == '\r';
  const std::string crlfHint = crlf ? " (the #! line ends in \\r: the file has Windows line endings; convert it, e.g. "
                                      "with dos2unix)"
                                    : "";
  auto words = [](const std::string& l) {
    std::vector<std::string> out;
    size_t i = 0;
    while (i < l.size()) {
      while (i < l.size() && (l[i] == ' ' || l[i] == '\t')) ++i;
      size_t j = i;
      while (j < l.size() && l[j] != ' ' && l[j] != '\t') ++j;
      if (j > i) out.push_back(l.substr(i, j - i));
      i = j;
    }
    return out;
  };
  const std::vector<std::string> w = words(line);
  if (w.empty()) return "its #! line names no interpreter";
  const std::string& interp = w[0];
  auto shown = [](std::string s) {  // a '\r' made visible
    for (size_t p; (p = s.find('\r')) != std::string::npos;) s.replace(p, 1, "\\r");
    return s;
  };
  const std::string at = interp[0] == '/' || cwd.empty() ? interp : cwd + "/" + interp;
  struct stat st {};
  if (::stat(at.c_str(), &st) != 0)
    return fmt::format("its interpreter {} (#! line) does not exist{}", shown(interp), crlfHint);
  if (!S_ISREG(st.st_mode) || ::access(at.c_str(), X_OK) != 0)
    return fmt::format("its interpreter {} (#! line) is not an executable file{}", shown(interp), crlfHint);
  // `#!/usr/bin/env NAME`: env looks NAME up on the worker's PATH (not `env -S ...`).
  const size_t slash = interp.rfind('/');
  const bool viaEnv = interp.substr(slash == std::string::npos ? 0 : slash + 1) == "env";
  // Linux passes the rest of the #! line to the interpreter as one word: `#!/usr/bin/env
  // python3 -u` asks env for a program named "python3 -u".
  if (viaEnv && w.size() > 2 && w[1][0] != '-' && w[1].find('=') == std::string::npos) {
    std::string rest = line.substr(line.find(w[1]));
    while (!rest.empty() && (rest.back() == ' ' || rest.back() == '\t')) rest.pop_back();
    return fmt::format("its #! line gives {} \"{}\" as one word (Linux does not split the #! line), a program that "
                       "does not exist; write #!{} -S {}, or run the interpreter itself",
                       interp, shown(rest), interp, shown(rest));
  }
  if (viaEnv && w.size() == 2 && w[1][0] != '-' &&
      w[1].find('=') == std::string::npos && findProgram(w[1], pathVar, cwd).empty())
    return fmt::format("its #! line runs {} through {}, and there is no {} on PATH{}", shown(w[1]), interp, shown(w[1]),
                       crlfHint);
  return "";
}

std::string workerShebangProblem(const std::string& program, const std::map<std::string, std::string>& env,
                                 const std::string& cwd) {
  // An executable .py without a #! line: exec refuses it (ENOEXEC) and execvp, as a shell
  // would, runs it with /bin/sh, which fails on the first Python line ("Syntax error").
  if (program.size() > 3 && program.compare(program.size() - 3, 3, ".py") == 0) {
    char head[4] = {0, 0, 0, 0};
    const int fd = ::open(program.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd >= 0) {
      const ssize_t got = ::read(fd, head, sizeof(head));
      ::close(fd);
      const bool shebang = got >= 2 && head[0] == '#' && head[1] == '!';
      const bool elf = got == 4 && std::memcmp(head, "\x7f" "ELF", 4) == 0;
      if (got > 0 && !shebang && !elf)
        return "it is a Python file without a #! line, which the system would run with /bin/sh; give python3 as the "
               "command's first word (python3 " + program.substr(program.rfind('/') + 1) + "), or make "
               "#!/usr/bin/env python3 its first line";
    }
  }
  auto it = env.find("PATH");
  const std::string why = shebangProblem(program, workerPath(it != env.end() ? it->second.c_str() : nullptr), cwd);
  return why.empty() ? why : why + "; fix its #! line, or give an interpreter that exists as the command's first word";
}

std::string missingProgramHint(const std::string& program, const std::map<std::string, std::string>& env,
                               const std::string& cwd) {
  return findWorkerProgram(program + "3", env, cwd).empty() ? std::string() : fmt::format(" (did you mean {}3?)", program);
}

std::string findProgram(const std::string& program, const std::string& pathVar, const std::string& cwd) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  auto under = [&](const std::string& dir, const std::string& name) {
    if (!name.empty() && name[0] == '/') return name;
    const std::string base = dir.empty() ? (cwd.empty() ? std::string(".") : cwd) : (dir[0] == '/' || cwd.empty() ? dir : cwd + "/" + dir);
    return base + "/" + name;
  };
  if (program.empty()) return "";
  if (program.find('/') != std::string::npos) {
    const std::string p = under("", program);
    return runnable(p) ? p : "";
  }
  for (const std::string& dir : split(pathVar, ':')) {
    const std::string p = under(dir, program);
    if (runnable(p)) return p;
  }
  return "";
}

}  // namespace dtrain::launch
