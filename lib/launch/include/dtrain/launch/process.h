#pragma once
// Child processes as dtrain starts them: own process group, killed with dtrain
// (PR_SET_PDEATHSIG), stdout/stderr (and optionally stdin) on pipes.
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "dtrain/common/fd.h"

namespace dtrain::launch {

struct SpawnOptions {
  std::vector<std::string> argv;  // argv[0] looked up on PATH
  std::vector<std::string> env;   // "KEY=VALUE", the whole environment
  std::string cwd;                // "" = ours
  bool stdin_pipe = false;        // false: stdin is /dev/null
  // One pipe for stdout and stderr (Spawned::err stays empty), so that what the child
  // writes to both arrives in the order it was written.
  bool merge_stderr = false;
  // Descriptors of ours the child inherits, at the same numbers (each > 2; the others are
  // close-on-exec): shared memory handed to workers (the trainer's data image).
  std::vector<int> keep_fds;
  // An OrphanGuard's pipe (OrphanGuard::announceFd), or -1: the child tells the guard its
  // process group itself ("W pgid") before exec, so a dtrain SIGKILLed at any moment leaves
  // no group that the guard does not know. (Told by the parent after the spawn returned, a
  // kill in between left the worker's children running: PR_SET_PDEATHSIG reaches the worker
  // alone.)
  int announce_fd = -1;
  // Signals blocked in the child's mask when it starts (the rest is the caller's): for a
  // program that unblocks them once its handlers are in (dtrain train: SIGUSR1/SIGUSR2), so
  // that one sent before then waits for it rather than killing it by its default action.
  std::vector<int> blocked_signals;
};

struct Spawned {
  pid_t pid = -1;
  Fd in;   // write end of the child's stdin (stdin_pipe only)
  Fd out;  // read end of the child's stdout
  Fd err;  // read end of the child's stderr (none with merge_stderr)
  // The child never ran the program: exec (or the setup before it: cwd, setsid, dup2)
  // failed, with start_errno (0 = it ran). It has exited 127/126 after one line on its
  // stderr. start_failed: for a reason another attempt would meet again (not found, not
  // executable, bad cwd), not for a passing one (ETXTBSY, ENOMEM, EAGAIN, EMFILE).
  bool start_failed = false;
  int start_errno = 0;
};

// clone(CLONE_VM | CLONE_VFORK) + exec, as posix_spawn does: returns once the child has
// exec'ed. A bare argv[0] is looked up on the PATH of opts.env (dtrain's own when it has
// none). A program that cannot be run exits 127 (not found) or 126 with one line on its
// stderr, as a shell would, and is reported in start_errno/start_failed. Throws IoError when clone or pipe fail. Thread-safe; the child
// is SIGKILLed when the calling *thread* ends (PR_SET_PDEATHSIG), so spawn from a thread
// that outlives the workers (dtrain's main thread).
Spawned spawnProcess(const SpawnOptions& opts);

// Where exec would find `program`, as execvp looks it up: with a '/', the path itself
// (relative to `cwd`, "" = ours); without, the first executable regular file in `pathVar`'s
// directories (an empty entry is `cwd`). "" when there is none.
std::string findProgram(const std::string& program, const std::string& pathVar, const std::string& cwd);

// findProgram on the PATH workers get: `env`'s (a job's env), else dtrain's own, as
// spawnProcess looks it up.
std::string findWorkerProgram(const std::string& program, const std::map<std::string, std::string>& env,
                              const std::string& cwd);

// Why exec would fail on the #! line of `program` (a path, as findProgram returns it), though
// the file itself is runnable: its interpreter does not exist or is not executable, or
// (`#!/usr/bin/env NAME`) NAME is not on `pathVar`; a '\r' from Windows line endings is
// named. "" when the file has no #! line or nothing is wrong with it. E.g. "its interpreter
// /x/python (#! line) does not exist". A relative interpreter is taken from `cwd`, as the
// kernel takes it from the worker's.
std::string shebangProblem(const std::string& program, const std::string& pathVar, const std::string& cwd);

// shebangProblem with the PATH workers get (see findWorkerProgram), with the fix when there
// is one ("...; fix its #! line, or give an interpreter that exists as the command's first
// word"), for the pre-launch checks of dtrain run and of each node's agent.
std::string workerShebangProblem(const std::string& program, const std::map<std::string, std::string>& env,
                                 const std::string& cwd);

// " (did you mean python3?)" when `program`, not on the workers' PATH, is there with a 3
// appended (`python` where only python3 is installed, torchrun's own interpreter having
// hidden it), else "".
std::string missingProgramHint(const std::string& program, const std::map<std::string, std::string>& env,
                               const std::string& cwd);

// A pipe with both ends close-on-exec.
std::pair<Fd, Fd> makePipe();

}  // namespace dtrain::launch
