#pragma once
#include <string>

namespace dtrain {

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
