#pragma once
// Line-atomic output multiplexing. Thread-safety: none, except Console's; the launcher's
// single event loop owns every LineSplitter and TailBuffer.
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "dtrain/common/fd.h"

namespace dtrain::launch {

// A worker line starting with this is a status update (a progress bar): on a terminal the
// launcher draws it in place of the previous one (an empty one removes it); elsewhere, and in
// log files, it is dropped.
inline constexpr std::string_view kStatusPrefix = "\x1b]dtrain-status;";

// Splits a byte stream into lines. A line longer than the splitter's maximum (kMaxLine for a
// worker's output) is cut into pieces of that size so that a worker printing megabytes
// without a newline cannot grow dtrain's memory. A '\r' not followed by '\n' starts the line
// over, as on a terminal (a progress bar redrawing itself): only the last segment is kept, so
// a bar's thousand updates make one line.
class LineSplitter {
 public:
  // 1 MiB: a JSON record of metrics or a config dump fits whole (at 64 KiB one was cut, and
  // the console's pieces no longer parsed).
  static constexpr size_t kMaxLine = 1u << 20;
  explicit LineSplitter(size_t maxLine = kMaxLine) : maxLine_(maxLine) {}
  // While emit runs: whether the piece it got does not end its line (cut at the maximum, or
  // flushPending's), so that a rank's own log file can go on with the rest on the same line.
  bool cut() const { return cut_; }
  // While emit runs: whether the piece it got goes on from the piece emitted before it (that
  // one was cut, and no '\n' or '\r' came between). A piece that does not is a line of its
  // own, also where the cut one is still open (a log file): a bare '\n' after a flushed piece
  // emits nothing, and a '\r' starts the line over.
  bool continues() const { return emitCont_; }
  // Calls emit(line) (without '\n', or "\r\n") for each complete line in data.
  template <typename F>
  void feed(std::string_view data, F&& emit) {
    for (char ch : data) {
      if (ch == '\n') {
        // After flushPending, the newline only ends what was already emitted.
        cut_ = false;
        emitCont_ = cont_;
        if (!(flushed_ && buf_.empty())) emit(std::string_view(buf_));
        buf_.clear();
        cr_ = flushed_ = cont_ = false;
      } else if (ch == '\r') {
        cr_ = true;  // the segment stays pending() until something overwrites it
        cont_ = false;
      } else {
        if (cr_) buf_.clear();
        cr_ = flushed_ = false;
        buf_.push_back(ch);
        if (buf_.size() >= maxLine_) {
          cut_ = true;
          emitCont_ = cont_;
          emit(std::string_view(buf_));
          cut_ = false;
          cont_ = true;
          buf_.clear();
        }
      }
    }
  }
  // The unfinished line so far (its latest '\r' segment); "" when none.
  std::string_view pending() const { return buf_; }
  // Emits the unfinished line now, as a line of its own (a worker silent in mid-line); what
  // follows it up to the next newline is another line.
  template <typename F>
  void flushPending(F&& emit) {
    if (buf_.empty()) return;
    cut_ = true;
    emitCont_ = cont_;
    emit(std::string_view(buf_));
    cut_ = false;
    cont_ = true;
    buf_.clear();
    cr_ = false;
    flushed_ = true;
  }
  // Flushes a final line that had no trailing newline.
  template <typename F>
  void finish(F&& emit) {
    cut_ = false;
    emitCont_ = cont_;
    if (!buf_.empty()) emit(std::string_view(buf_));
    buf_.clear();
    cr_ = flushed_ = cont_ = false;
  }

 private:
  size_t maxLine_;
  bool cut_ = false;
  bool cont_ = false;      // the next piece goes on from the last one emitted
  bool emitCont_ = false;  // continues(), for the piece being emitted
  std::string buf_;
  bool cr_ = false;       // a '\r' ended the last segment
  bool flushed_ = false;  // flushPending emitted the line's beginning
};

// Writes all of `data` to fd with one write() where the kernel allows, retrying on EINTR and
// partial writes. An error (a closed pipe, a full disk) ends the write and returns false
// (errno says why). Blocks while fd cannot take more: for log files and pipes dtrain owns;
// dtrain's own stdout and stderr go through console().
bool writeAll(int fd, std::string_view data);

// dtrain's console (its stdout and stderr) as its launchers and agents write it: a write
// queues the text and returns at once; a thread of its own writes it out, in the order it
// was queued. stdout and stderr share that order when they are one file (a terminal, 2>&1);
// on two files each has its own queue and writer (Lane), and their relative order is
// only roughly kept, so that one that takes nothing does not hold the other up.
// Why: a console that takes nothing for a while (a stuck log collector, a slow `| tee`,
// Ctrl-S on a terminal, an ssh channel to a busy launcher) must not stop the event loop
// that passes signals on, tears down on time, reaps workers and checks their watchdogs.
// Backpressure, not loss: a launcher stops reading its workers' pipes while backlogged()
// (so a worker blocks on its writes, as it would writing to that console itself), and reads
// on once wakeFd() is readable. A descriptor left non-blocking (O_NONBLOCK, shared with the
// shell or a CI runner's other processes, so not changed here) is waited on for POLLOUT at
// EAGAIN, never dropped. Text a write fails on (a reader gone: EPIPE; EIO) is dropped: a
// console that is gone must not end the job. The writer thread blocks every signal: they
// go to the thread that handles them.
// Thread-safety: every member may be called from any thread.
class Console {
 public:
  // Pending bytes at which backlogged() becomes true: a few MiB, so that a console that
  // keeps up never holds a worker, and one that does not costs dtrain bounded memory.
  static constexpr size_t kDefaultBacklogMax = 4u << 20;
  struct Options {
    size_t backlog_max = kDefaultBacklogMax;
  };
  explicit Console(Options opts);
  Console() : Console(Options{}) {}
  // Waits until everything queued is written (or dropped): only for a console whose
  // descriptors someone reads (tests); the process's, console(), is never destroyed.
  ~Console();
  Console(const Console&) = delete;
  Console& operator=(const Console&) = delete;

  // Queues `text` for fd (dtrain's STDOUT_FILENO or STDERR_FILENO); never blocks. The
  // writer thread starts at the first write.
  void write(int fd, std::string_view text);
  // Bytes queued and not yet written (the one being written included).
  size_t pending() const;
  // True from when pending() reaches backlog_max until it falls to half of that: the time
  // for a launcher to leave its workers' pipes unread.
  bool backlogged() const;
  // Readable once a backlog has ended (backlogged() turned false); clearWake() empties it.
  int wakeFd() const { return wakeR_.get(); }
  void clearWake();
  // Waits until everything queued so far is written (or dropped): true. False when
  // `giveUp`, asked every 50 ms while it waits (without the console's lock: it may write
  // here), says to stop waiting.
  bool flush(const std::function<bool()>& giveUp = nullptr);
  // The errno of the first write to fd (STDOUT_FILENO, STDERR_FILENO) that failed (a full
  // disk, a reader gone), 0 when none has: what was lost is said by whoever needed it whole
  // (bench's table; validate and --dry-run write theirs directly, writeAllBlocking).
  int firstError(int fd) const;

 private:
  struct Chunk {
    int fd;
    std::string text;
  };
  // A queue and its writer thread. stderr has a lane of its own when it is not the same open
  // file as stdout: a stdout that does not take output (a pipe nobody reads) then holds up
  // dtrain's messages on stderr no longer. On one file (a terminal, 2>&1) one lane keeps
  // their order.
  struct Lane {
    std::deque<Chunk> q;
    std::thread thread;
  };
  int laneOf(int fd);  // (mu_ held)
  void writer(int lane);

  const Options opts_;
  Fd wakeR_, wakeW_;
  mutable std::mutex mu_;
  std::condition_variable work_;  // queued text, or stop_
  std::condition_variable idle_;  // pending_ fell to 0
  Lane lanes_[2];
  int errLane_ = -1;  // stderr's lane, decided at the first write to it
  size_t pending_ = 0;
  bool held_ = false;  // backlogged()
  bool stop_ = false;
  int errors_[3] = {0, 0, 0};
};

// dtrain's own console (its stdout and stderr): every line a launcher or an agent writes
// there, worker lines and dtrain's own, goes through it, so that their order holds. Made at
// first use and never destroyed: a write still blocked when dtrain exits must not hold the
// exit up (dtrain's main() waits for the console first, unless a stop signal says not to).
Console& console();

// A log file that could not be written (a full disk): the one-line warning, said once per
// file by the caller. `what` names whose output it was ("rank 3").
std::string logWriteWarning(const std::string& path, const std::string& what, int err);

// Opens (creating it) a rank's log file under log_dir for appending, and writes the line
// that begins a run's or an attempt's part of it:
// "==== dtrain run <run_id> attempt <n> <UTC time> ====". Runs sharing a log_dir keep
// their logs, one after the other. Throws IoError.
int openRankLog(const std::string& path, std::string_view run_id, int attempt);

// Whether fds a and b are open on the same file (not merely the same kind of file): dtrain's
// stdout and stderr are, on a terminal or with 2>&1.
bool sameOpenFile(int a, int b);

// Whether dtrain's stdout is a terminal that can redraw a line in place (status lines, the
// progress bar, unfinished lines): a tty whose TERM is not "dumb" (an editor's shell buffer,
// some CI log viewers).
bool consoleCanRedraw();

// COLUMNS and LINES for workers whose output reaches dtrain's terminal through a pipe: they
// see no terminal of their own, so shutil.get_terminal_size() (tqdm, rich) took 80 columns.
// The terminal's width less `prefixWidth` (the "[rank N] " before each line), and its
// height, into `env`; none where stdout is not a terminal, or where `env` or `given` (an
// environment that wins over `env`: the spec's, or the launcher's own) already sets them.
void addConsoleSize(std::map<std::string, std::string>& env, const std::map<std::string, std::string>& given,
                    size_t prefixWidth);

// Keeps the last N lines.
class TailBuffer {
 public:
  static constexpr size_t kMaxLine = 2000;  // a longer line keeps its first kMaxLine bytes
  explicit TailBuffer(size_t n) : n_(n) {}
  void push(std::string_view line) {
    lines_.emplace_back(line.substr(0, kMaxLine));
    if (lines_.size() > n_) lines_.pop_front();
  }
  const std::deque<std::string>& lines() const { return lines_; }

 private:
  size_t n_;
  std::deque<std::string> lines_;
};

}  // namespace dtrain::launch
