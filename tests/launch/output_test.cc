#include "dtrain/launch/output.h"
#include "dtrain/launch/launcher.h"
#include "dtrain/launch/process.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <csignal>

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace dtrain::launch {
namespace {

TEST(LineSplitter, JoinsChunksIntoLines) {
  LineSplitter s;
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed("ab", emit);
  s.feed("c\nde\n\nf", emit);
  EXPECT_EQ(lines, (std::vector<std::string>{"abc", "de", ""}));
  s.finish(emit);
  EXPECT_EQ(lines.back(), "f");
  size_t before = lines.size();
  s.finish(emit);
  EXPECT_EQ(lines.size(), before);
}

TEST(LineSplitter, CutsOverlongLines) {
  LineSplitter s;
  std::vector<std::string> lines;
  std::vector<bool> cut;
  auto emit = [&](std::string_view l) {
    lines.emplace_back(l);
    cut.push_back(s.cut());
  };
  std::string big(LineSplitter::kMaxLine * 2 + 5, 'x');
  s.feed(big, emit);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].size(), LineSplitter::kMaxLine);
  s.feed("\n", emit);
  EXPECT_EQ(lines.back().size(), 5u);
  // The pieces cut at the maximum do not end their line; the last one does.
  EXPECT_EQ(cut, (std::vector<bool>{true, true, false}));
  EXPECT_FALSE(s.cut());
  // A splitter of another maximum (an agent's records, twice a worker line's).
  LineSplitter records(16);
  lines.clear();
  records.feed(std::string(20, 'r') + "\n", [&](std::string_view l) { lines.emplace_back(l); });
  EXPECT_EQ(lines, (std::vector<std::string>{std::string(16, 'r'), "rrrr"}));
}

TEST(LineSplitter, BinaryBytesPassThrough) {
  LineSplitter s;
  std::string got;
  s.feed(std::string_view("\xff\x00z\n", 4), [&](std::string_view l) { got = std::string(l); });
  EXPECT_EQ(got, std::string("\xff\x00z", 3));
}

TEST(LineSplitter, CarriageReturnKeepsTheLastSegment) {
  LineSplitter s;
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed("\r 10%", emit);
  EXPECT_EQ(s.pending(), " 10%");
  s.feed("\r 20%\r", emit);
  EXPECT_EQ(s.pending(), " 20%");  // a finished segment shows until overwritten
  s.feed(" 30%", emit);
  EXPECT_EQ(s.pending(), " 30%");
  EXPECT_TRUE(lines.empty());
  s.feed("\ndone\r\n50%\r\nx\r", emit);
  EXPECT_EQ(lines, (std::vector<std::string>{" 30%", "done", "50%"}));
  s.finish(emit);
  EXPECT_EQ(lines.back(), "x");
  EXPECT_EQ(s.pending(), "");
}

TEST(LineSplitter, FlushPendingEmitsAnUnfinishedLineOnce) {
  LineSplitter s;
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed("loading...", emit);
  EXPECT_EQ(s.pending(), "loading...");
  bool cutSeen = false;
  s.flushPending([&](std::string_view l) {
    emit(l);
    cutSeen = s.cut();  // (the line goes on)
  });
  EXPECT_TRUE(cutSeen);
  s.flushPending(emit);  // nothing new: nothing emitted
  EXPECT_EQ(lines, (std::vector<std::string>{"loading..."}));
  s.feed("\n", emit);  // ends the flushed line: no empty line
  EXPECT_EQ(lines.size(), 1u);
  s.feed("\n", emit);  // a real empty line
  EXPECT_EQ(lines.size(), 2u);
  s.feed("a", emit);
  s.flushPending(emit);
  s.feed(" done\n", emit);
  EXPECT_EQ(lines, (std::vector<std::string>{"loading...", "", "a", " done"}));
  s.feed("b", emit);
  s.flushPending(emit);
  s.feed("\r\n", emit);
  EXPECT_EQ(lines.back(), "b");
  EXPECT_EQ(lines.size(), 5u);
}

// Which piece goes on from the one before (a log file keeps a line whole across a cut or a
// flush) and which is a line of its own: after a flushed piece, a bare '\n' emits nothing,
// and a '\r' starts the line over (a bar pausing: one line per pause).
TEST(LineSplitter, ContinuesSaysWhichPieceGoesOn) {
  LineSplitter s;
  std::vector<std::pair<std::string, bool>> got;  // piece, continues()
  auto emit = [&](std::string_view l) { got.emplace_back(std::string(l), s.continues()); };
  s.feed("loading...", emit);
  s.flushPending(emit);
  s.feed(" done\n", emit);  // the rest of the flushed line
  s.feed("x", emit);
  s.flushPending(emit);
  s.feed("\nnext\n", emit);  // the bare newline ends it; "next" is a line of its own
  s.feed(" 10%", emit);
  s.flushPending(emit);
  s.feed("\r 20%\n", emit);  // the bar drawn over: its own line
  using P = std::pair<std::string, bool>;
  EXPECT_EQ(got, (std::vector<P>{P{"loading...", false}, P{" done", true}, P{"x", false}, P{"next", false},
                                 P{" 10%", false}, P{" 20%", false}}));
}

TEST(LineSplitter, ProgressBarMemoryStaysBounded) {
  LineSplitter s;
  int emitted = 0;
  for (int i = 0; i < 100000; ++i) s.feed("\rstep " + std::to_string(i) + " of 100000", [&](std::string_view) { ++emitted; });
  EXPECT_EQ(emitted, 0);
  EXPECT_EQ(s.pending(), "step 99999 of 100000");
}

// Reads fd until EOF.
std::string readAll(int fd) {
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

bool readable(int fd, int timeoutMs) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, timeoutMs) == 1 && (p.revents & POLLIN);
}

// Two descriptors of one pipe (stdout and stderr to one file): the text arrives in the order
// it was queued, across both.
TEST(Console, KeepsTheOrderAcrossDescriptors) {
  auto [r, w] = makePipe();
  Fd w2(::dup(w.get()));
  std::string want;
  {
    Console c;
    for (int i = 0; i < 2000; ++i) {
      const std::string line = "line " + std::to_string(i) + "\n";
      c.write(i % 3 ? w.get() : w2.get(), line);
      want += line;
    }
    std::thread reader([&, rfd = r.get()] { EXPECT_EQ(readAll(rfd), want); });
    EXPECT_TRUE(c.flush());
    w.reset();
    w2.reset();
    reader.join();
  }
}

// A reader that takes nothing: writes return at once, backlogged() holds from backlog_max
// until half is written, and the wake descriptor says when that was; a non-blocking
// descriptor (EAGAIN) loses nothing.
TEST(Console, BacklogsWithoutBlockingAndLosesNothingOnANonBlockingPipe) {
  auto [r, w] = makePipe();
  ASSERT_EQ(::fcntl(w.get(), F_SETFL, ::fcntl(w.get(), F_GETFL) | O_NONBLOCK), 0);
  Console::Options o;
  o.backlog_max = 1 << 20;
  Console c(o);
  const std::string chunk(1000, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  size_t queued = 0;
  while (!c.backlogged()) {
    c.write(w.get(), chunk);
    queued += chunk.size();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));  // never waited on the reader
  EXPECT_GE(c.pending(), o.backlog_max);
  EXPECT_FALSE(readable(c.wakeFd(), 100));
  EXPECT_FALSE(c.flush([] { return true; }));  // a giveUp that says stop: not waited for
  c.write(w.get(), "end\n");
  queued += 4;
  std::string got;
  char buf[65536];
  // Half read: still more than half of backlog_max pending, still backlogged.
  while (got.size() < 200000) {
    ssize_t n = ::read(r.get(), buf, sizeof(buf));
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_TRUE(c.backlogged());
  while (c.backlogged()) {
    ssize_t n = ::read(r.get(), buf, sizeof(buf));
    ASSERT_GT(n, 0);
    got.append(buf, static_cast<size_t>(n));
  }
  EXPECT_TRUE(readable(c.wakeFd(), 1000));
  c.clearWake();
  EXPECT_FALSE(readable(c.wakeFd(), 0));
  std::thread reader([&, rfd = r.get()] { got += readAll(rfd); });
  EXPECT_TRUE(c.flush());
  EXPECT_EQ(c.pending(), 0u);
  w.reset();
  reader.join();
  EXPECT_EQ(got.size(), queued);
  EXPECT_EQ(got.substr(got.size() - 4), "end\n");
}

// A reader gone (EPIPE): the text is dropped, the process not killed by SIGPIPE.
// giveUp may write to the console it is asked by (dtrain says why it stops waiting): it is
// called without the console's lock, which it held before (a deadlock: dtrain hung for good
// after a late Ctrl-C on a stalled console).
TEST(Console, GiveUpMayWriteToTheConsole) {
  auto [r, w] = makePipe();
  ASSERT_EQ(::fcntl(w.get(), F_SETFL, ::fcntl(w.get(), F_GETFL) | O_NONBLOCK), 0);
  Console c;
  const std::string chunk(1 << 16, 'x');
  for (int i = 0; i < 4; ++i) c.write(w.get(), chunk);  // more than the pipe holds: pending
  int asked = 0;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(c.flush([&] {
    c.write(w.get(), "why\n");
    return ++asked == 3;
  }));
  EXPECT_EQ(asked, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  r.reset();  // (the rest is dropped: the reader is gone)
  EXPECT_TRUE(c.flush());
}

TEST(Console, DropsWhatAClosedReaderCannotTake) {
  auto [r, w] = makePipe();
  r.reset();
  Console c;
  c.write(w.get(), "nobody reads this\n");
  EXPECT_TRUE(c.flush());
  EXPECT_EQ(c.pending(), 0u);
}

TEST(TailBuffer, KeepsLastN) {
  TailBuffer t(2);
  t.push("a");
  t.push("b");
  t.push("c");
  ASSERT_EQ(t.lines().size(), 2u);
  EXPECT_EQ(t.lines().front(), "b");
}

}  // namespace
}  // namespace dtrain::launch

namespace dtrain::launch {
namespace {

WorkerExit exitOf(int rank, int code, int sig, std::vector<std::string> tail = {}, bool stopped = false) {
  WorkerExit w;
  w.global_rank = rank;
  w.exit_code = code;
  w.signal = sig;
  w.stderr_tail = std::move(tail);
  w.stopped_by_dtrain = stopped;
  return w;
}

// The first exit reaped is not always the first failure: a rank that lost its peer says so,
// and the peer that failed on its own is the cause.
TEST(RootCause, APeerLostRankPointsToThePeerThatFailedOnItsOwn) {
  const std::string lost0 = "dtrain: error: allreduce on rank 1: lost rank 0: connection closed (the process exited or was killed)";
  std::vector<WorkerExit> ws{exitOf(0, 0, SIGKILL), exitOf(1, 1, 0, {"step 9", lost0}), exitOf(2, 0, SIGTERM, {}, true)};
  EXPECT_EQ(rootCause(ws, 1), 0);
  EXPECT_EQ(rootCause(ws, 0), 0);
  EXPECT_EQ(rootCause(ws, -1), -1);
  // From the error file too; and along a chain (2 lost 1, which lost 0).
  ws[2] = exitOf(2, 1, 0);
  ws[2].error_message = "broadcast on rank 2: lost rank 1: timed out after 300 s";
  EXPECT_EQ(rootCause(ws, 2), 0);
  // The peer did not fail on its own (stopped by dtrain, or succeeded): the rank stays.
  ws[0] = exitOf(0, 0, SIGTERM, {}, true);
  EXPECT_EQ(rootCause(ws, 1), 1);
  ws[0] = exitOf(0, 0, 0);
  EXPECT_EQ(rootCause(ws, 1), 1);
  // Only the rank's own message counts (a [first failure in this job: ... on rank 2: lost
  // rank 0] quote names another rank's loss), and a peer not among the workers is ignored.
  ws[0] = exitOf(0, 0, SIGKILL);
  ws[1] = exitOf(1, 1, 0, {"x [first failure in this job: allreduce on rank 2: lost rank 0: closed]"});
  EXPECT_EQ(rootCause(ws, 1), 1);
  ws[1] = exitOf(1, 1, 0, {"allreduce on rank 1: lost rank 7: closed"});
  EXPECT_EQ(rootCause(ws, 1), 1);
  // Two ranks blaming each other end the chain, not loop.
  ws[0] = exitOf(0, 1, 0, {"allreduce on rank 0: lost rank 1: closed"});
  ws[1] = exitOf(1, 1, 0, {"allreduce on rank 1: lost rank 0: closed"});
  EXPECT_EQ(rootCause(ws, 1), 1);  // no telling: the first reaped stays
  EXPECT_EQ(rootCause(ws, 0), 0);
}

}  // namespace
}  // namespace dtrain::launch
