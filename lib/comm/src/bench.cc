#include "dtrain/comm/bench.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/errors.h"

namespace dtrain::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Ranks whose values (below 8) may all add up without leaving the integers the type holds
// exactly (bfloat16 to 256, half to 2048, float to 2^24).
int exactRanks(DataType t) {
  switch (t) {
    case DataType::kBFloat16: return 256 / 7;
    case DataType::kFloat16: return 2048 / 7;
    case DataType::kFloat32: return (1 << 24) / 7;
    case DataType::kFloat64:
    case DataType::kInt32:
    case DataType::kInt64: return 1 << 30;
  }
  return 1;
}

// Small integers, so that every partial sum is exact in the type and the check can demand
// equality; ranks beyond exactRanks add zeros (73 ranks of bfloat16 summed past 256, and
// correct results were counted wrong).
double pattern(int rank, size_t i, DataType t) {
  return rank < exactRanks(t) ? static_cast<double>((rank + static_cast<int>(i % 13)) % 8) : 0.0;
}

void fill(std::vector<char>& buf, size_t count, DataType t, int rank) {
  for (size_t i = 0; i < count; ++i) {
    double v = pattern(rank, i, t);
    switch (t) {
      case DataType::kFloat32: reinterpret_cast<float*>(buf.data())[i] = static_cast<float>(v); break;
      case DataType::kFloat64: reinterpret_cast<double*>(buf.data())[i] = v; break;
      case DataType::kInt32: reinterpret_cast<int32_t*>(buf.data())[i] = static_cast<int32_t>(v); break;
      case DataType::kInt64: reinterpret_cast<int64_t*>(buf.data())[i] = static_cast<int64_t>(v); break;
      case DataType::kBFloat16: reinterpret_cast<uint16_t*>(buf.data())[i] = floatToBf16(static_cast<float>(v)); break;
      case DataType::kFloat16: reinterpret_cast<uint16_t*>(buf.data())[i] = floatToHalf(static_cast<float>(v)); break;
    }
  }
}

double read(const std::vector<char>& buf, size_t i, DataType t) {
  switch (t) {
    case DataType::kFloat32: return reinterpret_cast<const float*>(buf.data())[i];
    case DataType::kFloat64: return reinterpret_cast<const double*>(buf.data())[i];
    case DataType::kInt32: return reinterpret_cast<const int32_t*>(buf.data())[i];
    case DataType::kInt64: return static_cast<double>(reinterpret_cast<const int64_t*>(buf.data())[i]);
    case DataType::kBFloat16: return bf16ToFloat(reinterpret_cast<const uint16_t*>(buf.data())[i]);
    case DataType::kFloat16: return halfToFloat(reinterpret_cast<const uint16_t*>(buf.data())[i]);
  }
  return 0;
}

double expectedAllreduce(int n, size_t i, ReduceOp op, DataType t) {
  double acc = pattern(0, i, t);
  for (int r = 1; r < n; ++r) {
    double v = pattern(r, i, t);
    acc = op == ReduceOp::kMin ? std::min(acc, v) : op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::kAvg) {
    acc /= n;
    if (t == DataType::kInt32 || t == DataType::kInt64) acc = static_cast<double>(static_cast<long long>(acc));
  }
  return acc;
}

// Relative rounding of one result of type t (its machine epsilon); integers divide exactly
// (truncated, as expectedAllreduce does).
double avgTolerance(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 0x1p-23;
    case DataType::kFloat64: return 0x1p-52;
    case DataType::kFloat16: return 0x1p-10;
    case DataType::kBFloat16: return 0x1p-7;
    case DataType::kInt32:
    case DataType::kInt64: return 0;
  }
  return 0;
}

// All-reduces one 8-byte value through `b`, a buffer of the backend (NCCL reads device memory).
void reduceScalar(Communicator& comm, Buffer& b, void* value, DataType t, ReduceOp op) {
  b.upload(value, 8);
  comm.allreduce(b.data(), 1, t, op);
  b.download(value, 8);
}

const char* redopName(const BenchOptions& o) { return o.collective == Collective::kAllreduce ? name(o.op) : "none"; }

}  // namespace

std::string allgatherTooSmall(const BenchOptions& o, int ranks) {
  const size_t least = elementSize(o.dtype) * static_cast<size_t>(ranks);
  return fmt::format("-e/--maxbytes: {} bytes is less than the smallest allgather of {} ranks, one {} ({} bytes) from "
                     "each: {} bytes; give -e {} or more",
                     o.max_bytes, ranks, name(o.dtype), elementSize(o.dtype), least, least);
}

const char* name(Collective c) {
  switch (c) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllgather: return "allgather";
    case Collective::kSendRecv: return "sendrecv";
  }
  return "?";
}

std::vector<BenchRow> runBench(Communicator& comm, const BenchOptions& o, const std::function<void(const BenchRow&)>& onRow) {
  const int n = comm.size(), rank = comm.rank();
  const size_t es = elementSize(o.dtype);
  const bool p2p = o.collective == Collective::kSendRecv;
  if (p2p && n != 2) throw SpecError(fmt::format("bench sendrecv: needs exactly 2 ranks, got {}", n));
  std::vector<BenchRow> rows;
  const std::unique_ptr<Buffer> scalar = comm.allocate(8);
  if (o.collective == Collective::kAllgather && o.max_bytes < es * static_cast<size_t>(n))
    throw SpecError(allgatherTooSmall(o, n));
  size_t lastBytes = 0;
  for (size_t bytes = std::max(o.min_bytes, es); bytes <= o.max_bytes; bytes *= std::max<size_t>(o.factor, 2)) {
    // Allgather's size is the whole output, as in nccl-tests; each rank contributes 1/n: at
    // least one element, and a size that rounds to the row before is that row again (-b 4
    // -e 64 on 3 ranks printed 12, 12, 12, 24, 60 and averaged the repeats into the footer).
    size_t count = bytes / es;
    size_t sendCount = o.collective == Collective::kAllgather ? std::max<size_t>(1, count / static_cast<size_t>(n)) : count;
    if (o.collective == Collective::kAllgather) {
      count = sendCount * static_cast<size_t>(n);
      if (count * es == lastBytes || count * es > o.max_bytes) {
        if (o.factor < 2) break;
        continue;
      }
      lastBytes = count * es;
    }
    // The operations' buffers are the backend's (device memory for nccl); host copies fill
    // and check them.
    // (allreduce and broadcast work in place: no send buffer)
    const bool sends = o.collective == Collective::kAllgather || p2p;
    std::vector<char> buf(count * es), send(sends ? sendCount * es : 0);
    const std::unique_ptr<Buffer> dbuf = comm.allocate(buf.size()), dsend = comm.allocate(send.size());
    auto once = [&] {
      switch (o.collective) {
        case Collective::kAllreduce: comm.allreduce(dbuf->data(), count, o.dtype, o.op); break;
        case Collective::kBroadcast: comm.broadcast(dbuf->data(), count, o.dtype, 0); break;
        case Collective::kAllgather: comm.allgather(dsend->data(), dbuf->data(), sendCount, o.dtype); break;
        // Ping-pong: rank 0 sends its pattern and receives rank 1's; rank 1 the other way round.
        case Collective::kSendRecv:
          if (rank == 0) {
            comm.send(dsend->data(), send.size(), 1);
            comm.recv(dbuf->data(), buf.size(), 1);
          } else {
            comm.recv(dbuf->data(), buf.size(), 0);
            comm.send(dsend->data(), send.size(), 0);
          }
          break;
      }
    };
    fill(buf, count, o.dtype, rank);
    if (sends) fill(send, sendCount, o.dtype, rank);
    dbuf->upload(buf.data(), buf.size());
    dsend->upload(send.data(), send.size());
    for (int i = 0; i < o.warmup; ++i) once();
    comm.barrier();
    auto start = Clock::now();
    for (int i = 0; i < o.iters; ++i) once();
    double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / std::max(1, o.iters);
    // Point to point: rank 0's loop times whole round trips; one way is half of one.
    if (p2p) us = rank == 0 ? us / 2 : 0;
    reduceScalar(comm, *scalar, &us, DataType::kFloat64, ReduceOp::kMax);

    // Verify one fresh run. (For sendrecv buf starts with this rank's pattern, which differs
    // from the peer's in every element, so a receive that leaves it alone counts as wrong.)
    dbuf->upload(buf.data(), buf.size());
    once();
    dbuf->download(buf.data(), buf.size());
    // (element 0's top byte, its sign and exponent: a value of any type then differs by far
    // more than the tolerance of a rounded avg; the low byte of a bfloat16 did not)
    if (rank == o.corrupt_rank) buf[es - 1] = static_cast<char>(~buf[es - 1]);
    long long wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      double expect;
      switch (o.collective) {
        case Collective::kAllreduce: expect = expectedAllreduce(n, i, o.op, o.dtype); break;
        case Collective::kBroadcast: expect = pattern(0, i, o.dtype); break;
        case Collective::kAllgather: expect = pattern(static_cast<int>(i / sendCount), i % sendCount, o.dtype); break;
        case Collective::kSendRecv: expect = pattern(1 - rank, i, o.dtype); break;
      }
      // avg divides by n: exact only when n is a power of two, so other sizes get the
      // type's rounding (one unit in the last place of the result, twice for safety).
      const double got = read(buf, i, o.dtype);
      if (o.collective == Collective::kAllreduce && o.op == ReduceOp::kAvg && n & (n - 1)) {
        if (std::abs(got - expect) > 2 * avgTolerance(o.dtype) * std::max(1.0, std::abs(expect))) ++wrong;
      } else if (got != expect) {
        ++wrong;
      }
    }
    reduceScalar(comm, *scalar, &wrong, DataType::kInt64, ReduceOp::kSum);

    BenchRow r;
    r.bytes = count * es;
    r.count = count;
    r.time_us = us;
    r.algbw = static_cast<double>(r.bytes) / us / 1e3;
    // (one rank: nothing moves between ranks, whatever the collective, so no bus bandwidth;
    // broadcast's factor 1 would otherwise print its call overhead as one)
    double factor = n == 1                                   ? 0.0
                    : o.collective == Collective::kAllreduce ? 2.0 * (n - 1) / n
                    : o.collective == Collective::kAllgather ? static_cast<double>(n - 1) / n
                                                             : 1.0;
    r.busbw = r.algbw * factor;
    r.wrong = wrong;
    r.transport = p2p ? comm.p2pTransport() : comm.transport();
    rows.push_back(r);
    if (onRow) onRow(r);
    if (o.factor < 2) break;
  }
  return rows;
}

std::string formatBenchHeader(const BenchOptions& o, int worldSize, const char* backend, const std::string& transport) {
  std::string out = fmt::format("# dtrain bench {}: {} rank{}, backend {}, {} iteration{} after {} warm-up\n",
                                name(o.collective), worldSize, worldSize == 1 ? "" : "s", backend, o.iters,
                                o.iters == 1 ? "" : "s", o.warmup);
  out += fmt::format("# transport: {}\n", transport.empty() ? backend : transport);
  // (nccl-tests prints one rank's numbers without a word, and its tens of TB/s get quoted)
  if (worldSize == 1)
    out += "# 1 rank: nothing moves between ranks; busbw is 0 by definition and algbw is only the call's "
           "overhead over the size (run 2 or more ranks to measure bandwidth)\n";
  out += "#\n";
  out += fmt::format("# {:>10} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "size", "count", "type", "redop", "time",
                     "algbw", "busbw", "#wrong");
  out += fmt::format("# {:>10} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>7}\n", "(B)", "(elements)", "", "", "(us)",
                     "(GB/s)", "(GB/s)", "");
  return out;
}

std::string formatBenchRow(const BenchRow& r, const BenchOptions& o) {
  return fmt::format("  {:>10} {:>12} {:>8} {:>6} {:>10.1f} {:>8.3f} {:>8.3f} {:>7}\n", r.bytes, r.count, name(o.dtype),
                     redopName(o), r.time_us, r.algbw, r.busbw, r.wrong);
}

std::string formatBenchFooter(const std::vector<BenchRow>& rows) {
  long long wrong = 0;
  double bus = 0;
  for (const auto& r : rows) {
    wrong += r.wrong;
    bus += r.busbw;
  }
  std::string out = fmt::format("# Out of bounds values : {} {}\n", wrong, wrong ? "FAILED" : "OK");
  out += fmt::format("# Avg bus bandwidth    : {:.3f}\n", rows.empty() ? 0.0 : bus / static_cast<double>(rows.size()));
  return out;
}

std::string formatBench(const std::vector<BenchRow>& rows, const BenchOptions& o, int worldSize, const char* backend) {
  std::string out = formatBenchHeader(o, worldSize, backend, rows.empty() ? std::string() : rows[0].transport);
  for (const auto& r : rows) out += formatBenchRow(r, o);
  return out + formatBenchFooter(rows);
}

// (as written, or reformatted: an object with the keys only a bench's JSON has together)
bool isBenchJsonText(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  return first != std::string::npos && text[first] == '{' && text.find("\"collective\"") != std::string::npos &&
         text.find("\"busbw_gbps\"") != std::string::npos;
}

std::string benchJson(const std::vector<BenchRow>& rows, const BenchOptions& o, int worldSize, const char* backend,
                      const std::string& transportName, bool complete) {
  const std::string transport = transportName.empty() ? std::string(backend) : transportName;
  std::string out = fmt::format("{{\"collective\": \"{}\", \"ranks\": {}, \"backend\": \"{}\", \"transport\": \"{}\", \"type\": \"{}\", \"redop\": \"{}\", \"complete\": {}, \"rows\": [",
                                name(o.collective), worldSize, backend, transport, name(o.dtype), redopName(o), complete);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    out += fmt::format("{}{{\"bytes\": {}, \"count\": {}, \"time_us\": {}, \"algbw_gbps\": {}, \"busbw_gbps\": {}, \"wrong\": {}}}",
                       i ? ", " : "", r.bytes, r.count, r.time_us, r.algbw, r.busbw, r.wrong);
  }
  return out + "]}\n";
}

std::string benchMemoryProblem(const BenchOptions& o, int ranksOnHost, unsigned long long memBytes) {
  if (memBytes == 0) return "";
  // The host copy and the backend's buffer of the result (sendrecv: and of what it sends, the
  // same size), and the transport's scratch, about one more.
  const long double factor = o.collective == Collective::kSendRecv ? 4.0L : 3.0L;
  const long double perRank = factor * static_cast<long double>(o.max_bytes);
  const long double total = perRank * std::max(1, ranksOnHost);
  if (total <= static_cast<long double>(memBytes)) return "";
  auto gib = [](long double b) { return fmt::format("{:.1f} GiB", static_cast<double>(b / (1024.0L * 1024 * 1024))); };
  return fmt::format("-e/--maxbytes: the largest size ({} bytes) needs about {} per rank (the buffers and the backend's "
                     "scratch, ~{}x the size), {} for the {} rank(s) on this host, more than its {} of memory; lower -e",
                     o.max_bytes, gib(perRank), static_cast<int>(factor), gib(total), std::max(1, ranksOnHost),
                     gib(memBytes));
}

unsigned long long physicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<unsigned long long>(pages) * static_cast<unsigned long long>(page) : 0;
}

}  // namespace dtrain::comm
