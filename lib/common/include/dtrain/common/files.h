#pragma once
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>

#include "dtrain/common/fd.h"

namespace dtrain {

// Writes all of `text` to fd, waiting for POLLOUT when fd is non-blocking (a CI runner's
// stdout pipe may be left so): false, errno set, on a real failure.
bool writeAllBlocking(int fd, std::string_view text);

// Writes `text` to `path` (created or truncated), readable and writable by the owner only,
// also when the file existed: for files that carry a job's environment, which may hold
// secrets from an env_file. A symlink at `path` is refused. Throws IoError naming the path.
void writePrivateFile(const std::string& path, const std::string& text);

// Writes `text` to an output file a user named (--summary-json, bench --json). Where `path`
// is, or will be, a regular file (through symlinks: the target is replaced, not the link),
// readers see the old content or the whole new one, never a part: a temporary file beside
// the target, renamed over it. Anything else (a pipe, /dev/stdout, a terminal) is written
// in place. Throws IoError naming the path; leaves no temporary file behind.
void writeOutputFile(const std::string& path, const std::string& text);

// True when `path` names something that exists and is neither a regular file nor a
// directory (a pipe, a character device such as /dev/stdout): written in place, so only the
// thing itself must be writable, not its directory.
bool isSpecialOutput(const std::string& path);

// The open descriptor a path names by number: /dev/stdout (1), /dev/stderr (2), /dev/fd/N,
// /proc/self/fd/N; -1 for other paths or a descriptor that is not open. Such an output is
// written to that descriptor as it is: reopening it would truncate a redirected log
// (`> build.log`) or fail on a socket (a journal, some CI runners).
int inheritedOutputFd(const std::string& path);

// A directory of this process's own under the temporary directory: mkdtemp's, mode 0700,
// named <prefix>XXXXXX, returned absolute. For files a run writes and reads back (a spec
// snapshot with its env's secrets, the trainer's outcome): in a shared /tmp, a predictable
// name could be taken first, or made a symbolic link, by another user. Throws tempDirectory()'s SpecError, or IoError.
std::string makePrivateDirectory(const std::string& prefix);

// Where this process's pids mean something: the machine (the first 12 hex digits of its boot
// id: hosts may share a temp dir, TMPDIR on a shared filesystem) and the pid namespace (the
// inode of /proc/self/ns/pid: containers may share /tmp but not their pids), as
// "<boot>.<ns>"; "0" for a part that cannot be read. Read once.
const std::string& pidPlace();

// The prefix for makePrivateDirectory (or a file name's stem) of a process's own files that a
// later process can tell are stale: "<stem><run id>-<pidPlace()>-<this pid>-". Why: a
// process killed with its guard (SIGKILL to a whole cgroup) leaves its private files behind;
// the next one removes them (removeStaleOwnedFiles) by the pid in the name, as no other
// marker survives that kill. (Not those left by a reboot on a persistent /tmp: the new boot
// id makes them another place's, which a temp dir shared between hosts cannot tell apart.)
std::string ownedFilePrefix(std::string_view stem, std::string_view runId);

// The pid in `name` when it is one ownedFilePrefix made for `stem` with a 12 hex digit run id
// (newRunId's), followed by mkdtemp's "-XXXXXX" or by ".json", and its place is this
// process's (pidPlace); else -1.
long ownedFilePid(std::string_view name, std::string_view stem);

// Removes what processes of this user left in `dir` under a name of one of `stems`
// (ownedFilePid): regular files and directories (with what they hold; never through a
// symbolic link) owned by this user, whose process is gone (no process with that pid in this
// place). A pid in use, even by another program, keeps its files; so do names of another
// place (another host, another pid namespace), whose pids this process cannot judge.
// Best effort: nothing is thrown.
void removeStaleOwnedFiles(const std::filesystem::path& dir, std::initializer_list<std::string_view> stems);

// One job per directory: an exclusive flock on DIR/<name> (.dtrain.lock for a checkpoint
// directory, .dtrain-logs.lock for a log directory: one directory may be both), a file anyone may open
// (0666 less the umask; read-only is enough for flock, so a directory several users share is
// not locked out by the first one's file), which names its holder ("pid 123 on host-a").
struct DirectoryLock {
  Fd fd;             // held while open; empty when not taken
  bool busy = false;  // another process holds it; `holder` says who ("" when unknown)
  std::string holder;
  // Not taken for another reason: why, with the path; open_failed when the lock file could not
  // be opened at all, else the file system has no flock (Lustre without -o flock, NFSv3
  // without lockd).
  std::string unsupported;
  bool open_failed = false;
};
// Tries once, never waits. The directory must exist.
DirectoryLock tryLockDirectory(const std::string& dir, const std::string& name = ".dtrain.lock");

// Whether `path` still names the file `held` has open (a lock file, a directory opened
// O_DIRECTORY), compared with the open file itself rather than a remembered (st_dev, st_ino),
// which FUSE or autofs may change for a file nobody holds. kRemoved: the path names nothing
// and the file has no name left; kMovedAway: the path names nothing, the file lives on under
// another name; kReplaced: the path names another file and the held one has no name left
// (removed and made again); kOther: the path names another file, the held one still has a
// name (moved away, another put in its place). An error that decides nothing (EACCES, an
// fstat that fails) reads as kSame.
enum class PathHold { kSame, kRemoved, kMovedAway, kReplaced, kOther };
PathHold pathStillNames(const Fd& held, const std::string& path);

// The directory dtrain makes its temporary files in (workers' error files, a trainer job's
// spec snapshot and result file): the first of TMPDIR, TMP, TEMP and TEMPDIR that is set and
// not empty (the variables std::filesystem::temp_directory_path reads), else /tmp. Absolute:
// the paths are handed to workers, which may start in another directory (the spec's cwd).
// Throws SpecError naming the variable and the fix (create it, or unset it) when it is not
// a directory this process can create files in: every temp file path goes through here, so
// an unusable TMPDIR is one line naming it, never a filesystem error that names nothing.
std::string tempDirectory();

// tempDirectory()'s error as one line, "" when the directory is usable: for commands that
// make no temporary file (validate, run --dry-run) and only say it. `dir`, when given, gets the
// directory (absolute), usable or not.
std::string tempDirectoryProblem(std::string* dir = nullptr);

}  // namespace dtrain
