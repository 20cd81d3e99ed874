// The trainers' memory, counted from their allocations. Every term names the buffer it
// stands for; a change to what the trainers allocate must change its term here (the unit
// tests pin the totals to measured peaks).
#include "dtrain/train/memory_estimate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <sstream>

#include "dtrain/common/errors.h"
#include "dtrain/common/strings.h"
#include "dtrain/train/pipeline.h"

namespace dtrain::train {
namespace {

constexpr uint64_t kFloat = sizeof(float);
constexpr uint64_t kIndex = sizeof(uint64_t);  // a sample index (the batch's order)

// The process before it allocates anything of its own: code, libraries (OpenBLAS's, mapped
// and touched on first use), thread stacks, the heap's bookkeeping. Measured: 12 MiB peak
// RSS for a 784-16-10 worker alone; under dtrain run the communicators' shared memory
// (shmSegment) comes on top.
constexpr uint64_t kRuntime = 16ull << 20;

// OpenBLAS's GEMM workspace: one buffer of BUFFER_SIZE (128 MiB on x86-64), of which a GEMM
// touches the packed panel of its larger operand: K (up to GEMM_Q, 384 at most on the x86-64
// kernels) x the rows of the batch (row-major C = A B is column-major C' = B' A', whose N is
// the batch). Measured: 1.3 KB per sample with K >= 384, 0.4 KB with K = 100.
constexpr uint64_t kBlasBuffer = 128ull << 20;
constexpr uint64_t kBlasQ = 384;

uint64_t blasWorkspace(uint64_t rows, uint64_t widestK) {
  return std::min(kBlasBuffer, rows * std::min(widestK, kBlasQ) * kFloat);
}

// The shared-memory segment of a communicator of n ranks on one host (comm's ShmTransport:
// 8 staging chunks per rank within 32 MiB, point-to-point channels within 8 MiB for up to 8
// ranks), mapped and populated by every rank, so in each one's resident set.
uint64_t shmSegment(uint64_t n) {
  if (n < 2) return 0;
  const uint64_t chunk = std::clamp<uint64_t>((32ull << 20) / (n * 8), 64ull << 10, 256ull << 10) & ~uint64_t{4095};
  uint64_t bytes = n * 8 * chunk;
  if (n <= 8) {
    uint64_t p2p = std::min<uint64_t>(256ull << 10, (8ull << 20) / (n * (n - 1) * 4));
    while (p2p & (p2p - 1)) p2p &= p2p - 1;
    bytes += n * (n - 1) * 4 * (64 + p2p);
  }
  return bytes;
}

uint64_t layerParams(const std::vector<int>& w, size_t l) {
  return (static_cast<uint64_t>(w[l]) + 1) * static_cast<uint64_t>(w[l + 1]);
}

// The target floats per sample in a batch: one label, or the outputs for MSE.
uint64_t targetWidth(const spec::TrainerSpec& t) {
  return t.model.loss == "mse" ? static_cast<uint64_t>(t.model.layers.back()) : 1;
}

// Data sets in memory (data.cc): csv and idx rows as floats, the inputs and one target each,
// every worker its own copy; idx files are first read whole as bytes (`loading`, freed once
// they are floats). Synthetic data is computed per sample from two small matrices per set.
void dataSets(const spec::TrainerSpec& t, const MemoryLayout& l, WorkerMemory& m) {
  const uint64_t in = static_cast<uint64_t>(t.model.layers.front()), out = static_cast<uint64_t>(t.model.layers.back());
  if (t.data.type == "synthetic") {
    m.data = 2 * 10 * (in + out) * kFloat;  // SyntheticData: generator [in x 10] and teacher [out x 10], two sets
    return;
  }
  m.data = l.data_rows * (in + 1) * kFloat;
  if (l.data_shared) {
    m.data_shared = m.data;  // (the image's header and alignment: under a page)
    return;
  }
  // (a bound: the training and held-out files are read one after the other)
  if (t.data.type == "idx") m.loading = l.data_rows * in;
}

// Mlp::backward's two gradient buffers: delta_ holds the loss gradient (B x outputs), then
// each layer l > 0 resizes deltaPrev_ to B x width(l) and swaps the two. A vector keeps its
// capacity, so each buffer ends with the largest size it was given; which sizes land in which
// depends on the parity of the swaps, so the steps are replayed until the capacities settle.
uint64_t mlpDeltas(const std::vector<int>& w, uint64_t B) {
  uint64_t a = 0, b = 0;  // delta_, deltaPrev_ (capacities in floats)
  for (int step = 0; step < 4; ++step) {
    a = std::max(a, B * static_cast<uint64_t>(w.back()));
    for (size_t l = w.size() - 2; l >= 1; --l) {
      b = std::max(b, B * static_cast<uint64_t>(w[l]));
      std::swap(a, b);
    }
  }
  return (a + b) * kFloat;
}

WorkerMemory dataParallel(const spec::TrainerSpec& t, const MemoryLayout& l, int rank) {
  const std::vector<int>& w = t.model.layers;
  const size_t L = w.size() - 1;
  const uint64_t B = static_cast<uint64_t>(t.batch_size), in = static_cast<uint64_t>(w.front());
  const uint64_t yw = targetWidth(t);
  uint64_t P = 0, outs = 0, widest = 0;
  for (size_t i = 0; i < L; ++i) {
    P += layerParams(w, i);
    outs += static_cast<uint64_t>(w[i + 1]);
  }
  for (int x : w) widest = std::max<uint64_t>(widest, static_cast<uint64_t>(x));
  const uint64_t S = t.optimizer.type == "adamw" ? 2 * P : P;  // SGD keeps its momentum buffer even at momentum 0
  WorkerMemory m;
  // The trainer's host copies (trainer.cc: `params`, `momentum`), whatever the device.
  const uint64_t hostCopies = (P + S) * kFloat;
  // Batches (batch_loader.cc: two slots, the one being trained on and the one loading ahead,
  // each inputs, targets and indices; trainer.cc: the evaluation's x and y, and the indices
  // of the batch being requested).
  const uint64_t batches = 2 * B * ((in + yw) * kFloat + kIndex) + B * (in + yw) * kFloat + B * kIndex;
  if (!l.gpu) {
    // Mlp: params, grads; CpuBackend: state.
    m.model = (2 * P + S) * kFloat + hostCopies;
    // Mlp::forward: the input copy, then each layer's pre-activation and output. The
    // evaluation's batches are no larger than B.
    const uint64_t acts = B * (in + 2 * outs) * kFloat;
    m.batch = acts + mlpDeltas(w, B) + batches + blasWorkspace(B, widest);
  } else {
    // Device: params, grads, state; per batch row the input, every layer's pre-activation,
    // the hidden layers' outputs, delta and deltaPrev at the widest layer, the targets and
    // the per-row loss and correctness (cuda_backend.cu, grow()).
    m.device = (2 * P + S) * kFloat +
               B * ((in + outs + (outs - static_cast<uint64_t>(w.back())) + 2 * widest + yw) * kFloat + 12);
    m.model = hostCopies;
    m.batch = batches + B * (in + yw) * kFloat;  // + the pinned staging of a batch
  }
  dataSets(t, l, m);
  if (rank == 0 && !t.checkpoint.dir.empty() && l.checkpoint_to_read) m.resume = (P + S) * kFloat;  // loadLatestCheckpoint's vectors
  m.shared = l.workers == l.world ? shmSegment(static_cast<uint64_t>(l.world)) : 0;
  m.runtime = kRuntime + m.shared;
  return m;
}

WorkerMemory pipelineStage(const spec::TrainerSpec& t, const MemoryLayout& l, int rank) {
  const std::vector<int>& w = t.model.layers;
  const int P = t.parallel.pipeline_stages, p = rank % P, d = rank / P, D = std::max(1, l.world / P);
  const int M = std::max(1, t.parallel.micro_batches);
  const std::vector<int> first = partitionStages(w, P, t.parallel.stage_layers);
  const size_t lo = static_cast<size_t>(first[static_cast<size_t>(p)]),
               hi = static_cast<size_t>(first[static_cast<size_t>(p) + 1]);
  const bool firstStage = p == 0, lastStage = p == P - 1;
  const uint64_t B = static_cast<uint64_t>(t.batch_size), mb = B / static_cast<uint64_t>(M);
  const uint64_t in = static_cast<uint64_t>(w.front()), yw = targetWidth(t), C = static_cast<uint64_t>(w.back());
  uint64_t n = 0, total = 0, outs = 0, widest = 0;
  for (size_t i = lo; i < hi; ++i) {
    n += layerParams(w, i);
    outs += static_cast<uint64_t>(w[i + 1]);
  }
  for (size_t i = lo; i <= hi; ++i) widest = std::max<uint64_t>(widest, static_cast<uint64_t>(w[i]));
  // The input gradients of the stage's layers (but the model's first, which has none to pass
  // on), last layer first, alternately in gradA_ and gradB_: each holds the largest it got.
  uint64_t grad[2] = {0, 0};
  for (size_t i = hi, k = 0; i-- > (lo == 0 ? 1 : lo); ++k)
    grad[k % 2] = std::max<uint64_t>(grad[k % 2], static_cast<uint64_t>(w[i]));
  // A stash's floats per row: the input, each layer's pre-activation and output, the output gradient.
  const uint64_t perRow = static_cast<uint64_t>(w[lo]) + 2 * outs + static_cast<uint64_t>(w[hi]);
  uint64_t lastStageParams = 0;
  for (size_t i = 0; i + 1 < w.size(); ++i) {
    total += layerParams(w, i);
    if (i >= static_cast<size_t>(first[static_cast<size_t>(P) - 1])) lastStageParams += layerParams(w, i);
  }
  const uint64_t S = t.optimizer.type == "adamw" ? 2 * n : n;
  // Micro-batches stashed at once: GPipe all M; 1F1B at most P - p (its warm-up plus one).
  const uint64_t inFlight =
      t.parallel.schedule == "gpipe" ? static_cast<uint64_t>(M) : std::min<uint64_t>(static_cast<uint64_t>(P - p), M);
  WorkerMemory m;
  const uint64_t hostCopies = (n + S) * kFloat;  // pipeline.cc: hostParams, state
  // Batches (pipeline.cc): the loader's two slots hold the inputs on the first stage, the
  // targets on the last, the indices everywhere; the evaluation's x and y likewise.
  const uint64_t batches =
      2 * B * kIndex + B * kIndex + 3 * B * ((firstStage ? in : 0) + (lastStage ? yw : 0)) * kFloat;
  // The evaluation sends chunks of up to B rows (not micro-batches) through the stages.
  const long long held = l.eval_rows >= 0 ? l.eval_rows : t.data.type == "synthetic" ? t.data.eval_samples : -1;
  const uint64_t E = held >= 0 ? std::min<uint64_t>(B, static_cast<uint64_t>(held)) : B;
  const uint64_t evalWidth = static_cast<uint64_t>(w[lo]) + 2 * outs + (lastStage ? C : 0);  // its floats per row
  if (!l.gpu) {
    m.model = (2 * n + S) * kFloat + hostCopies;  // CpuStage: params_, grads_, state_
    // CpuStage: a stash per micro-batch in flight (the input, each layer's pre-activation and
    // output, the output gradient), pooled: each micro-batch takes the sizes the last one gave
    // back; the input gradient goes down the layers through gradA_ and gradB_. The evaluation
    // uses one stash for chunks of up to B rows: larger than a micro-batch, its vectors grow
    // out of the pooled ones (freed, back to the system: they are mmap-sized), one at a time.
    const uint64_t train = (inFlight * mb * perRow + mb * (grad[0] + grad[1])) * kFloat;
    const uint64_t eval = E > mb ? (E - mb) * evalWidth * kFloat + mb * widest * kFloat : 0;
    m.batch = train + eval + batches + blasWorkspace(std::max(mb, E), widest);
  } else {
    // cuda_stage.cu: params, grads, state; a set of stash buffers per micro-batch in flight
    // (the evaluation's set at B rows), the two input-gradient buffers.
    m.device =
        (2 * n + S + (inFlight - 1) * mb * perRow + std::max(mb, E) * perRow + mb * (grad[0] + grad[1])) * kFloat;
    m.model = hostCopies;
    m.batch = batches;
  }
  dataSets(t, l, m);
  if (d == 0 && !t.checkpoint.dir.empty() && l.checkpoint_to_read) m.resume = (n + S) * kFloat;  // the stage's checkpoint
  // Rank 0 gathers the whole model for the job's hash, growing one vector stage by stage:
  // the reallocation holds the old and the new contents at once.
  if (rank == 0) m.gather = (2 * total - lastStageParams) * kFloat;
  if (l.workers == l.world) {
    // The world, this replica's pipeline and this stage's group (with D > 1) each map one.
    m.shared = shmSegment(static_cast<uint64_t>(l.world));
    if (D > 1) m.shared += shmSegment(static_cast<uint64_t>(P)) + shmSegment(static_cast<uint64_t>(D));
  }
  m.runtime = kRuntime + m.shared;
  return m;
}

}  // namespace

WorkerMemory estimateWorkerMemory(const spec::TrainerSpec& t, const MemoryLayout& l, int rank) {
  return t.parallel.pipeline_stages > 1 ? pipelineStage(t, l, rank) : dataParallel(t, l, rank);
}

std::string dominantField(const WorkerMemory& w) {
  const uint64_t model = w.model + std::max(w.resume, w.gather);
  if (w.data + w.loading > std::max(model, w.batch)) return "/trainer/data/path";
  return w.batch > model ? "/trainer/batch_size" : "/trainer/model/layers";
}

MemoryEstimate estimateMemory(const spec::TrainerSpec& t, const MemoryLayout& l) {
  MemoryEstimate e;
  WorkerMemory sum;
  for (int r = l.first_rank; r < l.first_rank + l.workers; ++r) {
    e.workers.push_back(estimateWorkerMemory(t, l, r));
    const WorkerMemory& w = e.workers.back();
    e.host += w.privatePeak();  // (the segments and the data image: once, below)
    sum.model += w.model;
    sum.batch += w.batch;
    sum.data += w.data - w.data_shared;
    sum.loading += w.loading;
    sum.resume += w.resume;
    sum.gather += w.gather;
  }
  // Each distinct segment once: the world's, and with a pipeline of D > 1 replicas each
  // replica's pipeline group (P ranks) and each stage's group (D ranks).
  if (l.workers == l.world && !e.workers.empty()) {
    const int P = std::max(1, t.parallel.pipeline_stages), D = std::max(1, l.world / P);
    e.host += shmSegment(static_cast<uint64_t>(l.world));
    if (P > 1 && D > 1)
      e.host += static_cast<uint64_t>(D) * shmSegment(static_cast<uint64_t>(P)) +
                static_cast<uint64_t>(P) * shmSegment(static_cast<uint64_t>(D));
  }
  if (!e.workers.empty()) {
    e.host += e.workers.front().data_shared;
    sum.data += e.workers.front().data_shared;
  }
  e.field = dominantField(sum);
  return e;
}

std::string describeWorkerMemory(const WorkerMemory& w) {
  std::vector<std::pair<uint64_t, std::string>> parts = {
      {w.batch, "activations and batch buffers"},
      {w.model, "weights, gradients, optimizer state and their host copies"},
      {w.data + w.loading, w.data_shared ? "data set (one copy for the host's workers)" : "data set"},
      {w.gather, "the whole model gathered at the end"},
      {w.runtime, "the process itself"},
  };
  if (w.resume > w.data + w.batch + w.gather) parts.push_back({w.resume, "a checkpoint read at the start"});
  std::stable_sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  // The parts that matter: a twentieth of the whole or more.
  std::string out;
  for (const auto& [bytes, what] : parts) {
    if (!out.empty() && bytes * 20 < w.peak()) break;
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", what, formatBytes(bytes));
  }
  return out;
}

namespace {

std::string layersText(const spec::TrainerSpec& t) {
  uint64_t params = 0;
  for (size_t i = 0; i + 1 < t.model.layers.size(); ++i) params += layerParams(t.model.layers, i);
  const std::string count =
      params >= 1000000 ? fmt::format("{:.1f} M", static_cast<double>(params) / 1e6) : fmt::format("{}", params);
  return fmt::format("{}: {} parameters, {} per copy", fmt::join(t.model.layers, "-"), count,
                     formatBytes(params * kFloat));
}

}  // namespace

std::string memoryFix(const spec::TrainerSpec& t, const std::string& field, const MemoryLayout& l) {
  const int workers = l.workers;
  const std::string fewer = workers > 1 ? fmt::format("fewer workers per host (nproc_per_node {})", workers) : "";
  if (field == "/trainer/batch_size")
    return fmt::format("use a smaller batch_size (now {}){}", t.batch_size, fewer.empty() ? "" : " or " + fewer);
  // (a shared image is one copy whatever the number of workers: fewer would not make it smaller)
  if (field == "/trainer/data/path" && l.data_shared)
    return "this host's workers share one copy of the data set (the data image): use a smaller data file";
  if (field == "/trainer/data/path")
    return fmt::format("every worker holds the whole data set: use a smaller data file{}",
                       fewer.empty() ? "" : " or " + fewer);
  return fmt::format(
      "use smaller layers (now {}), {}pipeline stages (trainer.parallel.pipeline_stages) that each "
      "hold a part of the model",
      layersText(t), fewer.empty() ? "or " : fewer + ", or ");
}

MemoryEstimate checkHostMemory(const spec::TrainerSpec& t, const MemoryLayout& l, const MemoryAvailability& available,
                               const std::string& source) {
  MemoryEstimate e = estimateMemory(t, l);
  if (available.bytes == 0 || e.host <= available.bytes) return e;
  size_t largest = 0;
  for (size_t i = 1; i < e.workers.size(); ++i)
    if (e.workers[i].peak() > e.workers[largest].peak()) largest = i;
  const WorkerMemory& w = e.workers[largest];
  const std::string perWorker = e.workers.size() == 1
                                    ? std::string()
                                    : fmt::format("{} workers, the largest (rank {}) {}: ", e.workers.size(),
                                                  l.first_rank + static_cast<int>(largest), formatBytes(w.peak()));
  throw SpecError(
      fmt::format("{}: {}: this job needs about {} of memory on this host ({}{}), more than the {} {}; {}",
                  source, e.field, formatBytes(e.host), perWorker, describeWorkerMemory(w),
                  formatBytes(available.bytes), available.describe(), memoryFix(t, e.field, l)));
}

bool memoryCheckEnforced() { return envSwitch("DTRAIN_MEMORY_CHECK").value_or(true); }

}  // namespace dtrain::train
