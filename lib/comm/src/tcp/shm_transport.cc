#include "tcp/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <new>
#include <thread>

#include <fmt/format.h>

#include "detail/reduce.h"
#include "dtrain/common/errors.h"

namespace dtrain::comm::detail {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kMagic = 0x4d48534e41525444ULL;  // "DTRANSHM"
// Staging buffers per rank. Chunk g uses buffer g % kDepth, so a rank may run up to
// kDepth - 1 chunks ahead of the slowest reader before it has to wait (absorbs scheduling
// jitter on a loaded machine).
constexpr size_t kDepth = 8;
// Chunk (staging buffer) size: big enough that the per-chunk synchronisation (a few atomic
// loads/stores) is noise, small enough that staged data is still in cache when the peer
// reads it and that a 1 MiB message is already a 4-stage pipeline. Measured on the 2-core
// dev machine (2 ranks, 256 KiB - 64 MiB): 128-256 KiB beat 512 KiB - 4 MiB, most clearly
// at 1 MiB (~0.25 vs ~1 ms). All slots together stay within kBudget.
constexpr size_t kMaxChunk = 256u << 10;
constexpr size_t kMinChunk = 64u << 10;
constexpr size_t kBudget = 32u << 20;
// Busy-wait this long before yielding/sleeping, only when every rank can have a CPU: a
// peer that is a few microseconds behind is then met without a syscall.
constexpr auto kSpin = std::chrono::microseconds(20);
constexpr size_t kHeaderBytes = 128;  // the Layout, padded to whole cache lines
// Point-to-point channels, one per ordered pair of ranks: kP2pDepth slots of up to
// kP2pMaxChunk bytes each (1 MiB in flight per direction with 2-3 ranks, 512 KiB with 4,
// 256 KiB with 5-6, 128 KiB with 7-8), the payloads of all n(n-1) channels together within
// kP2pBudget. Beyond kP2pMaxRanks, send/recv stay on TCP: n^2 channels do not scale (and a
// rank's pipeline neighbours are few).
constexpr size_t kP2pDepth = 4;
constexpr size_t kP2pMaxChunk = 256u << 10;
constexpr size_t kP2pMaxRanks = 8;
constexpr size_t kP2pBudget = 8u << 20;
constexpr size_t kPieceHeader = 64;
constexpr size_t kNonceBytes = 16;
// Slot and buffer indices are 32-bit counters modulo the depth; they stay consistent across
// the counters' wrap-around only when the depth divides 2^32.
static_assert((kDepth & (kDepth - 1)) == 0 && (kP2pDepth & (kP2pDepth - 1)) == 0, "depths must be powers of two");  // PieceHeader, padded so that payloads stay aligned

// Written by the sender in front of every piece's payload: the whole message's size (the
// receiver compares it with its own, like the TCP path's length header) and this piece's.
struct PieceHeader {
  uint64_t total;
  uint64_t len;
};

size_t p2pChunkFor(size_t n) {
  if (n < 2 || n > kP2pMaxRanks) return 0;
  size_t c = std::min(kP2pMaxChunk, kP2pBudget / (n * (n - 1) * kP2pDepth));
  while (c & (c - 1)) c &= c - 1;                                       // a power of two
  return c;
}

enum : int { kPosted = 0, kReduced = 1, kConsumed = 2, kNumFlags = 3 };

// Wrap-around compare: counters are 32-bit (futex words) and only ever move forward, by far
// less than 2^31 between two looks.
bool reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Not FUTEX_PRIVATE: the word is shared between processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWake(std::atomic<uint32_t>* addr) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 40)) out += std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ? c : '_';
  return out;
}

// The affinity mask's CPUs, not a cgroup CPU quota's (system_cpus.h): the spin is what this
// guards, and it is short (~20 us); under a quota the peer still runs on a CPU of its own, so
// spinning steals it nothing. Measured under a 1-CPU quota on 2 CPUs, 2 ranks: 8 B - 512 B
// all-reduces take 1-2 us spinning, 5 us without.
int cpuCount() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

const char* verb(int which) {
  switch (which) {
    case kPosted: return "post";
    case kReduced: return "reduce";
    default: return "finish reading";
  }
}

}  // namespace

// A flag is written by its owning rank only; `waiters` counts ranks asleep (or about to
// sleep) on it, so the owner makes the futex_wake syscall only when somebody sleeps.
// Each flag has its own cache line: no false sharing between writers.
struct alignas(64) ShmTransport::Flag {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> waiters;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free atomics");

// At offset 0 of the segment; written by rank 0 before it publishes where to find it,
// read-only after.
struct ShmTransport::Layout {
  uint64_t magic;
  uint32_t size;
  uint32_t depth;
  uint64_t chunk;
  uint64_t dataOffset;
  uint64_t totalBytes;
  uint64_t p2pOffset;  // the point-to-point slots (after the collectives' staging buffers)
  uint64_t p2pChunk;   // 0: no point-to-point channels
  uint32_t p2pDepth;
  // The communicator's nonce: a rank that opened some other process's file (the creator's
  // pid reused, another pid namespace) sees that it is not this communicator's segment.
  char nonce[kNonceBytes];
};
static_assert(sizeof(ShmTransport::Layout) <= kHeaderBytes);

std::string hostIdentity() {
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  struct stat st {};
  unsigned long long netns = 0, netdev = 0;
  if (::stat("/proc/self/ns/net", &st) == 0) {
    netns = st.st_ino;
    netdev = st.st_dev;
  }
  return fmt::format("{}|{}|netns {}:{}", boot, host, netdev, netns);
}

ShmMapping::~ShmMapping() {
  if (base_) ::munmap(base_, bytes_);
}

ShmMapping& ShmMapping::operator=(ShmMapping&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, bytes_);
    base_ = o.base_;
    bytes_ = o.bytes_;
    o.base_ = nullptr;
  }
  return *this;
}

namespace {

// Whether a peer's mesh socket says it exited, was killed or failed (-1: no socket).
bool socketHungUp(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return fd >= 0 && ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The communicator's nonce as the segment holds it (zero-padded or cut to kNonceBytes).
void nonceBytes(const std::string& nonce, char (&out)[kNonceBytes]) {
  std::memset(out, 0, kNonceBytes);
  std::memcpy(out, nonce.data(), std::min(nonce.size(), kNonceBytes));
}

// The segment is an anonymous memfd, never a name in /dev/shm: rank 0 creates it and keeps
// its descriptor open until every rank has mapped it; the others open it through
// /proc/<rank 0's pid>/fd/<fd>. So nothing can outlive the processes, whenever any of them
// is killed (a named segment leaked when rank 0 was SIGKILLed between creating it and the
// unlink after every rank had mapped it: 3 of 40 `dtrain bench` runs killed during start-up).
// Rejected alternatives: rank 0's pid in the name and a sweep of dead creators' segments at
// set-up keeps the leak until the next set-up on that host, can delete a live segment whose
// creator is in another pid namespace sharing /dev/shm, and trusts pids, which get reused;
// passing the descriptor over a Unix socket (SCM_RIGHTS) needs a listener and a handshake
// per communicator. Opening /proc/<pid>/fd/<n> takes PTRACE_MODE_READ access to rank 0: the
// same uid and a dumpable process (Yama's ptrace_scope restricts attaching only), which the
// workers dtrain spawns have: they share its uid and pid namespace. Where it is refused
// (another uid, another pid namespace, a process made non-dumpable), that rank reports why
// and every rank uses TCP, as when /dev/shm could not be shared before. /dev/shm's size limit
// (64 MiB in a default container) no longer applies: the segment is charged to memory.
//
// Rank 0: creates, sizes (reserving the pages, so that memory that is not there fails here
// rather than with SIGBUS later) and initialises the segment; its descriptor goes to fdOut.
// Empty mapping on any failure. When the segment with point-to-point channels cannot be
// reserved, tries again without them: the collectives keep shared memory and send/recv use TCP.
ShmMapping createSegment(const std::string& label, const std::string& nonce, int size, std::string& why,
                         size_t p2pChunk, Fd& fdOut);
ShmMapping createSegment(const std::string& label, const std::string& nonce, int size, std::string& why, Fd& fdOut) {
  const size_t p2p = p2pChunkFor(static_cast<size_t>(size));
  ShmMapping map = createSegment(label, nonce, size, why, p2p, fdOut);
  if (!map && p2p) map = createSegment(label, nonce, size, why, 0, fdOut);
  return map;
}

ShmMapping createSegment(const std::string& label, const std::string& nonce, int size, std::string& why,
                         size_t p2pChunk, Fd& fdOut) {
  const size_t n = static_cast<size_t>(size);
  size_t chunk = std::clamp(kBudget / (n * kDepth), kMinChunk, kMaxChunk) & ~size_t{4095};
  // Flags: the collectives' counters, then per rank a doorbell, then per channel `written`
  // and `read` (see ShmTransport::written).
  const size_t numFlags = n * kNumFlags + n + 2 * n * n;
  size_t flagsBytes = sizeof(ShmTransport::Flag) * numFlags;
  size_t dataOffset = (kHeaderBytes + flagsBytes + 4095) & ~size_t{4095};
  size_t p2pOffset = dataOffset + n * kDepth * chunk;
  size_t total = p2pOffset + (p2pChunk ? n * (n - 1) * kP2pDepth * (kPieceHeader + p2pChunk) : 0);
  // Sealed non-executable where the kernel knows the flag (6.3+): with vm.memfd_noexec=2
  // (6.3-6.5) a memfd without it is refused, and newer kernels log a warning for one.
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif
  int made = ::memfd_create(label.c_str(), MFD_CLOEXEC | MFD_NOEXEC_SEAL);
  if (made < 0 && errno == EINVAL) made = ::memfd_create(label.c_str(), MFD_CLOEXEC);  // (older kernels)
  Fd fd{made};
  if (fd.fd < 0) {
    why = fmt::format("memfd_create: {}", std::strerror(errno));
    return {};
  }
  int err = ::ftruncate(fd.fd, static_cast<off_t>(total)) == 0 ? 0 : errno;
  if (!err) err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(total));
  void* p = err ? MAP_FAILED : ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.fd, 0);
  if (!err && p == MAP_FAILED) err = errno;
  if (err) {
    why = fmt::format("cannot size or map the segment ({} bytes): {}", total, std::strerror(err));
    return {};
  }
  ShmMapping map(p, total);
  auto* layout = new (map.data()) ShmTransport::Layout{.magic = kMagic,
                                                       .size = static_cast<uint32_t>(size),
                                                       .depth = static_cast<uint32_t>(kDepth),
                                                       .chunk = chunk,
                                                       .dataOffset = dataOffset,
                                                       .totalBytes = total,
                                                       .p2pOffset = p2pOffset,
                                                       .p2pChunk = p2pChunk,
                                                       .p2pDepth = static_cast<uint32_t>(kP2pDepth),
                                                       .nonce = {}};
  nonceBytes(nonce, layout->nonce);
  auto* flags = reinterpret_cast<ShmTransport::Flag*>(map.data() + kHeaderBytes);
  for (size_t i = 0; i < numFlags; ++i) {
    new (&flags[i].value) std::atomic<uint32_t>(0);
    new (&flags[i].waiters) std::atomic<uint32_t>(0);
  }
  std::swap(fdOut.fd, fd.fd);
  return map;
}

// Both map with MAP_POPULATE: the page tables are filled at set-up, so the first passes
// through the staging ring do not pay a page fault per 4 KiB in every process.
// `where` is rank 0's "/proc/<pid>/fd/<fd>", `label` the name rank 0 gave the memfd. What it
// opens is checked before it is mapped (a memfd of that name, a regular file) and after (the
// layout and this communicator's nonce): the pid may be another process's by now.
ShmMapping openSegment(const std::string& where, const std::string& label, const std::string& nonce, int size,
                       std::string& why) {
  char target[512];
  const ssize_t len = ::readlink(where.c_str(), target, sizeof(target) - 1);
  if (len < 0) {
    why = fmt::format("cannot open rank 0's segment at {}: {}", where, std::strerror(errno));
    return {};
  }
  const std::string got(target, static_cast<size_t>(len)), expect = "/memfd:" + label;
  if (got.compare(0, expect.size(), expect) != 0) {
    why = fmt::format("{} is not rank 0's segment (it is {})", where, got);
    return {};
  }
  Fd fd{::open(where.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK)};
  const int openErr = errno;
  struct stat st {};
  if (fd.fd < 0 || ::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) < kHeaderBytes) {
    why = fmt::format("cannot open rank 0's segment at {}: {}", where,
                      fd.fd < 0 ? std::strerror(openErr) : "not a segment");
    return {};
  }
  size_t total = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.fd, 0);
  if (p == MAP_FAILED) {
    why = fmt::format("cannot map rank 0's segment at {}: {}", where, std::strerror(errno));
    return {};
  }
  ShmMapping map(p, total);
  auto* l = reinterpret_cast<const ShmTransport::Layout*>(map.data());
  char ours[kNonceBytes];
  nonceBytes(nonce, ours);
  if (l->magic != kMagic || l->size != static_cast<uint32_t>(size) || l->totalBytes != total ||
      std::memcmp(l->nonce, ours, kNonceBytes) != 0) {
    why = fmt::format("{} is not this communicator's segment", where);
    return {};
  }
  return map;
}

}  // namespace

std::unique_ptr<ShmTransport> ShmTransport::create(const Setup& s) {
  if (s.size < 2) return nullptr;
  using Ms = std::chrono::milliseconds;
  auto left = [&] { return std::max(Ms(1), std::chrono::duration_cast<Ms>(s.deadline - Clock::now())); };
  auto keys = [&](const std::string& what) {
    std::vector<std::string> k;
    for (int r = 0; r < s.size; ++r) k.push_back(s.prefix + what + std::to_string(r));
    return k;
  };
  // For messages: the communicator's name and the job's ranks (a group's are not).
  std::string name = s.prefix;  // "comm/<name>/"
  if (name.rfind("comm/", 0) == 0) name = name.substr(5);
  if (!name.empty() && name.back() == '/') name.pop_back();
  auto job = [&](int r) { return s.world ? (*s.world)[static_cast<size_t>(r)] : r; };
  const std::string self = s.self.empty() ? fmt::format("rank {}", s.rank) : s.self;
  // Waits for key k[i] of rank ranks[i], each. In slices: a rank whose key is missing and
  // whose socket hung up has died (killed during set-up), and is named at once; at the
  // deadline the first rank whose key is missing is named, not a store key.
  auto await = [&](const std::vector<int>& ranks, const std::vector<std::string>& k, const char* doing) {
    for (;;) {
      const auto slice = std::min(left(), std::max(Ms(100), Ms(s.size)));  // (more ranks: fewer looks)
      try {
        s.store->wait(k, slice);
        return k;
      } catch (const TimeoutError&) {
      }
      // (the sockets first, which cost nothing: the store is asked only about a rank whose
      // socket hung up, and about every rank only at the deadline; a large job's ranks all
      // asking about every rank after each slice would flood it)
      for (size_t i = 0; i < ranks.size(); ++i) {
        const int r = ranks[i];
        if (s.fds && socketHungUp((*s.fds)[static_cast<size_t>(r)]) && !s.store->check({k[i]}))
          throw PeerLostError(fmt::format("communicator \"{}\" shared-memory set-up on {}: lost rank {}: connection "
                                          "closed (the process exited or was killed) before it {}",
                                          name, self, job(r), doing));
      }
      if (Clock::now() >= s.deadline) {
        std::vector<int> missing;
        for (size_t i = 0; i < ranks.size(); ++i)
          if (!s.store->check({k[i]})) missing.push_back(job(ranks[i]));
        if (missing.empty()) return k;
        throw PeerLostError(fmt::format("communicator \"{}\" shared-memory set-up on {}: lost rank {}: it has not {} "
                                        "within the timeout; is it stopped or overloaded? (ranks not there: {})",
                                        name, self, missing.front(), doing, fmt::join(missing, ", ")));
      }
    }
  };
  auto gather = [&](const std::string& what, const char* doing) {
    std::vector<int> all;
    for (int r = 0; r < s.size; ++r) all.push_back(r);
    return s.store->multiGet(await(all, keys(what), doing));
  };

  // 1. Same host? A rank that opted out publishes an identity nobody else has.
  std::string id = s.enabled ? hostIdentity() : fmt::format("shm disabled on rank {}", s.rank);
  s.store->set(s.prefix + "shm/host/" + std::to_string(s.rank), id);
  auto ids = gather("shm/host/", "said which host it is on");
  if (!std::all_of(ids.begin(), ids.end(), [&](const std::string& v) { return v == ids[0]; })) return nullptr;

  // 2. Rank 0 creates the segment and publishes where to open it ("" when it could not).
  const std::string label = fmt::format("dtrain-{}", sanitize(s.prefix));
  std::string why = "rank 0 could not create the segment";
  ShmMapping map;
  Fd created{-1};  // rank 0's descriptor: open until every rank has mapped (or set-up failed)
  if (s.rank == 0) {
    map = createSegment(label, s.nonce, s.size, why, created);
    s.store->set(s.prefix + "shm/name", map ? fmt::format("/proc/{}/fd/{}", ::getpid(), created.fd) : std::string());
  } else {
    std::string published;
    published = s.store->get(await({0}, {s.prefix + "shm/name"}, "published its segment").front());
    if (!published.empty()) map = openSegment(published, label, s.nonce, s.size, why);
  }

  // 3. Everyone reports; shm is used only if every rank mapped it. Once all have reported,
  // rank 0 closes its descriptor (`created`, however create() ends): from then on only the
  // mappings hold the memory, which goes with the last of them. "0: why" stays in the store
  // for diagnosis (`dtrain store get`) when a rank falls back.
  s.store->set(s.prefix + "shm/mapped/" + std::to_string(s.rank), map ? std::string("1") : "0: " + why);
  std::vector<std::string> oks = gather("shm/mapped/", "mapped the segment");
  if (!map || !std::all_of(oks.begin(), oks.end(), [](const std::string& v) { return v == "1"; })) {
    // On one host and still not shared memory: said once, by rank 0 (a silent fallback to
    // TCP costs a large share of the all-reduce's speed; docs/collectives.md says why it may).
    if (s.rank == 0) {
      for (size_t r = 0; r < oks.size(); ++r)
        if (oks[r] != "1") {
          std::fprintf(stderr,
                       "dtrain: warning: communicator \"%s\": the ranks are on one host but use TCP, not shared "
                       "memory: rank %zu: %s\n",
                       name.c_str(), r, oks[r].size() > 3 ? oks[r].substr(3).c_str() : oks[r].c_str());
          break;
        }
    }
    return nullptr;
  }
  return std::unique_ptr<ShmTransport>(new ShmTransport(s, std::move(map)));
}

ShmTransport::ShmTransport(const Setup& s, ShmMapping map)
    : rank_(s.rank),
      size_(s.size),
      map_(std::move(map)),
      fds_(s.fds),
      world_(s.world ? *s.world : std::vector<int>{}),
      lost_(s.lost),
      oversubscribed_(s.size > cpuCount()) {
  if (world_.empty())
    for (int r = 0; r < size_; ++r) world_.push_back(r);
  layout_ = reinterpret_cast<Layout*>(map_.data());
  chunk_ = layout_->chunk;
  depth_ = layout_->depth;
  p2pChunk_ = layout_->p2pChunk;
  p2pDepth_ = layout_->p2pDepth;
  sent_.assign(static_cast<size_t>(size_), 0);
  taken_.assign(static_cast<size_t>(size_), 0);
  // Touch now every page this rank will write (its own slot) and read (the others'), even
  // with MAP_POPULATE: on the dev VM the first write/read of each staging page still cost
  // ~0.3 ms per 256 KiB op for the first pass through the ring (seen as a transient of the
  // first ~8 all-reduces at each new size). Safe without synchronisation: nobody reads this
  // rank's slot before it posts its first chunk, and reading a peer's slot early is harmless.
  const size_t ownBytes = depth_ * chunk_;
  std::memset(buffer(rank_, 0), 0, ownBytes);
  unsigned sink = 0;
  for (int q = 0; q < size_; ++q)
    if (q != rank_)
      for (size_t off = 0; off < ownBytes; off += 4096) sink += static_cast<unsigned char>(buffer(q, 0)[off]);
  // The same for the point-to-point channels: this rank's outgoing ones, and its incoming.
  const size_t channel = p2pDepth_ * (kPieceHeader + p2pChunk_);
  for (int q = 0; p2pChunk_ && q < size_; ++q) {
    if (q == rank_) continue;
    std::memset(slot(rank_, q, 0), 0, channel);
    for (size_t off = 0; off < channel; off += 4096) sink += static_cast<unsigned char>(slot(q, rank_, 0)[off]);
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);
  touched_ = sink;
}

ShmTransport::~ShmTransport() = default;

char* ShmTransport::buffer(int rank, uint32_t seq) const {
  size_t index = static_cast<size_t>(rank) * depth_ + seq % depth_;
  return map_.data() + layout_->dataOffset + index * chunk_;
}

ShmTransport::Flag& ShmTransport::flag(int rank, int which) const {
  return reinterpret_cast<Flag*>(map_.data() + kHeaderBytes)[static_cast<size_t>(rank) * kNumFlags + which];
}

ShmTransport::Flag& ShmTransport::written(int src, int dst) const {
  auto* flags = reinterpret_cast<Flag*>(map_.data() + kHeaderBytes);
  const size_t n = static_cast<size_t>(size_);
  return flags[n * kNumFlags + n + static_cast<size_t>(src) * n + static_cast<size_t>(dst)];
}

ShmTransport::Flag& ShmTransport::read(int src, int dst) const {
  auto* flags = reinterpret_cast<Flag*>(map_.data() + kHeaderBytes);
  const size_t n = static_cast<size_t>(size_);
  return flags[n * kNumFlags + n + n * n + static_cast<size_t>(src) * n + static_cast<size_t>(dst)];
}

char* ShmTransport::slot(int src, int dst, uint32_t piece) const {
  // Channels src -> dst for dst != src: n - 1 per source.
  const size_t channel = static_cast<size_t>(src) * static_cast<size_t>(size_ - 1) + static_cast<size_t>(dst - (dst > src));
  size_t index = channel * p2pDepth_ + piece % p2pDepth_;
  return map_.data() + layout_->p2pOffset + index * (kPieceHeader + p2pChunk_);
}

void ShmTransport::ring(int peer) {
  Flag& bell = reinterpret_cast<Flag*>(map_.data() + kHeaderBytes)[static_cast<size_t>(size_) * kNumFlags + peer];
  bell.value.fetch_add(1, std::memory_order_seq_cst);
  if (bell.waiters.load(std::memory_order_seq_cst) != 0) futexWake(&bell.value);
}

// Release side of the protocol: everything this rank wrote to (or finished reading from)
// shared memory before is visible to a rank that sees the new value. seq_cst store + load of
// `waiters` pairs with the waiter's seq_cst increment + load (Dekker): either the waiter
// sees the value, or we see the waiter and wake it.
void ShmTransport::publish(int which, uint32_t value) {
  Flag& f = flag(rank_, which);
  f.value.store(value, std::memory_order_seq_cst);
  if (f.waiters.load(std::memory_order_seq_cst) != 0) futexWake(&f.value);
}

// Spin briefly (only when every rank can have its own CPU), then yield, then sleep on the
// futex in short slices; between slices check that the peer is still connected and the
// deadline. A peer that hangs up its TCP mesh sockets (exit, SIGKILL, or its own failure,
// which shuts them down) is lost at once; a silent one (SIGSTOP) when the deadline passes.
// Only the awaited peer's socket matters: a peer that finished and left has published every
// counter anyone can still wait for.
void ShmTransport::waitFor(int peer, int which, uint32_t target, Clock::time_point dl) {
  Flag& f = flag(peer, which);
  if (reached(f.value.load(std::memory_order_acquire), target)) return;
  auto start = Clock::now();
  if (!oversubscribed_) {
    for (unsigned i = 1;; ++i) {
      cpuRelax();
      if (reached(f.value.load(std::memory_order_acquire), target)) return;
      if ((i & 63) == 0 && Clock::now() - start > kSpin) break;
    }
  }
  for (int i = 0; i < 16; ++i) {
    ::sched_yield();
    if (reached(f.value.load(std::memory_order_acquire), target)) return;
  }
  while (true) {
    f.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = f.value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) {
      auto now = Clock::now();
      if (now >= dl) {
        f.waiters.fetch_sub(1, std::memory_order_seq_cst);
        lost_(peer, true,
              fmt::format("waiting for rank {} to {} chunk {} over shared memory", job(peer), verb(which), target - 1));
      }
      futexWait(&f.value, v, std::min<std::chrono::nanoseconds>(dl - now, 2ms));
    }
    f.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(f.value.load(std::memory_order_acquire), target)) return;
    if (hungUp(peer)) {
      // The peer may have published and then left between the look above and the poll: its
      // stores come before its close, so one more look decides.
      if (reached(f.value.load(std::memory_order_acquire), target)) return;
      lost_(peer, false, "connection closed (the process exited or was killed)");
    }
  }
}

bool ShmTransport::hungUp(int peer) const { return socketHungUp((*fds_)[static_cast<size_t>(peer)]); }

void ShmTransport::waitDoorbell(uint32_t seen, std::initializer_list<int> peers, Clock::time_point dl,
                                const std::function<std::string()>& progress) {
  Flag& bell = reinterpret_cast<Flag*>(map_.data() + kHeaderBytes)[static_cast<size_t>(size_) * kNumFlags + rank_];
  auto moved = [&] { return bell.value.load(std::memory_order_seq_cst) != seen; };
  if (!oversubscribed_) {
    auto start = Clock::now();
    for (unsigned i = 1;; ++i) {
      cpuRelax();
      if (moved()) return;
      if ((i & 63) == 0 && Clock::now() - start > kSpin) break;
    }
  }
  for (int i = 0; i < 16; ++i) {
    ::sched_yield();
    if (moved()) return;
  }
  while (true) {
    auto now = Clock::now();
    if (now >= dl) lost_(*peers.begin(), true, progress() + " over shared memory");
    bell.waiters.fetch_add(1, std::memory_order_seq_cst);
    if (!moved()) futexWait(&bell.value, seen, std::min<std::chrono::nanoseconds>(dl - now, 2ms));
    bell.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (moved()) return;
    for (int peer : peers) {
      if (!hungUp(peer)) continue;
      // What it published before it left still counts: let the caller look again.
      if (moved()) return;
      lost_(peer, false, "connection closed (the process exited or was killed)");
    }
  }
}

// Both directions in one loop: put in whatever pieces fit, take out whatever has arrived, and
// wait on the doorbell only when neither can move. A sendRecv whose mirror image runs on the
// peer thus never blocks on a full channel, however large the messages.
void ShmTransport::exchange(const char* sbuf, size_t sb, int sp, char* rbuf, size_t rb, int rp, const char* op,
                            Clock::time_point dl) {
  const size_t C = p2pChunk_;
  auto pieces = [&](size_t bytes) { return std::max<size_t>(1, (bytes + C - 1) / C); };
  const size_t sTotal = sp >= 0 ? pieces(sb) : 0, rTotal = rp >= 0 ? pieces(rb) : 0;
  size_t sDone = 0, rDone = 0;
  Flag& bell = reinterpret_cast<Flag*>(map_.data() + kHeaderBytes)[static_cast<size_t>(size_) * kNumFlags + rank_];
  while (sDone < sTotal || rDone < rTotal) {
    const uint32_t seen = bell.value.load(std::memory_order_seq_cst);
    bool progress = false;
    if (sDone < sTotal) {
      uint32_t& seq = sent_[static_cast<size_t>(sp)];
      if (seq - read(rank_, sp).value.load(std::memory_order_acquire) < p2pDepth_) {
        char* s = slot(rank_, sp, seq);
        const size_t off = sDone * C, len = std::min(C, sb - std::min(sb, off));
        const PieceHeader h{sb, len};
        std::memcpy(s, &h, sizeof(h));
        if (len) std::memcpy(s + kPieceHeader, sbuf + off, len);
        written(rank_, sp).value.store(++seq, std::memory_order_seq_cst);
        ring(sp);
        ++sDone;
        progress = true;
      }
    }
    if (rDone < rTotal) {
      uint32_t& seq = taken_[static_cast<size_t>(rp)];
      if (written(rp, rank_).value.load(std::memory_order_acquire) != seq) {
        const char* s = slot(rp, rank_, seq);
        PieceHeader h;
        std::memcpy(&h, s, sizeof(h));
        if (h.total != rb)
          throw PeerLostError(fmt::format("{} from rank {}: expected {} bytes, the peer sent {}", op, job(rp), rb, h.total));
        const size_t off = rDone * C, len = std::min(C, rb - std::min(rb, off));
        if (h.len != len)
          throw PeerLostError(fmt::format("{} from rank {}: piece {} holds {} bytes, expected {} (the channel is out of step)",
                                          op, job(rp), rDone, h.len, len));
        if (len) std::memcpy(rbuf + off, s + kPieceHeader, len);
        read(rp, rank_).value.store(++seq, std::memory_order_seq_cst);
        ring(rp);
        ++rDone;
        progress = true;
      }
    }
    if (progress) continue;
    // Blocked on the receive when there is one to wait for (the sender is then the rank that
    // has to act, and is named on a timeout), and/or on a full channel to sp. Either peer
    // hanging up ends the wait.
    const bool recvPending = rDone < rTotal, sendPending = sDone < sTotal;
    const int first = recvPending ? rp : sp, second = recvPending && sendPending ? sp : first;
    waitDoorbell(seen, {first, second}, dl, [&] {
      std::string out, in;
      if (sp >= 0) out = fmt::format("sent {} of {} bytes to rank {}", std::min(sb, sDone * C), sb, job(sp));
      if (rp >= 0) in = fmt::format("received {} of {} bytes from rank {}", std::min(rb, rDone * C), rb, job(rp));
      return out.empty() ? in : in.empty() ? out : out + ", " + in;
    });
  }
}

void ShmTransport::waitAll(int which, uint32_t target, Clock::time_point dl, bool includeSelf) {
  for (int q = 0; q < size_; ++q)
    if (q != rank_ || includeSelf) waitFor(q, which, target, dl);
}

void ShmTransport::waitBufferFree(uint32_t seq, Clock::time_point dl) {
  waitAll(kConsumed, seq - static_cast<uint32_t>(depth_) + 1, dl);
}

void ShmTransport::barrier(Clock::time_point dl) {
  uint32_t seq = seq_++;
  publish(kPosted, seq + 1);
  waitAll(kPosted, seq + 1, dl);
  publish(kReduced, seq + 1);
  publish(kConsumed, seq + 1);
}

void ShmTransport::allreduce(char* data, size_t count, DataType t, ReduceOp op, size_t smallBytes, Clock::time_point dl) {
  if (count == 0) return;
  // The same choice as the TCP path, because it decides the operand order.
  if (count * elementSize(t) <= smallBytes || count < static_cast<size_t>(size_)) return treeReduce(data, count, t, op, dl);
  // Two ranks: every rank reduces every chunk itself (one synchronisation per chunk instead of
  // two; per rank 5 instead of 4 bytes of memory traffic per byte). More ranks: partitioned,
  // so that nobody reads n buffers per byte.
  if (size_ == 2) return replicatedRing(data, count, t, op, dl);
  ringReduce(data, data, data, count, t, op, 0, true, dl);
}

// All-reduce with the ring's operand order, every rank computing every element: chunk k of
// the message is staged by every rank, then (after one synchronisation) each rank reduces the
// whole chunk from the staging buffers straight into its output, segment piece by segment
// piece, each piece in its ring segment's order.
void ShmTransport::replicatedRing(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  const size_t n = static_cast<size_t>(size_), es = elementSize(t), chunkElems = chunk_ / es;
  auto segBegin = [&](size_t s) { return count * s / n; };
  size_t s = 0;  // segment of the current element; only moves forward
  for (size_t off = 0; off < count; off += chunkElems) {
    const size_t len = std::min(chunkElems, count - off);
    const uint32_t seq = seq_++;
    waitBufferFree(seq, dl);
    std::memcpy(buffer(rank_, seq), data + off * es, len * es);
    publish(kPosted, seq + 1);
    waitAll(kPosted, seq + 1, dl);
    for (size_t i = off; i < off + len; ++s) {
      const size_t end = std::min(off + len, segBegin(s + 1));
      if (end <= i) continue;
      auto src = [&](size_t q) -> const char* { return buffer(static_cast<int>(q % n), seq) + (i - off) * es; };
      char* out = data + i * es;
      reduceTo(out, src(s + 1), src(s), end - i, t, op);
      for (size_t j = 2; j < n; ++j) reduceTo(out, src(s + j), out, end - i, t, op);
      if (op == ReduceOp::kAvg) finishAvg(out, end - i, t, size_);
      i = end;
      if (end < segBegin(s + 1)) break;  // the segment goes on in the next chunk
    }
    publish(kReduced, seq + 1);
    publish(kConsumed, seq + 1);
  }
}

void ShmTransport::reduceScatter(const char* send, char* recv, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  if (count == 0) return;
  ringReduce(nullptr, send, recv, count * static_cast<size_t>(size_), t, op, 1, false, dl);
}

// Small messages (latency): every rank stages its whole chunk, and after ONE synchronisation
// every rank reduces all of it itself, in recursive doubling's tree order:
// leaves v_i = x_i (op x_{i+p2} for the ranks beyond the largest power of two p2), then
// pairwise lower (op) higher, level by level. Same operations on every rank: same bits.
void ShmTransport::treeReduce(char* data, size_t count, DataType t, ReduceOp op, Clock::time_point dl) {
  const size_t es = elementSize(t);
  const size_t chunkElems = chunk_ / es;
  int p2 = 1;
  while (p2 * 2 <= size_) p2 *= 2;
  const int extra = size_ - p2;
  std::vector<const char*> v(static_cast<size_t>(p2));
  for (size_t off = 0; off < count; off += chunkElems) {
    const size_t n = std::min(chunkElems, count - off), nb = n * es;
    if (scratch_.size() < static_cast<size_t>(p2) * nb) scratch_.resize(static_cast<size_t>(p2) * nb);
    const uint32_t seq = seq_++;
    char* out = data + off * es;
    waitBufferFree(seq, dl);
    std::memcpy(buffer(rank_, seq), out, nb);
    publish(kPosted, seq + 1);
    waitAll(kPosted, seq + 1, dl);
    auto tmp = [&](int i) { return scratch_.data() + static_cast<size_t>(i) * nb; };
    for (int i = 0; i < p2; ++i) {
      if (i < extra) {
        reduceTo(tmp(i), buffer(i, seq), buffer(i + p2, seq), n, t, op);
        v[static_cast<size_t>(i)] = tmp(i);
      } else {
        v[static_cast<size_t>(i)] = buffer(i, seq);
      }
    }
    for (int mask = 1; mask < p2; mask <<= 1) {
      for (int i = 0; i < p2; i += 2 * mask) {
        char* d = 2 * mask == p2 ? out : tmp(i);
        reduceTo(d, v[static_cast<size_t>(i)], v[static_cast<size_t>(i + mask)], n, t, op);
        v[static_cast<size_t>(i)] = d;
      }
    }
    // Done reading every slot of this chunk.
    publish(kReduced, seq + 1);
    publish(kConsumed, seq + 1);
    if (op == ReduceOp::kAvg) finishAvg(out, n, t, size_);
  }
}

// Large messages (bandwidth): reduce-scatter + all-gather, pipelined by chunk. The message is
// cut into n segments exactly as the TCP ring cuts it (segment s = [count*s/n,
// count*(s+1)/n)); rank s reduces segment s. Chunk k carries piece k of every segment:
//   1. each rank copies its pieces of the OTHER ranks' segments into its staging buffer
//      (part s at offset s * partBytes) and publishes `posted`;
//   2. rank s reduces its piece from its own input and the others' staging buffers, in the
//      ring's operand order for segment s (start at rank s + shift, then
//      acc = x_next (op) acc around the ring), into its own buffer's part s, and publishes
//      `reduced`;
//   3. (all-reduce) each rank copies the other pieces out of their reducers' buffers, then
//      publishes `consumed`, which frees the chunk's buffers for chunk k + depth.
// in/out may be the same buffer (all-reduce in place): a rank overwrites its output only
// with pieces it has already staged or reduced.
void ShmTransport::ringReduce(char* out, const char* in, char* recv, size_t count, DataType t, ReduceOp op, int shift,
                              bool gather, Clock::time_point dl) {
  const size_t n = static_cast<size_t>(size_), es = elementSize(t), me = static_cast<size_t>(rank_);
  auto segBegin = [&](size_t s) { return count * s / n; };
  const size_t partElems = chunk_ / (n * es), partBytes = partElems * es;
  const size_t maxSeg = (count + n - 1) / n;
  const size_t chunks = (maxSeg + partElems - 1) / partElems;
  for (size_t k = 0; k < chunks; ++k) {
    const uint32_t seq = seq_++;
    char* mine = buffer(rank_, seq);
    auto piece = [&](size_t s, size_t& begin) {  // element range of segment s's piece k
      size_t end = segBegin(s + 1);
      begin = segBegin(s) + k * partElems;
      return begin < end ? std::min(partElems, end - begin) : 0;
    };
    size_t b;
    waitBufferFree(seq, dl);
    for (size_t s = 0; s < n; ++s)
      if (s != me)
        if (size_t len = piece(s, b)) std::memcpy(mine + s * partBytes, in + b * es, len * es);
    publish(kPosted, seq + 1);

    if (size_t len = piece(me, b)) {
      waitAll(kPosted, seq + 1, dl);
      auto src = [&](size_t q) -> const char* { return q == me ? in + b * es : buffer(static_cast<int>(q), seq) + me * partBytes; };
      char* acc = mine + me * partBytes;
      size_t first = (me + static_cast<size_t>(shift)) % n;
      reduceTo(acc, src((first + 1) % n), src(first), len, t, op);
      for (size_t j = 2; j < n; ++j) reduceTo(acc, src((first + j) % n), acc, len, t, op);
      if (op == ReduceOp::kAvg) finishAvg(acc, len, t, size_);
      std::memcpy(gather ? out + b * es : recv + (b - segBegin(me)) * es, acc, len * es);
    }
    publish(kReduced, seq + 1);

    if (gather) {
      for (size_t q = 0; q < n; ++q) {
        if (q == me) continue;
        if (size_t len = piece(q, b)) {
          waitFor(static_cast<int>(q), kReduced, seq + 1, dl);
          std::memcpy(out + b * es, buffer(static_cast<int>(q), seq) + q * partBytes, len * es);
        }
      }
    }
    publish(kConsumed, seq + 1);
  }
}

// Root stages chunk by chunk; the others copy each chunk out as soon as it is posted.
void ShmTransport::broadcast(char* data, size_t bytes, int root, Clock::time_point dl) {
  for (size_t off = 0; off < bytes; off += chunk_) {
    const size_t len = std::min(chunk_, bytes - off);
    const uint32_t seq = seq_++;
    if (rank_ == root) {
      waitBufferFree(seq, dl);
      std::memcpy(buffer(root, seq), data + off, len);
      publish(kPosted, seq + 1);
    } else {
      waitFor(root, kPosted, seq + 1, dl);
      std::memcpy(data + off, buffer(root, seq), len);
      publish(kPosted, seq + 1);
    }
    publish(kReduced, seq + 1);
    publish(kConsumed, seq + 1);
  }
}

void ShmTransport::allgather(const char* send, char* recv, size_t block, Clock::time_point dl) {
  char* own = recv + static_cast<size_t>(rank_) * block;
  if (own != send) std::memmove(own, send, block);
  for (size_t off = 0; off < block; off += chunk_) {
    const size_t len = std::min(chunk_, block - off);
    const uint32_t seq = seq_++;
    waitBufferFree(seq, dl);
    std::memcpy(buffer(rank_, seq), own + off, len);
    publish(kPosted, seq + 1);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      waitFor(q, kPosted, seq + 1, dl);
      std::memcpy(recv + static_cast<size_t>(q) * block + off, buffer(q, seq), len);
    }
    publish(kReduced, seq + 1);
    publish(kConsumed, seq + 1);
  }
}

}  // namespace dtrain::comm::detail
