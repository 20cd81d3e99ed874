#include "dtrain/launch/orphan_guard.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <string>

#include <fmt/format.h>

namespace dtrain::launch {
namespace {

// The guard is /bin/sh running this (argv[0] "dtrain-guard", what ps shows): a shell starts
// in a fraction of the time our own binary would (its libraries), and the launcher waits for
// the exec. Lines on stdin: "W pgid" watch, "U pgid" unwatch, "F path" a file or directory
// tree of the run's own, "R" release. "W" also comes from a spawned child itself
// (SpawnOptions::announce_fd); a "U" for a group never watched changes nothing. On EOF (the
// launcher is gone) every watched group is SIGKILLed and the paths are removed (kept in
// "$@": any path survives, spaces included).
constexpr const char* kGuardScript =
    "g=' '\n"
    "while read -r op p; do\n"
    "  case $op in\n"
    "    W) g=\"$g$p \" ;;\n"
    "    U) case $g in *\" $p \"*) g=\"${g%% $p *} ${g#* $p }\" ;; esac ;;\n"
    "    F) set -- \"$@\" \"$p\" ;;\n"
    "    R) exit 0 ;;\n"
    "  esac\n"
    "done\n"
    "for p in $g; do kill -9 -$p 2>/dev/null; done\n"
    "[ $# -eq 0 ] || rm -rf -- \"$@\"\n";

}  // namespace

OrphanGuard::OrphanGuard() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;
  Fd r(fds[0]), w(fds[1]);
  // posix_spawn: vfork-like, no copy of our address space (fork cost 1.5 ms here, plus
  // copy-on-write faults after it). No PR_SET_PDEATHSIG: it must outlive us. Its own process
  // group, which no terminal signals (Ctrl-C is the launcher's to handle), every signal at
  // its default and unblocked; stdout and stderr /dev/null, so that it holds no console.
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_adddup2(&fa, r.get(), STDIN_FILENO);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  // Nothing else of ours: descriptors opened without O_CLOEXEC (the store's connections,
  // which Boost.Asio accepts without it; what dtrain's own parent left open) would live on
  // in the guard, which may outlive us, and a peer would not see them close.
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  posix_spawn_file_actions_addclosefrom_np(&fa, STDERR_FILENO + 1);
#endif
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  char name[] = "dtrain-guard", dashC[] = "-c";
  std::string script = kGuardScript;
  char* argv[] = {name, dashC, script.data(), nullptr};
  char* envp[] = {nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, "/bin/sh", &fa, &attr, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return;  // no guard: workers still die with the launcher (PDEATHSIG)
  pid_ = pid;
  pipe_ = std::move(w);
}

OrphanGuard::~OrphanGuard() {
  if (pid_ < 0) return;
  if (watched_.empty()) send("R\n");
  pipe_.reset();  // EOF: without the release, the guard kills what is left
  // Reaped if it is already gone, else left to exit on its own: waiting would add a
  // scheduling round trip to every run's end. A launcher that runs again reaps it with its
  // workers (waitpid(-1)); one that exits leaves it to init.
  ::waitpid(pid_, nullptr, WNOHANG);
}

void OrphanGuard::watchAnnounced(pid_t pgid) {
  // (a child that failed before its announcement is unwatched all the same: the guard
  // ignores a U for a group it never heard of)
  if (pid_ < 0 || pgid <= 0) return;
  watched_.insert(pgid);
}

void OrphanGuard::removeIfKilled(const std::string& path) {
  // (a newline would end the line early: such a path is left to the launcher alone; "/" is
  // refused as a last line of defence for the rm -rf)
  if (pid_ < 0 || path.empty() || path == "/" || path.find('\n') != std::string::npos) return;
  send(fmt::format("F {}\n", path));
}

void OrphanGuard::unwatch(pid_t pgid) {
  if (pid_ < 0 || !watched_.erase(pgid)) return;
  send(fmt::format("U {}\n", pgid));
}

void OrphanGuard::send(const std::string& line) {
  // A line is far below PIPE_BUF: written whole. A guard that died (killed by hand: EPIPE)
  // only loses its protection: SIGPIPE is blocked around the write, and the one it raised
  // taken back, since a launcher past its run no longer ignores it (such a job that had
  // succeeded exited 141).
  sigset_t pipeSig, old;
  sigemptyset(&pipeSig);
  sigaddset(&pipeSig, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipeSig, &old);
  ssize_t n;
  while ((n = ::write(pipe_.get(), line.data(), line.size())) < 0 && errno == EINTR) {
  }
  if (n < 0 && errno == EPIPE && !sigismember(&old, SIGPIPE)) {
    const timespec zero{0, 0};
    while (::sigtimedwait(&pipeSig, nullptr, &zero) == SIGPIPE) {
    }
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

}  // namespace dtrain::launch
