#pragma once
// Collective benchmarks in the style of nccl-tests, run on every rank of a communicator.
// kSendRecv is point to point: a ping-pong between exactly 2 ranks (see runBench).
#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/communicator.h"

namespace dtrain::comm {

enum class Collective { kAllreduce, kBroadcast, kAllgather, kSendRecv };

struct BenchOptions {
  Collective collective = Collective::kAllreduce;
  size_t min_bytes = 4 * 1024;
  size_t max_bytes = 64u << 20;
  size_t factor = 2;
  int iters = 20;
  int warmup = 5;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  // For tests of the verification (DTRAIN_DEBUG_BENCH_CORRUPT): this rank, when >= 0, alters
  // one element of each size's result before checking it.
  int corrupt_rank = -1;
};

struct BenchRow {
  size_t bytes = 0;
  size_t count = 0;
  double time_us = 0;  // per iteration, the slowest rank's
  double algbw = 0;    // GB/s
  double busbw = 0;    // GB/s
  long long wrong = 0; // values that differ from the expected result, summed over ranks
  // Communicator::transport() the row ran on ("shm" or "tcp" for the tcp backend); carried
  // in the rows so formatBench can report it without another parameter.
  std::string transport;
};

// Collective: every rank calls it with the same options. Results are the same on all ranks.
// kSendRecv needs exactly 2 ranks (SpecError otherwise): rank 0 sends, rank 1 receives and
// sends back the same size; time = half the round trip, busbw = algbw = bytes / time;
// #wrong counts received elements (both directions) that differ from the sender's pattern.
// onRow, when given, sees each row as soon as every rank has finished it (a live table).
std::vector<BenchRow> runBench(Communicator& comm, const BenchOptions& opts,
                               const std::function<void(const BenchRow&)>& onRow = {});

// True when `text` is a --json file benchJson wrote, which a next bench may replace.
bool isBenchJsonText(const std::string& text);

// "size count type redop time algbw busbw #wrong" table with the nccl-tests footer; also in
// its three parts, for printing rows as they come.
std::string formatBench(const std::vector<BenchRow>& rows, const BenchOptions& opts, int worldSize, const char* backend);
std::string formatBenchHeader(const BenchOptions& opts, int worldSize, const char* backend, const std::string& transport);
std::string formatBenchRow(const BenchRow& row, const BenchOptions& opts);
std::string formatBenchFooter(const std::vector<BenchRow>& rows);
// `complete`: false while the sweep is still going (or was cut short): the rows so far.
// `transport`: the one the table's header names ("" = the backend), whether or not a row ran.
std::string benchJson(const std::vector<BenchRow>& rows, const BenchOptions& opts, int worldSize, const char* backend,
                      const std::string& transport, bool complete = true);

const char* name(Collective c);

// Why opts.max_bytes cannot hold one allgather of `ranks` ranks (one element from each), as
// one line naming -e; the caller checked that it cannot.
std::string allgatherTooSmall(const BenchOptions& opts, int ranks);

// "" when the sweep's largest size fits in `memBytes` with `ranksOnHost` ranks sharing it,
// else why not, as one line naming -e: each rank holds the collective's buffers plus the
// backend's scratch, about 3x the size (sendrecv: 4x, its send buffers too). Checked before any rank allocates, so a
// size the machine cannot hold is a clear error rather than a worker's std::bad_alloc.
std::string benchMemoryProblem(const BenchOptions& opts, int ranksOnHost, unsigned long long memBytes);

// This machine's physical memory in bytes (0 when unknown).
unsigned long long physicalMemoryBytes();

}  // namespace dtrain::comm
