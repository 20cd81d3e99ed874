#pragma once
// Line-atomic output multiplexing. Thread-safety: none; the launcher's single event loop
// owns every OutputSink and LineSplitter.
#include <deque>
#include <string>
#include <string_view>

namespace dtrain::launch {

// A worker line starting with this is a status update (a progress bar): on a terminal the
// launcher draws it in place of the previous one (an empty one removes it); elsewhere, and in
// log files, it is dropped.
inline constexpr std::string_view kStatusPrefix = "\x1b]dtrain-status;";

// Splits a byte stream into lines. A line longer than kMaxLine is cut into kMaxLine pieces so
// that a worker printing megabytes without a newline cannot grow dtrain's memory. A '\r' not
// followed by '\n' starts the line over, as on a terminal (a progress bar redrawing itself):
// only the last segment is kept, so a bar's thousand updates make one line.
class LineSplitter {
 public:
  static constexpr size_t kMaxLine = 64 * 1024;
  // Calls emit(line) (without '\n', or "\r\n") for each complete line in data.
  template <typename F>
  void feed(std::string_view data, F&& emit) {
    for (char ch : data) {
      if (ch == '\n') {
        // After flushPending, the newline only ends what was already emitted.
        if (!(flushed_ && buf_.empty())) emit(std::string_view(buf_));
        buf_.clear();
        cr_ = flushed_ = false;
      } else if (ch == '\r') {
        cr_ = true;  // the segment stays pending() until something overwrites it
      } else {
        if (cr_) buf_.clear();
        cr_ = flushed_ = false;
        buf_.push_back(ch);
        if (buf_.size() >= kMaxLine) {
          emit(std::string_view(buf_));
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
    emit(std::string_view(buf_));
    buf_.clear();
    cr_ = false;
    flushed_ = true;
  }
  // Flushes a final line that had no trailing newline.
  template <typename F>
  void finish(F&& emit) {
    if (!buf_.empty()) emit(std::string_view(buf_));
    buf_.clear();
    cr_ = flushed_ = false;
  }

 private:
  std::string buf_;
  bool cr_ = false;       // a '\r' ended the last segment
  bool flushed_ = false;  // flushPending emitted the line's beginning
};

// Writes all of `data` to fd with one write() where the kernel allows, retrying on EINTR and
// partial writes. An error (a closed console, a full disk) ends the write and returns false
// (errno says why): losing the console must not kill the job, so most callers ignore it.
bool writeAll(int fd, std::string_view data);

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
