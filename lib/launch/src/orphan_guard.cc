#include "orphan_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/wait.h>

#include <cerrno>

namespace dtrain::launch::detail {
namespace {

static_assert(std::atomic<pid_t>::is_always_lock_free, "the table is shared by two processes");

// The guard, in the child of fork() of a possibly multi-threaded launcher: system calls
// only, no allocation. It sleeps in read() until the launcher releases it ('R') or is gone
// (EOF), then kills the groups listed in the shared table.
[[noreturn]] void guardMain(int in, const std::atomic<pid_t>* groups) {
  // Only the pipe stays open: a console or socket held here would keep a reader waiting.
  if (in != 3) {
    if (::dup2(in, 3) < 0) ::_exit(1);
    in = 3;
  }
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, 4u, ~0u, 0u) != 0)
#endif
    for (int fd = 4; fd < 65536; ++fd) ::close(fd);
  for (int fd = 0; fd < 3; ++fd) ::close(fd);
  // Ctrl-C and the like are for the launcher, which tears down and releases the guard; a
  // stop from the terminal must not hold the guard either.
  ::setpgid(0, 0);
  ::prctl(PR_SET_NAME, "dtrain-guard");  // what ps and top show for it
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) ::sigaction(sig, &ign, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  char op = 0;
  ssize_t got;
  while ((got = ::read(in, &op, 1)) < 0 && errno == EINTR) {
  }
  if (got == 1 && op == 'R') ::_exit(0);
  for (int i = 0; i < OrphanGuard::kMaxGroups; ++i)
    if (pid_t pg = groups[i].load(std::memory_order_acquire); pg > 0) ::kill(-pg, SIGKILL);
  ::_exit(0);
}

}  // namespace

OrphanGuard::OrphanGuard() {
  // The table of groups is shared memory, so watching a worker costs the launcher a store,
  // not a write() that wakes the guard (a process switch per worker while workers start).
  void* table = ::mmap(nullptr, sizeof(std::atomic<pid_t>) * kMaxGroups, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (table == MAP_FAILED) return;
  groups_ = static_cast<std::atomic<pid_t>*>(table);  // zero-filled: every slot free
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[1]);
    guardMain(fds[0], groups_);
  }
  ::close(fds[0]);
  if (pid < 0) {  // no guard: workers still die with the launcher (PDEATHSIG)
    ::close(fds[1]);
    return;
  }
  pid_ = pid;
  pipe_ = Fd(fds[1]);
}

OrphanGuard::~OrphanGuard() {
  if (pid_ >= 0) {
    bool any = false;
    for (int i = 0; i < kMaxGroups && !any; ++i) any = groups_[i].load(std::memory_order_relaxed) > 0;
    if (!any) {
      const char op = 'R';
      while (::write(pipe_.get(), &op, 1) < 0 && errno == EINTR) {
      }
    }
    pipe_.reset();  // EOF: without the release, the guard kills what is left
    // Reaped if it is already gone, else left to exit on its own: waiting would add a
    // scheduling round trip to every run's end. A launcher that runs again reaps it with its
    // workers (waitpid(-1)); one that exits leaves it to init.
    ::waitpid(pid_, nullptr, WNOHANG);
  }
  // The guard has its own mapping of the table (fork); this unmaps ours only.
  if (groups_) ::munmap(groups_, sizeof(std::atomic<pid_t>) * kMaxGroups);
}

void OrphanGuard::watch(pid_t pgid) {
  if (pid_ < 0 || pgid <= 0) return;
  for (int i = 0; i < kMaxGroups; ++i) {
    pid_t expected = 0;
    if (groups_[i].compare_exchange_strong(expected, pgid, std::memory_order_release)) return;
  }
}

void OrphanGuard::unwatch(pid_t pgid) {
  if (pid_ < 0 || pgid <= 0) return;
  for (int i = 0; i < kMaxGroups; ++i) {
    pid_t expected = pgid;
    if (groups_[i].compare_exchange_strong(expected, 0, std::memory_order_release)) return;
  }
}

}  // namespace dtrain::launch::detail
