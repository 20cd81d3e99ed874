// The pipeline trainer (pipeline.h): each rank holds one stage (a contiguous run of the MLP's
// weight layers), micro-batches flow forward and their gradients backward between
// neighbouring stages by send/recv on the replica's pipeline group, and each stage group
// (its own sub-communicator) averages its gradients over the D replicas before its own
// optimizer step, overlapped with the last micro-batch's backward.
//
// Deadlock freedom: a communicator runs one operation at a time and a send may block until
// the peer reads (big activations overflow the socket buffers), so every schedule below
// issues the operations between two neighbours in the same order on both sides, and where
// both must send at once (1F1B's steady state) as one full-duplex sendRecv.
//
// Devices: the stage math is a detail::StageMath (stage_math.h), the CPU stage below or the
// GPU stage of src/cuda/cuda_stage.cu, chosen by trainer.device as in the data-parallel
// trainer. Activations, their gradients and the stage group's gradients go to the
// communicator in place when it takes the stage's memory (tcp + CPU, nccl + GPU) and are
// staged through host buffers otherwise (a GPU stage on tcp).
#include "dtrain/train/pipeline.h"


#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/memory.h"
#include "dtrain/spec/checkpoint_manifest.h"
#include "dtrain/train/backend.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/metrics.h"
#include "batch_loader.h"
#include "checkpoint_writer.h"
#include "control.h"
#include "diverged.h"
#include "progress.h"
#include "host_collectives.h"
#include "out_of_memory.h"
#include "stage_math.h"
#include "trace.h"
#include "blas.h"

namespace dtrain::train {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;


// The CPU stage: layers [lo, hi) of the MLP with the same math as Mlp (OpenBLAS), but
// with an activation stash per micro-batch (several are in flight) and gradients accumulated
// over micro-batches. Everything completes before a call returns.
class CpuStage final : public StageMath {
 public:
  CpuStage(const MlpConfig& cfg, int lo, int hi, bool adam) : StageMath(cfg, lo, hi, adam) {
    params_.assign(numParams(), 0.0f);
    grads_.assign(numParams(), 0.0f);
    state_.assign(stateSize(), 0.0f);
  }

  std::string describe() const override { return cpuMathDescription(); }
  bool onDevice() const override { return false; }

  float* params() override { return params_.data(); }
  float* grads() override { return grads_.data(); }
  float* state() override { return state_.data(); }
  void loadParams(const float* host) override { std::memcpy(params_.data(), host, params_.size() * sizeof(float)); }
  void storeParams(float* host) override { std::memcpy(host, params_.data(), params_.size() * sizeof(float)); }
  void loadState(const float* host) override { std::memcpy(state_.data(), host, state_.size() * sizeof(float)); }
  void storeState(float* host) override { std::memcpy(host, state_.data(), state_.size() * sizeof(float)); }
  void copyToBackend(void* dst, const void* host, size_t bytes) override { std::memcpy(dst, host, bytes); }
  void copyToHost(void* host, const void* src, size_t bytes) override { std::memcpy(host, src, bytes); }
  void* scratch(size_t bytes) override {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  float* input(int slot, int n) override {
    Stash& s = stash(slot);
    s.n = n;
    reuse(s.in, static_cast<size_t>(n) * inWidth());
    return s.in.data();
  }

  const float* forward(int slot) override {
    Stash& s = stash(slot);
    const int n = s.n, L = hi_ - lo_;
    s.pre.resize(static_cast<size_t>(L));
    s.act.resize(static_cast<size_t>(L));
    for (int k = 0; k < L; ++k) {
      const int l = lo_ + k;
      const float* a = k == 0 ? s.in.data() : s.act[static_cast<size_t>(k) - 1].data();
      auto& z = s.pre[static_cast<size_t>(k)];
      reuse(z, static_cast<size_t>(n) * out(l));
      for (int i = 0; i < n; ++i) std::copy(b(l), b(l) + out(l), z.data() + static_cast<size_t>(i) * out(l));
      detail::sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out(l), in(l), 1.0f, a, in(l), W(l), in(l), 1.0f, z.data(),
                  out(l));
      auto& o = s.act[static_cast<size_t>(k)];
      reuse(o, z.size());
      if (l == static_cast<int>(cfg_.layers.size()) - 2) {
        std::copy(z.begin(), z.end(), o.begin());
      } else {
        activate(cfg_.activation, z.data(), o.data(), z.size());
      }
    }
    account();
    return s.act.back().data();
  }

  double loss(int slot, const float* targets, int denom, int* correct) override {
    Stash& s = stash(slot);
    const int n = s.n, C = cfg_.layers.back();
    const auto& logits = s.act.back();
    reuse(s.delta, logits.size());
    double loss = lossAndGrad(cfg_.loss, logits.data(), n, C, targets, denom, s.delta.data(), correct);
    account();
    return loss;
  }

  float* outputGrad(int slot) override {
    Stash& s = stash(slot);
    reuse(s.delta, static_cast<size_t>(s.n) * outWidth());
    account();
    return s.delta.data();
  }

  const float* backward(int slot, const std::function<void(int)>& onLayerDone) override {
    Stash& s = stash(slot);
    const int n = s.n, L = hi_ - lo_;
    // A middle stage received d(loss)/d(its post-activation output): through the activation.
    if (!last()) applyActivationGrad(s.delta, s.pre.back());
    // Layer by layer the gradient goes down through gradA_ and gradB_ in turn, as in the GPU
    // stage: the stash's buffers keep their sizes, so every micro-batch's stash takes the same
    // sizes from the pool that the last one gave back (swapping the stash's delta with a
    // member, as before, let pooled buffers change sizes and grow).
    const float* delta = s.delta.data();
    std::vector<float>* next = &gradA_;
    for (int k = L - 1; k >= 0; --k) {
      const int l = lo_ + k;
      const float* aPrev = k == 0 ? s.in.data() : s.act[static_cast<size_t>(k) - 1].data();
      detail::sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out(l), in(l), n, 1.0f, delta, out(l), aPrev, in(l),
                  1.0f, dW(l), in(l));
      addColumnSums(delta, n, out(l), db(l));
      if (onLayerDone) onLayerDone(k);
      if (k == 0 && lo_ == 0) break;
      std::vector<float>& prev = *next;
      prev.resize(static_cast<size_t>(n) * in(l));
      detail::sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, in(l), out(l), 1.0f, delta, out(l), W(l), in(l),
                  0.0f, prev.data(), in(l));
      if (k > 0) applyActivationGrad(prev, s.pre[static_cast<size_t>(k) - 1]);
      delta = prev.data();
      next = next == &gradA_ ? &gradB_ : &gradA_;
    }
    // The input gradient is in `delta` now (gradA_ or gradB_, until the next backward).
    release(s.in);
    release(s.delta);
    for (auto& v : s.pre) release(v);
    for (auto& v : s.act) release(v);
    s = Stash{};
    account();
    return lo_ == 0 ? nullptr : delta;
  }

  void zeroGrads() override { std::fill(grads_.begin(), grads_.end(), 0.0f); }
  double gradSquares() override {
    double sq = 0;
    for (float g : grads_) sq += static_cast<double>(g) * g;
    return sq;
  }
  void clipGrads(double norm, double maxNorm) override {
    if (!(norm > maxNorm)) return;
    const float scale = static_cast<float>(maxNorm / (norm + 1e-6));
    for (float& g : grads_) g *= scale;
  }
  void sgdStep(const SgdParams& p) override { cpuSgdStep(params_.data(), grads_.data(), state_.data(), params_.size(), p); }
  void adamwStep(const AdamWParams& p) override {
    cpuAdamwStep(params_.data(), grads_.data(), state_.data(), params_.size(), p);
  }
  size_t liveBytes() const override { return live_; }
  size_t peakBytes() const override { return peak_; }

 private:
  struct Stash {
    int n = 0;
    std::vector<float> in, delta;
    std::vector<std::vector<float>> pre, act;
  };

  float* W(int l) { return params_.data() + offsets_[static_cast<size_t>(l - lo_)]; }
  float* b(int l) { return W(l) + static_cast<size_t>(out(l)) * in(l); }
  float* dW(int l) { return grads_.data() + offsets_[static_cast<size_t>(l - lo_)]; }
  float* db(int l) { return dW(l) + static_cast<size_t>(out(l)) * in(l); }

  // Stash buffers come from a pool of released ones instead of the allocator: a fresh
  // activation-sized vector per micro-batch meant an mmap, page faults on every page and a
  // munmap each time (glibc serves them from mmap), which cost the first stage 20% of its
  // compute. Pooled buffers keep their capacity, so the memory held is the peak in use.
  // reuse(v, n): v sized n, its storage from the pool when v has none (the contents are
  // stale; every caller overwrites them): the smallest pooled buffer that holds n, else the
  // largest, grown. (The last one released, whatever its size, let every buffer drift up to
  // the widest role's size over the steps: a first stage with a 4096-wide input and 16-wide
  // layers held 3.0 GiB where its vectors needed 2.0.) release(v): v's storage back to the pool.
  void reuse(std::vector<float>& v, size_t n) {
    if (v.capacity() == 0 && !pool_.empty()) {
      size_t pick = 0;
      for (size_t i = 1; i < pool_.size(); ++i) {
        const size_t c = pool_[i].capacity(), best = pool_[pick].capacity();
        if (best >= n ? c >= n && c < best : c > best) pick = i;
      }
      v.swap(pool_[pick]);
      if (pick + 1 != pool_.size()) pool_[pick].swap(pool_.back());
      pool_.pop_back();
    }
    v.resize(n);
  }
  void release(std::vector<float>& v) {
    if (v.capacity() == 0) return;
    v.clear();
    pool_.push_back(std::move(v));
    v = std::vector<float>();
  }

  Stash& stash(int slot) {
    if (stash_.size() <= static_cast<size_t>(slot)) stash_.resize(static_cast<size_t>(slot) + 1);
    return stash_[static_cast<size_t>(slot)];
  }

  void applyActivationGrad(std::vector<float>& g, const std::vector<float>& z) const {
    activationGrad(cfg_.activation, z.data(), g.data(), g.size());
  }

  void account() {
    size_t bytes = 0;
    for (const auto& s : stash_) {
      bytes += (s.in.size() + s.delta.size()) * sizeof(float);
      for (const auto& v : s.pre) bytes += v.size() * sizeof(float);
      for (const auto& v : s.act) bytes += v.size() * sizeof(float);
    }
    live_ = bytes;
    peak_ = std::max(peak_, bytes);
  }

  std::vector<float> params_, grads_, state_, gradA_, gradB_;
  std::vector<char> scratch_;
  std::vector<Stash> stash_;
  std::vector<std::vector<float>> pool_;
  size_t live_ = 0, peak_ = 0;
};

// The bubble fraction of a pipeline step, as the (P-1)/(M+P-1) theory defines it: the share
// of the P stages' time over the step that is not compute, 1 - compute / (P x span). The
// span is the first stage's schedule: it starts the step (the other stages can compute
// nothing before its first activation arrives) and ends it (its last backward needs every
// other stage's). The other stages' own schedule times would not do: the last stage's starts
// while the first still runs the previous step's optimizer. computeSum: every rank's compute
// seconds; firstStageSchedule: the first stages' schedule seconds, both summed over the
// replicas.
double pipelineBubble(double computeSum, double firstStageSchedule, int stages) {
  if (firstStageSchedule <= 0) return 0;
  return std::max(0.0, 1.0 - computeSum / (stages * firstStageSchedule));
}

// Point-to-point transfers of stage buffers on the pipeline communicator, and the small
// host-side collectives (headers, statistics, hashes, the clipping norm). In place when the
// communicator takes the stage's memory (tcp with the CPU stage, nccl with the GPU stage);
// staged through host buffers for the GPU stage on tcp, and through the stage's scratch for
// host data on nccl.
class StageComm {
 public:
  StageComm(comm::Communicator& c, StageMath& m)
      : c_(c), m_(m), host_(c, m), direct_(host_.onDevice() == m.onDevice()) {}
  comm::Communicator& get() { return c_; }
  // True when stage buffers go to the communicator as they are.
  bool direct() const { return direct_; }

  void send(const float* buf, size_t bytes, int peer) {
    if (direct_) return c_.send(buf, bytes, peer);
    m_.copyToHost(host(sendHost_, bytes), buf, bytes);
    c_.send(sendHost_.data(), bytes, peer);
  }
  void recv(float* buf, size_t bytes, int peer) {
    if (direct_) return c_.recv(buf, bytes, peer);
    c_.recv(host(recvHost_, bytes), bytes, peer);
    m_.copyToBackend(buf, recvHost_.data(), bytes);
  }
  void sendRecv(const float* sendBuf, size_t sendBytes, int sendPeer, float* recvBuf, size_t recvBytes, int recvPeer) {
    if (direct_) return c_.sendRecv(sendBuf, sendBytes, sendPeer, recvBuf, recvBytes, recvPeer);
    m_.copyToHost(host(sendHost_, sendBytes), sendBuf, sendBytes);
    c_.sendRecv(sendHost_.data(), sendBytes, sendPeer, host(recvHost_, recvBytes), recvBytes, recvPeer);
    m_.copyToBackend(recvBuf, recvHost_.data(), recvBytes);
  }

  // Host data (never a stage buffer).
  void allreduceHost(void* data, size_t count, comm::DataType t, comm::ReduceOp op) { host_.allreduce(data, count, t, op); }
  void allreduceHostAlive(void* data, size_t count, comm::DataType t, comm::ReduceOp op, const std::function<void()>& alive) {
    host_.allreduceAlive(data, count, t, op, alive);
  }
  void allgatherHost(const void* send, void* recv, size_t count, comm::DataType t) { host_.allgather(send, recv, count, t); }
  void broadcastHost(void* data, size_t count, comm::DataType t, int root) { host_.broadcast(data, count, t, root); }
  void sendHost(const void* data, size_t bytes, int peer) { host_.send(data, bytes, peer); }
  void recvHost(void* data, size_t bytes, int peer) { host_.recv(data, bytes, peer); }

 private:
  static void* host(std::vector<char>& v, size_t bytes) {
    if (v.size() < bytes) v.resize(bytes);
    return v.data();
  }
  comm::Communicator& c_;
  StageMath& m_;
  HostCollectives host_;
  bool direct_;
  std::vector<char> sendHost_, recvHost_;
};

}  // namespace

void initStageParams(const MlpConfig& cfg, int lo, int hi, uint64_t seed, float* params) {
  std::mt19937_64 gen(seed);
  float* w = params;
  for (int l = 0; l < hi; ++l) {
    const int in = cfg.layers[static_cast<size_t>(l)], out = cfg.layers[static_cast<size_t>(l) + 1];
    float bound = std::sqrt(6.0f / static_cast<float>(in));
    std::uniform_real_distribution<float> d(-bound, bound);
    const size_t n = static_cast<size_t>(in) * out;
    if (l < lo) {
      for (size_t i = 0; i < n; ++i) (void)d(gen);
      continue;
    }
    for (size_t i = 0; i < n; ++i) w[i] = d(gen);
    std::fill(w + n, w + n + out, 0.0f);
    w += n + static_cast<size_t>(out);
  }
}

std::unique_ptr<StageMath> makeCpuStage(const MlpConfig& cfg, int lo, int hi, uint64_t seed, bool adam) {
  auto s = std::make_unique<CpuStage>(cfg, lo, hi, adam);
  initStageParams(cfg, lo, hi, seed, s->params());
  return s;
}

}  // namespace detail

PipelineLayout pipelineLayout(int rank, int world, int stages) {
  if (stages < 1 || world % stages != 0)
    throw SpecError(fmt::format("trainer: /trainer/parallel/pipeline_stages {} does not divide the world size {}; run "
                                "D x {} workers (D data-parallel replicas of the pipeline)",
                                stages, world, stages));
  PipelineLayout p;
  p.stages = stages;
  p.replicas = world / stages;
  p.stage = rank % stages;
  p.replica = rank / stages;
  return p;
}

std::vector<int> partitionStages(const std::vector<int>& widths, int stages, const std::vector<int>& stageLayers) {
  const int L = static_cast<int>(widths.size()) - 1;
  if (stages < 1 || stages > L)
    throw SpecError(fmt::format("trainer: {} pipeline stages for {} weight layers; a stage needs at least one", stages, L));
  std::vector<int> first;
  if (!stageLayers.empty()) {
    first.push_back(0);
    for (int c : stageLayers) first.push_back(first.back() + c);
    if (static_cast<int>(stageLayers.size()) != stages || first.back() != L)
      throw SpecError(fmt::format("trainer: /trainer/parallel/stage_layers must give {} counts adding up to {}", stages, L));
    return first;
  }
  // Prefix sums of parameters per layer; best[s][l] = the smallest possible largest stage
  // when the first l layers form s stages.
  std::vector<double> pre(static_cast<size_t>(L) + 1, 0);
  for (int l = 0; l < L; ++l)
    pre[static_cast<size_t>(l) + 1] = pre[static_cast<size_t>(l)] +
                                      static_cast<double>(widths[static_cast<size_t>(l)] + 1) * widths[static_cast<size_t>(l) + 1];
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(stages) + 1, std::vector<double>(static_cast<size_t>(L) + 1, inf));
  std::vector<std::vector<int>> cut(static_cast<size_t>(stages) + 1, std::vector<int>(static_cast<size_t>(L) + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int l = s; l <= L; ++l)
      for (int k = s - 1; k < l; ++k) {
        double v = std::max(best[static_cast<size_t>(s) - 1][static_cast<size_t>(k)], pre[static_cast<size_t>(l)] - pre[static_cast<size_t>(k)]);
        if (v < best[static_cast<size_t>(s)][static_cast<size_t>(l)]) {
          best[static_cast<size_t>(s)][static_cast<size_t>(l)] = v;
          cut[static_cast<size_t>(s)][static_cast<size_t>(l)] = k;
        }
      }
  first.assign(static_cast<size_t>(stages) + 1, 0);
  first[static_cast<size_t>(stages)] = L;
  for (int s = stages, l = L; s > 0; --s) {
    l = cut[static_cast<size_t>(s)][static_cast<size_t>(l)];
    first[static_cast<size_t>(s) - 1] = l;
  }
  return first;
}

namespace {

// The pipeline trainer; `site` says what it is allocating (out_of_memory.h).
TrainResult trainPipelineStage(const spec::TrainerSpec& ts, comm::Communicator& comm, const TrainOptions& opts,
                               detail::AllocationSite& site) {
  using detail::Clock;
  const int rank = comm.rank(), world = comm.size();
  const PipelineLayout lay = pipelineLayout(rank, world, ts.parallel.pipeline_stages);
  const int P = lay.stages, D = lay.replicas, p = lay.stage, d = lay.replica;
  const int M = std::max(1, ts.parallel.micro_batches);
  // The device as in the data-parallel trainer: "auto" is the GPU when this worker has one.
  const DeviceChoice dev = resolveDevice(opts.device.empty() ? ts.device : opts.device, localRankFromEnv(rank),
                                         localWorldSizeFromEnv(0));
  const int B = ts.batch_size;
  if (B % M != 0)
    throw SpecError(fmt::format("trainer: /trainer/parallel/micro_batches {} does not divide /trainer/batch_size {}", M, B));
  const int mb = B / M;

  MlpConfig cfg;
  cfg.layers = ts.model.layers;
  cfg.activation = ts.model.activation == "gelu" ? Activation::kGelu : Activation::kRelu;
  cfg.loss = ts.model.loss == "mse" ? Loss::kMse : Loss::kCrossEntropy;
  const bool adam = ts.optimizer.type == "adamw";
  const bool mse = cfg.loss == Loss::kMse;
  const std::vector<int> first = partitionStages(cfg.layers, P, ts.parallel.stage_layers);
  // Parameters of every stage (all ranks know the partition): for gathering the whole model.
  std::vector<size_t> stageSize(static_cast<size_t>(P), 0);
  for (int s = 0; s < P; ++s)
    for (int l = first[static_cast<size_t>(s)]; l < first[static_cast<size_t>(s) + 1]; ++l)
      stageSize[static_cast<size_t>(s)] += static_cast<size_t>(cfg.layers[static_cast<size_t>(l)] + 1) * cfg.layers[static_cast<size_t>(l) + 1];

  const int lo = first[static_cast<size_t>(p)], hi = first[static_cast<size_t>(p) + 1];
  site.layout.gpu = dev.cuda;
  site.at(detail::AllocationSite::kModel);
  std::unique_ptr<detail::StageMath> modelOwned = dev.cuda ? detail::makeCudaStage(cfg, lo, hi, ts.seed, adam, dev.index)
                                                           : detail::makeCpuStage(cfg, lo, hi, ts.seed, adam);
  detail::StageMath& model = *modelOwned;
  if (std::string(comm.backend()) == "nccl" && !model.onDevice())
    throw SpecError(fmt::format("trainer: the \"nccl\" communicator needs trainer.device \"cuda\" or \"auto\" with a GPU, "
                                "but this worker trains on {}", model.describe()));
  const size_t nParams = model.numParams();
  // Host copies of the stage's weights and optimizer state: checkpoints, hashes, staging.
  site.at(detail::AllocationSite::kHostCopies);
  std::vector<float> hostParams, state;
  assignFresh(hostParams, nParams);
  assignFresh(state, model.stateSize());
  site.at(detail::AllocationSite::kSetup);
  const bool firstStage = p == 0, lastStage = p == P - 1;

  // Sub-communicators: this replica's pipeline (P ranks, group rank = stage) carries the
  // activations and their gradients; the stage group (D ranks, group rank = replica) the
  // gradient average and the resumed state. Each has its own connections and executor, so
  // the stage group's all-reduce runs during the backward without holding up pipeline
  // transfers. With one replica the pipeline is the whole world.
  std::unique_ptr<comm::Communicator> pipeOwned, stageOwned;
  if (D > 1) {
    std::vector<int> pipeRanks, stageRanks;
    for (int s = 0; s < P; ++s) pipeRanks.push_back(lay.rankOf(d, s));
    for (int r = 0; r < D; ++r) stageRanks.push_back(lay.rankOf(r, p));
    pipeOwned = comm.group(pipeRanks, fmt::format("pipeline{}", d));
    stageOwned = comm.group(stageRanks, fmt::format("stage{}", p));
  }
  // Activations and gradients on the pipeline, the gradient average on the stage group and
  // the host collectives on the world, each through a StageComm (in place or staged).
  detail::StageComm worldComm(comm, model);
  detail::StageComm pipe(D > 1 ? *pipeOwned : comm, model);
  std::unique_ptr<detail::StageComm> stageGroup = D > 1 ? std::make_unique<detail::StageComm>(*stageOwned, model) : nullptr;
  const int prevStage = p - 1, nextStage = p + 1;
  const uint64_t hash = configHash(ts);
  const bool prefetch = prefetchBatches(ts.data.prefetch, dev.cuda);
  const int loaders = std::min(loaderThreads(ts.data.loader_threads, dev.cuda), ts.batch_size);  // (no more than rows)
  bool overlapGrads = D > 1 && overlapGradients(ts.overlap, dev.cuda);
  if (D > 1 && !ts.overlap.has_value()) {
    // "auto" is decided per node (its cores): every stage group overlaps only if all would.
    int32_t all = overlapGrads ? 1 : 0;
    worldComm.allreduceHost(&all, 1, comm::DataType::kInt32, comm::ReduceOp::kMin);
    overlapGrads = all == 1;
  }

  if (rank == 0 && opts.log) {
    std::string parts;
    for (int s = 0; s < P; ++s)
      parts += fmt::format("{}{}-{} ({} params)", s ? ", " : "", first[static_cast<size_t>(s)],
                           first[static_cast<size_t>(s) + 1] - 1, stageSize[static_cast<size_t>(s)]);
    opts.log(fmt::format("trainer: {} workers = {} replica{} x {} pipeline stages (layers {}), {} micro-batches of {}, "
                         "schedule {}, math on {}, {} communicator, batches {}{}{}",
                         world, D, D == 1 ? "" : "s", P, parts, M, mb, ts.parallel.schedule, model.describe(),
                         comm.backend(), prefetch ? "prefetched" : "loaded inline",
                         loaders > 1 ? fmt::format(" by {} threads", loaders) : "",
                         D == 1 ? "" : overlapGrads ? ", gradients reduced during backward" : ", gradients reduced after backward"));
  }

  // Resume: the replica-0 rank of each stage reads its stage's newest checkpoint from
  // dir/stage-<p>-of-<P>; every rank then checks that all stages resume from the same step
  // and copies its stage's state from its replica-0 rank.
  const std::string stageName = fmt::format("stage-{}-of-{}", p, P);
  const std::string stageDir = ts.checkpoint.dir.empty() ? std::string() : ts.checkpoint.dir + "/" + stageName;
  // {status, step, epoch, cursor, world, the LR schedule's state (5 words), the training
  // set's rows when it was written (0: not kept)}
  constexpr size_t kHeaderWords = 11;
  int64_t header[kHeaderWords] = {};
  std::string ckptPath;
  auto loadStage = [&](long long maxStep) {
    site.at(detail::AllocationSite::kCheckpoint);
    std::fill(header, header + kHeaderWords, 0);
    auto st = loadLatestCheckpoint(stageDir, [&](const std::string& w) { opts.warning(w); },
                                   &ckptPath, maxStep);
    if (st && (st->config_hash != hash || st->params.size() != nParams || st->momentum.size() != state.size())) {
      header[0] = -1;
    } else if (st) {
      header[0] = 1;
      header[1] = st->step;
      header[2] = st->epoch;
      header[3] = static_cast<int64_t>(st->cursor);
      header[4] = st->world;
      // (a file from before the schedule was kept: written at one global batch, batch_size x
      // its replicas, of the batch_size it resumes with as far as can be told)
      detail::scheduleToWords(st->schedule ? *st->schedule
                                           : legacyScheduleState(st->step, static_cast<uint64_t>(B) *
                                                                               static_cast<uint64_t>(st->world / P)),
                              header + 5);
      header[10] = static_cast<int64_t>(st->train_rows);
      model.loadParams(st->params.data());
      model.loadState(st->momentum.data());
    }
  };
  // The manifest (DIR/manifest.json, written once every stage has saved a step) records the
  // layout that wrote the directory: a different number of stages or another partition is
  // refused here, and so are the data-parallel trainer's checkpoints (DIR/ckpt-*.bin) and the
  // stage directories of another stage count, where this layout's stage files
  // (DIR/stage-<p>-of-<P>) would not be found and training would silently start over beside
  // them (checkpointLayoutMismatch; dtrain run said it before the launch, unless the
  // directory changed since). The step to resume from comes from the stage files (the newest
  // step all of them have), which is never older than the manifest's.
  std::vector<int> stageCounts;
  for (int s = 0; s < P; ++s) stageCounts.push_back(first[static_cast<size_t>(s) + 1] - first[static_cast<size_t>(s)]);
  const std::string manifestPath = ts.checkpoint.dir.empty() ? std::string() : ts.checkpoint.dir + "/manifest.json";
  // (rank 0's words, on every rank; "" when the directory holds none of another layout's)
  auto fromRankZero = [&](const std::string& text) {
    return detail::shareText(text,
                             [&](int64_t* w, size_t n) { worldComm.broadcastHost(w, n, comm::DataType::kInt64, 0); });
  };
  if (!ts.checkpoint.dir.empty())
    if (const std::string layoutError = fromRankZero(
            rank == 0 ? checkpointLayoutMismatch(ts, [&](const std::string& w) { opts.warning(w); }) : std::string());
        !layoutError.empty())
      throw SpecError(checkpointLayoutRefusal(layoutError));
  // (the fresh weights and optimizer state, kept in the host buffers until the stages agree:
  // should some stage hold nothing, the stages that loaded a step go back to them)
  if (d == 0 && !stageDir.empty()) {
    model.storeParams(hostParams.data());
    model.storeState(state.data());
    loadStage(-1);
  }
  std::vector<int64_t> headers(kHeaderWords * static_cast<size_t>(world));
  worldComm.allgatherHost(header, headers.data(), kHeaderWords, comm::DataType::kInt64);
  auto stageHeader = [&](int s) { return headers.data() + kHeaderWords * static_cast<size_t>(lay.rankOf(0, s)); };
  // What each stage held on start (status, newest step), for the messages below.
  std::vector<std::pair<int64_t, int64_t>> held;
  for (int s = 0; s < P; ++s) held.emplace_back(stageHeader(s)[0], stageHeader(s)[1]);
  auto describeHeld = [&] {
    std::string out;
    for (int s = 0; s < P; ++s)
      out += fmt::format("{}stage {} {}", s == 0 ? "" : ", ", s,
                         held[static_cast<size_t>(s)].first == 1
                             ? fmt::format("at step {}", held[static_cast<size_t>(s)].second)
                             : std::string("has none"));
    return out;
  };
  // A run stopped between two stages' writes leaves some stages one checkpoint ahead: all
  // go back to the newest step every stage has (each keeps its last 3). Until they agree: a
  // stage's file at that step may be damaged (skipped), which sends every stage further back
  // (once, the stages were refused as having no step in common while each held an intact
  // older one). Each round lowers the step or ends: a stage finds nothing, or all agree.
  int64_t firstCommon = -1, firstNewest = -1;
  for (;;) {
    bool allFound = true;
    int64_t common = std::numeric_limits<int64_t>::max(), newest = 0;
    for (int s = 0; s < P; ++s) {
      allFound = allFound && stageHeader(s)[0] == 1;
      common = std::min(common, stageHeader(s)[1]);
      newest = std::max(newest, stageHeader(s)[1]);
    }
    if (firstNewest < 0) {
      firstCommon = common;
      firstNewest = newest;
    }
    if (!allFound || common == newest) {
      if (allFound && common != firstNewest && rank == 0)
        opts.warning(fmt::format("the stage checkpoints in {} end at different steps ({} to {}); resuming all stages "
                                 "from step {}",
                                 ts.checkpoint.dir, firstCommon, firstNewest, common));
      break;
    }
    if (d == 0 && header[1] != common) loadStage(common);
    worldComm.allgatherHost(header, headers.data(), kHeaderWords, comm::DataType::kInt64);
  }
  // The training set's rows (word 10) are 0 in a stage file from before they were kept: not
  // a disagreement, the other stages' count holds for all.
  int64_t rows = 0;
  for (int s = 0; s < P; ++s) rows = std::max(rows, stageHeader(s)[10]);
  for (int s = 0; s < P; ++s) stageHeader(s)[10] = rows;
  for (int s = 0; s < P; ++s)
    if (stageHeader(s)[0] == -1)
      throw SpecError(checkpointRefusal(
          ts, fmt::format("the newest checkpoint in {}/stage-{}-of-{} was written by a different trainer config (model, "
                          "data, optimizer, seed or stage partition changed)",
                          ts.checkpoint.dir, s, P)));
  // A stage that held no intact checkpoint on start (the run stopped, or its disk filled,
  // before that stage's first one was written): there is no step to resume from, and every
  // stage starts from step 0 as a fresh run does (the data-parallel trainer does the same
  // with an empty directory); refusing would leave the job unable to ever restart. The
  // other stages' files of that first step are rewritten as training passes it again.
  bool someHeldNone = false;
  for (const auto& h : held) someHeldNone = someHeldNone || h.first == 0;
  if (someHeldNone && std::any_of(held.begin(), held.end(), [](const auto& h) { return h.first == 1; })) {
    // ... unless the manifest says that stage wrote a step: then its files were lost, and
    // starting over would throw that step away. Rank 0 reads it; every rank refuses alike.
    std::vector<bool> none;
    for (const auto& h : held) none.push_back(h.first == 0);
    if (const std::string lost = fromRankZero(rank == 0 ? stageFilesLost(ts, none) : std::string()); !lost.empty())
      throw SpecError("trainer: " + lost);
    if (rank == 0)
      opts.warning(
          fmt::format("the stage checkpoints in {} have no step in common ({}): every stage starts from "
                      "step 0",
                      ts.checkpoint.dir, describeHeld()));
    if (d == 0 && header[0] == 1) {
      model.loadParams(hostParams.data());
      model.loadState(state.data());
    }
    std::fill(headers.begin(), headers.end(), 0);
    ckptPath.clear();
  }
  for (int s = 0; s < P; ++s)
    if (std::memcmp(stageHeader(s), headers.data(), kHeaderWords * sizeof(int64_t)) != 0)
      throw SpecError(
          fmt::format("trainer: the stage checkpoints in {} have no intact step in common ({} on start; "
                      "each stage's older ones were tried); remove them or use another "
                      "/trainer/checkpoint/dir",
                      ts.checkpoint.dir, describeHeld()));
  for (size_t k = 0; k < kHeaderWords; ++k) header[k] = headers[k];
  if (D > 1 && header[0] == 1) {
    if (stageGroup->direct()) {
      stageOwned->broadcast(model.params(), nParams, comm::DataType::kFloat32, 0);
      stageOwned->broadcast(model.state(), state.size(), comm::DataType::kFloat32, 0);
    } else {
      model.storeParams(hostParams.data());
      model.storeState(state.data());
      stageOwned->broadcast(hostParams.data(), nParams, comm::DataType::kFloat32, 0);
      stageOwned->broadcast(state.data(), state.size(), comm::DataType::kFloat32, 0);
      model.loadParams(hostParams.data());
      model.loadState(state.data());
    }
  }

  const int in = cfg.layers.front(), out = cfg.layers.back();
  site.at(detail::AllocationSite::kData);
  Datasets data = openDatasets(ts);
  const std::unique_ptr<Dataset>&trainSet = data.train, &evalSet = data.eval;
  if (ts.data.type != "synthetic") site.layout.data_rows = trainSet->size() + evalSet->size();
  site.layout.data_shared = data.shared;
  if (rank == 0 && opts.log && !data.note.empty()) opts.log("trainer: data " + data.note);
  site.layout.eval_rows = static_cast<long long>(evalSet->size());
  site.at(detail::AllocationSite::kBatch);
  const uint64_t N = trainSet->size();
  // (every rank: each read the data and has the stages' common header; rank 0's words on
  // every rank, as above)
  if (header[0] == 1) {
    const std::string own = trainRowsMismatch(ts, N, static_cast<uint64_t>(header[10]),
                                              d == 0 && !ckptPath.empty() ? ckptPath : "the stages' checkpoint");
    const std::string why = fromRankZero(rank == 0 ? own : std::string());
    if (!why.empty() || !own.empty()) throw SpecError(why.empty() ? own : why);
  }
  const uint64_t globalBatch = static_cast<uint64_t>(B) * static_cast<uint64_t>(D);
  const uint64_t stepsPerEpoch = N / globalBatch;
  if (stepsPerEpoch == 0)
    throw SpecError(fmt::format("trainer: the training set ({} samples) is smaller than one global batch ({} = "
                                "batch_size {} x {} replicas); use more samples or a smaller batch",
                                N, globalBatch, B, D));
  long long step = header[1];
  const int startEpoch = static_cast<int>(header[2]);
  const uint64_t startCursor = static_cast<uint64_t>(header[3]);
  const long long totalSteps = plannedSteps(ts, step, startEpoch, startCursor, N, globalBatch);
  if (header[0] == 1 && rank == 0 && opts.log) opts.log(resumeLine(ckptPath, header, world, step >= totalSteps, ts));
  // The LR schedule runs on samples trained (lr_schedule.h): a resume with another number of
  // replicas goes on where it was.
  const ScheduleState resumedSchedule = detail::scheduleFromWords(header + 5);
  const LrSchedule schedule =
      planSchedule(ts, header[0] == 1 ? &resumedSchedule : nullptr, step, startEpoch, startCursor, N, globalBatch);
  uint64_t samplesTrained = header[0] == 1 ? resumedSchedule.samples : 0;
  // Collective: stops every rank at once when any stage's weights are not finite.
  auto checkWeightsFinite = [&] {
    model.storeParams(hostParams.data());
    int32_t finite = detail::allFinite(hostParams.data(), hostParams.size()) ? 1 : 0;
    worldComm.allreduceHost(&finite, 1, comm::DataType::kInt32, comm::ReduceOp::kMin);
    if (!finite) throw detail::divergedError(ts, step, "the weights are not finite");
  };
  // With checkpoint.async the stage files are written on a thread while the next steps train
  // (from hostParams and state: nothing refills them before finishSave); the manifest follows
  // once every stage's file is durable, at the next checkpoint or the end of training.
  // Signals (TrainOptions::control): agreed on at step boundaries over the world; control.h.
  detail::ControlPoints control(opts.control, std::string(comm.backend()) != "nccl", kControlPeriodOnDevice);
  detail::CheckpointWriter writer(ts.checkpoint.async && d == 0, opts.heartbeat,
                                  [&](const std::string& w) { opts.warning(w); }, ts.checkpoint.dir);
  bool savePending = false;  // the same on every rank: saves are collective
  spec::PipelineManifest pending;
  auto finishSave = [&] {
    if (!savePending) return;
    savePending = false;
    const std::string written = writer.wait();
    int32_t saved = 1;
    worldComm.allreduceHost(&saved, 1, comm::DataType::kInt32, comm::ReduceOp::kSum);
    if (rank != 0) return;
    for (int s = 0; s < P; ++s)
      pending.files.push_back(
          fmt::format("stage-{}-of-{}/{}", s, P, std::filesystem::path(written).filename().string()));
    try {
      spec::writePipelineManifest(manifestPath, pending, writer.rootFd());
    } catch (const IoError& e) {  // (as a stage file's write: see save)
      throw SpecError(checkpointWriteRefusal(ts.checkpoint.dir, pending.step, e.what()));
    }
  };
  // Collective (every rank calls it at the same steps): replica 0 of each stage writes its
  // stage's file; once all are durable, rank 0 writes the manifest naming them.
  auto save = [&](long long epoch, uint64_t cursor) {
    if (stageDir.empty()) return;
    control.phase(TrainControl::kSaving);
    finishSave();
    if (cursor + globalBatch > N) {
      ++epoch;
      cursor = 0;
    }
    // Weights that are not finite (a step that overflowed) are never written; every rank
    // learns it here together (a rank stopping alone would leave its peers to fail on a lost
    // peer).
    checkWeightsFinite();
    if (d == 0) {
      // The same file from either device: a GPU stage's checkpoint resumes on the CPU and back.
      model.storeState(state.data());
      if (opts.heartbeat) opts.heartbeat();
      writer.start(detail::checkpointJob(
          ts.checkpoint.dir, stageName, CheckpointView{hash, step, epoch, cursor, world, hostParams, state, configDescription(ts),
                                   scheduleState(schedule, samplesTrained), N},
          opts.on_checkpoint_bytes, std::make_shared<detail::ControlPoints::Write>(control.control())));
      if (opts.heartbeat) opts.heartbeat();
    }
    pending = spec::PipelineManifest{};
    pending.step = step;
    pending.epoch = epoch;
    pending.cursor = cursor;
    pending.world = world;
    pending.stages = P;
    pending.stage_layers = stageCounts;
    pending.config_hash = fmt::format("{:016x}", hash);
    savePending = true;
    if (!ts.checkpoint.async) finishSave();
  };

  // Inputs (first stage) and targets (last stage) of the whole per-replica batch, loaded
  // before the schedule (one step ahead, with trainer.data.prefetch) so that data loading
  // never counts as pipeline time. bx/by: this step's batch; x/y: the evaluation's.
  // (A middle stage loads nothing: no thread for it.)
  detail::BatchLoader loader({trainSet.get(), B, in, out, mse, firstStage, lastStage, prefetch && (firstStage || lastStage),
                              firstStage || lastStage ? loaders : 1});
  const float* bx = nullptr;
  const float* by = nullptr;
  std::vector<float> x(firstStage ? static_cast<size_t>(B) * in : 0);
  std::vector<float> y(lastStage ? static_cast<size_t>(B) * (mse ? out : 1) : 0);
  const size_t yWidth = mse ? static_cast<size_t>(out) : 1;
  auto load = [&](const Dataset& set, uint64_t index, int i) {
    int label = 0;
    std::vector<float> scratchX(firstStage ? 0 : static_cast<size_t>(in));
    std::vector<float> scratchY(lastStage ? 0 : (mse ? static_cast<size_t>(out) : 0));
    float* xi = firstStage ? x.data() + static_cast<size_t>(i) * in : scratchX.data();
    float* yi = mse ? (lastStage ? y.data() + static_cast<size_t>(i) * out : scratchY.data()) : nullptr;
    set.sample(index, xi, &label, yi);
    if (lastStage && !mse) y[static_cast<size_t>(i)] = static_cast<float>(label);
  };

  double stepLoss = 0;
  std::vector<float> gradTail(std::min<size_t>(nParams, 64));
  int stepCorrect = 0;
  double computeS = 0;  // forward + backward on this rank, this step
  detail::Trace trace(opts.trace_dir.empty() ? std::string() : fmt::format("{}/trace-rank{}.json", opts.trace_dir, rank), rank,
                      fmt::format("stage {}, replica {}", p, d));
  // Runs fn, recording it in the trace as name (micro-batch m, or -1).
  auto traced = [&](const char* name, int m, auto&& fn) {
    if (!trace.on()) return fn();
    auto t0 = Clock::now();
    fn();
    trace.add(name, m, step, t0, Clock::now());
  };
  // Compute (forward "F" or backward "B" of micro-batch m): counted in computeS, which the
  // bubble fraction is measured against, and traced.
  auto timed = [&](const char* name, int m, auto&& fn) {
    auto t0 = Clock::now();
    fn();
    auto t1 = Clock::now();
    computeS += std::chrono::duration<double>(t1 - t0).count();
    trace.add(name, m, step, t0, t1);
  };
  const int actIn = model.inWidth(), actOut = model.outWidth();
  // One micro-batch's forward: receive (or copy) its input, compute, and on the last stage
  // the loss. The send to the next stage is separate (the 1F1B order needs it deferred).
  // received: the input is already in model.input(m) (1F1B's steady state receives it
  // together with sending a gradient).
  auto forward = [&](int m, int n, int denom, const float* xs, const float* ys, bool received = false) {
    if (opts.on_micro_batch) opts.on_micro_batch(step, m);
    float* inBuf = model.input(m, n);
    if (firstStage) model.copyToBackend(inBuf, xs + static_cast<size_t>(m) * mb * in, static_cast<size_t>(n) * in * sizeof(float));
    else if (!received) traced("recv act", m, [&] { pipe.recv(inBuf, static_cast<size_t>(n) * actIn * sizeof(float), prevStage); });
    const float* o = nullptr;
    timed("F", m, [&] {
      o = model.forward(m);
      if (lastStage) {
        int c = 0;
        stepLoss += model.loss(m, ys + static_cast<size_t>(m) * mb * yWidth, denom, &c) * n;
        stepCorrect += c;
      }
    });
    return o;
  };
  const size_t actInBytes = static_cast<size_t>(mb) * actIn * sizeof(float);
  const size_t actOutBytes = static_cast<size_t>(mb) * actOut * sizeof(float);
  auto sendAct = [&](const float* o, int n) {
    traced("send act", -1, [&] { pipe.send(o, static_cast<size_t>(n) * actOut * sizeof(float), nextStage); });
  };
  auto recvGrad = [&](int m) {
    float* g = model.outputGrad(m);
    traced("recv grad", m, [&] { pipe.recv(g, actOutBytes, nextStage); });
  };

  // The stage group's gradient average, started layer by layer as the last micro-batch's
  // backward finishes each layer (trainer.overlap), else after the whole backward. Every
  // replica issues the same all-reduces in the same order; the results are bit-identical on
  // all of them. A GPU stage on tcp stages each layer's gradients through hostGrads (and
  // copies the averages back after the wait).
  std::vector<comm::WorkPtr> gradWork;
  std::vector<float> hostGrads(D > 1 && !stageGroup->direct() ? nParams : 0);
  auto reduceLayer = [&](int k) {
    auto [at, count] = model.layerSpan(k);
    float* g = model.grads() + at;
    if (!hostGrads.empty()) {
      model.copyToHost(hostGrads.data() + at, g, count * sizeof(float));
      g = hostGrads.data() + at;
    }
    gradWork.push_back(stageOwned->allreduceAsync(g, count, comm::DataType::kFloat32, comm::ReduceOp::kAvg));
  };
  // Backward of micro-batch m; returns the gradient of the stage's input (nullptr on the
  // first stage) without sending it.
  auto backwardOnly = [&](int m) {
    const float* g = nullptr;
    std::function<void(int)> onLayer;
    if (overlapGrads && m == M - 1) onLayer = reduceLayer;
    timed("B", m, [&] { g = model.backward(m, onLayer); });
    return g;
  };
  auto backward = [&](int m) {
    const float* g = backwardOnly(m);
    if (!firstStage) traced("send grad", m, [&] { pipe.send(g, actInBytes, prevStage); });
  };

  // GPipe: all forwards, then all backwards (in the same micro-batch order, so the gradient
  // sums are bit-identical to 1F1B's).
  auto runGpipe = [&] {
    for (int m = 0; m < M; ++m) {
      const float* o = forward(m, mb, B, bx, by);
      if (!lastStage) sendAct(o, mb);
    }
    for (int m = 0; m < M; ++m) {
      if (!lastStage) recvGrad(m);
      backward(m);
    }
  };
  // 1F1B (PipeDream-Flush, as Megatron-LM schedules it): stage p runs w = min(P-p-1, M)
  // warm-up forwards, then alternates one forward and one backward, then drains the remaining
  // backwards, so at most P - p micro-batches are stashed. In the steady state a stage sends
  // its output while receiving the gradient of an earlier micro-batch from the next stage,
  // and sends its input gradient while receiving the next input from the previous stage:
  // each as one full-duplex sendRecv, which the neighbour issues as the mirror image, so an
  // activation leaves as soon as it is computed and neither side blocks on a full socket.
  auto runOneFOneB = [&] {
    const int w = std::min(P - p - 1, M), steady = M - w;
    for (int m = 0; m < w; ++m) sendAct(forward(m, mb, B, bx, by), mb);
    for (int i = 0; i < steady; ++i) {
      const float* o = forward(w + i, mb, B, bx, by, /*received=*/i > 0);
      if (!lastStage)
        traced("send act, recv grad", i, [&] {
          pipe.sendRecv(o, actOutBytes, nextStage, model.outputGrad(i), actOutBytes, nextStage);
        });
      const float* g = backwardOnly(i);
      if (firstStage) continue;
      if (i + 1 < steady)
        traced("send grad, recv act", i, [&] {
          pipe.sendRecv(g, actInBytes, prevStage, model.input(w + i + 1, mb), actInBytes, prevStage);
        });
      else
        traced("send grad", i, [&] { pipe.send(g, actInBytes, prevStage); });
    }
    for (int i = steady; i < M; ++i) {
      recvGrad(i);
      backward(i);
    }
  };
  const bool gpipe = ts.parallel.schedule == "gpipe";

  TrainResult result;
  result.pipeline_stages = P;
  result.stage_params = nParams;
  const long long firstStep = step;
  // (the training's checkpoint directory and config: a later run resuming from them draws
  // this run's rows too)
  MetricsLog metrics(rank == 0 ? opts.metrics_dir : std::string(),
                     {opts.run_id, opts.attempt, world, firstStep, ts.checkpoint.dir, fmt::format("{:016x}", hash)});
  const auto runStart = Clock::now();
  double windowLoss = 0, windowCorrect = 0, windowSamples = 0;
  double windowCompute = 0, windowSchedule = 0;  // this rank, since the last log
  double totalCompute = 0, totalSchedule = 0;
  long long windowSteps = 0;
  detail::Progress progress(firstStep, totalSteps, globalBatch);
  // Per log window, summed over ranks: loss, correct, samples, then each stage's compute
  // seconds (replica 0), then every rank's compute seconds and the first stages' schedule
  // seconds (see pipelineBubble).
  std::vector<double> stats(5 + static_cast<size_t>(P));
  std::string bubbleText = "-";
  control.phase(TrainControl::kTraining);
  for (int epoch = startEpoch; epoch < ts.epochs && step < totalSteps; ++epoch) {
    EpochOrder order(N, ts.data.seed ^ ts.seed, static_cast<uint64_t>(epoch));
    for (uint64_t cursor = epoch == startEpoch ? startCursor : 0; cursor + globalBatch <= N && step < totalSteps;
         cursor += globalBatch) {
      if (opts.on_step) opts.on_step(step);
      control.stepStarted();
      if (firstStage || lastStage) {
        // Replica d takes the samples rank d takes in the data-parallel trainer with D ranks.
        auto batchAt = [&](uint64_t at) {
          std::vector<uint64_t> idx(static_cast<size_t>(B));
          const uint64_t base = at + static_cast<uint64_t>(d) * B;
          for (int i = 0; i < B; ++i) idx[static_cast<size_t>(i)] = order[base + static_cast<uint64_t>(i)];
          return idx;
        };
        if (loader.pending() == 0) loader.request(batchAt(cursor));  // an epoch's first step
        const auto& batch = loader.take();
        if (cursor + 2 * globalBatch <= N && step + 1 < totalSteps) loader.request(batchAt(cursor + globalBatch));
        bx = batch.x.data();
        by = batch.y.data();
        if (opts.on_batch && firstStage) opts.on_batch(epoch, batch.indices.data(), B);
      }
      model.zeroGrads();
      stepLoss = 0;
      stepCorrect = 0;
      computeS = 0;
      trace.setOn(step > firstStep && step <= firstStep + detail::kTraceSteps);
      const auto schedStart = Clock::now();
      if (gpipe) runGpipe();
      else runOneFOneB();
      const double schedS = std::chrono::duration<double>(Clock::now() - schedStart).count();
      windowCompute += computeS;
      windowSchedule += schedS;
      // The run's totals leave out the first step (buffers and connections warming up), as
      // samples/s does.
      if (step > firstStep) {
        totalCompute += computeS;
        totalSchedule += schedS;
      }

      // The stage group's average over the replicas (started during the last backward when
      // overlapping): every replica steps with bit-identical gradients.
      if (D > 1) {
        if (!overlapGrads)
          for (int k = model.numLayers() - 1; k >= 0; --k) reduceLayer(k);
        traced("stage all-reduce wait", -1, [&] {
          for (auto& w : gradWork) w->wait();
        });
        gradWork.clear();
        if (!hostGrads.empty()) model.copyToBackend(model.grads(), hostGrads.data(), nParams * sizeof(float));
      }
      double clipSquares = 0;  // (with clipping: the whole pipeline's squared gradient norm)
      if (ts.grad_clip_norm > 0) {
        // The global norm spans all stages: each stage of the pipeline contributes its
        // squares (every replica holds the same averaged gradients, so the same norm).
        double sq = model.gradSquares();
        pipe.allreduceHost(&sq, 1, comm::DataType::kFloat64, comm::ReduceOp::kSum);
        clipSquares = sq;
        if (std::isfinite(sq)) model.clipGrads(std::sqrt(sq), ts.grad_clip_norm);
      }
      // Diverged (a loss that is not finite): the last stage's gradients carry it, and through
      // the gradients it sends back most of the others' (a ReLU that was off masks some). The
      // verdict is the pipeline's, taken together (the replicas of a stage hold the same
      // averaged gradients, so every pipeline agrees): every rank stops at this step, none
      // fails on a lost peer. With clipping, the global norm already spans every gradient.
      int32_t finite = std::isfinite(clipSquares) ? 1 : 0;
      if (ts.grad_clip_norm <= 0) {
        model.copyToHost(gradTail.data(), model.grads() + nParams - gradTail.size(), gradTail.size() * sizeof(float));
        finite = detail::allFinite(gradTail.data(), gradTail.size()) ? 1 : 0;
        pipe.allreduceHost(&finite, 1, comm::DataType::kInt32, comm::ReduceOp::kMin);
      }
      if (!finite) throw detail::divergedError(ts, step + 1, "the loss is not finite (NaN or infinite gradients)");
      const auto optStart = Clock::now();
      const float lr = static_cast<float>(learningRate(ts, schedule, samplesTrained));
      const float wd = static_cast<float>(ts.optimizer.weight_decay);
      if (!adam) {
        model.sgdStep({lr, wd, static_cast<float>(ts.optimizer.momentum), ts.optimizer.nesterov});
      } else {
        const double t = static_cast<double>(step + 1);
        model.adamwStep({lr, wd, static_cast<float>(ts.optimizer.beta1), static_cast<float>(ts.optimizer.beta2),
                         static_cast<float>(ts.optimizer.eps), static_cast<float>(1.0 - std::pow(ts.optimizer.beta1, t)),
                         static_cast<float>(std::sqrt(1.0 - std::pow(ts.optimizer.beta2, t)))});
      }
      trace.add("optimizer", -1, step, optStart, Clock::now());
      ++step;
      samplesTrained += globalBatch;
      ++windowSteps;
      progress.stepDone(step);
      if (rank == 0 && opts.status && progress.statusDue(step))
        opts.status(fmt::format("epoch {}/{} {} loss {} {} bubble {} eta {}", epoch + 1, ts.epochs,
                                progress.bar(step),
                                result.final_loss > 0 ? fmt::format("{:.4f}", result.final_loss) : std::string("-"),
                                detail::rateText(progress.samplesPerSecond(step)), bubbleText, progress.eta(step)));
      // A signal's request, agreed on by every rank (a checkpoint, or a stop after one).
      const detail::ControlPoints::Request request = control.agree(
          step, step == totalSteps,
          [&](int32_t* r) { return comm.allreduceAsync(r, 1, comm::DataType::kInt32, comm::ReduceOp::kMax); },
          [&](int32_t* r) { worldComm.allreduceHost(r, 1, comm::DataType::kInt32, comm::ReduceOp::kMax); });
      windowLoss += stepLoss;
      windowCorrect += stepCorrect;
      windowSamples += lastStage ? B : 0;
      // Logged before a checkpoint or a stop, so a run stopped by a signal has its last step's
      // row in metrics.jsonl too (every rank agreed on the stop: all take part in the sum).
      if (step % ts.log_every_steps == 0 || step == totalSteps || request.kind == detail::kStopRequest) {
        std::fill(stats.begin(), stats.end(), 0.0);
        stats[0] = windowLoss;
        stats[1] = windowCorrect;
        stats[2] = windowSamples;
        if (d == 0) stats[3 + static_cast<size_t>(p)] = windowCompute / static_cast<double>(windowSteps);
        stats[3 + static_cast<size_t>(P)] = windowCompute;
        stats[4 + static_cast<size_t>(P)] = p == 0 ? windowSchedule : 0;
        worldComm.allreduceHost(stats.data(), stats.size(), comm::DataType::kFloat64, comm::ReduceOp::kSum);
        result.final_loss = stats[0] / stats[2];
        const double bubble = detail::pipelineBubble(stats[3 + static_cast<size_t>(P)], stats[4 + static_cast<size_t>(P)], P);
        bubbleText = fmt::format("{:.1f}%", 100 * bubble);
        std::string stageText;
        for (int s = 0; s < P; ++s) stageText += fmt::format("{}{}", s ? "/" : "", detail::msText(1e3 * stats[3 + static_cast<size_t>(s)]));
        const double sps = progress.samplesPerSecond(step);
        const double acc = mse ? std::nan("") : stats[1] / stats[2];  // regression has no accuracy
        metrics.record({step, epoch + 1, result.final_loss, acc, sps > 0 ? sps : std::nan(""), learningRate(ts, schedule, samplesTrained - globalBatch),
                        std::chrono::duration<double>(Clock::now() - runStart).count()});
        if (rank == 0 && opts.log)
          opts.log(fmt::format("epoch {}/{} step {}/{} loss {:.4f}{} {} stage ms {} bubble {} eta {}",
                               epoch + 1, ts.epochs, step, totalSteps, result.final_loss, mse ? "" : fmt::format(" acc {:.1f}%", 100 * acc),
                               detail::rateText(sps), stageText, bubbleText, progress.eta(step)));
        windowLoss = windowCorrect = windowSamples = 0;
        windowCompute = windowSchedule = 0;
        windowSteps = 0;
      }
      const bool periodic =
          (ts.checkpoint.every_steps > 0 && step % ts.checkpoint.every_steps == 0) || step == totalSteps;
      const bool requested = request.kind != detail::kNoRequest;
      if (periodic || (requested && !stageDir.empty())) save(epoch, cursor + globalBatch);
      if (requested) {
        const std::string sig = dtrain::signalName(request.signal);
        // (each stage's file, then the manifest naming them)
        const std::string files =
            stageDir.empty() ? std::string()
                             : fmt::format("{}/stage-*-of-{}/{}", ts.checkpoint.dir, P,
                                           std::filesystem::path(checkpointPath(stageDir, step)).filename().string());
        if (request.kind == detail::kStopRequest) {
          finishSave();  // every stage's file and the manifest are durable before the exit
          if (rank == 0 && opts.log)
            opts.log(files.empty() ? fmt::format("{}: stopping at step {} of {}; no checkpoint written (no "
                                                 "/trainer/checkpoint/dir)", sig, step, totalSteps)
                                   : fmt::format("{}: stopping at step {} of {}; final checkpoint written to {} and {}",
                                                 sig, step, totalSteps, files, manifestPath));
          // (the manifest is what a resume reads: the summary's checkpoint, as at the end)
          throw TrainingStopped(request.signal, step, files.empty() ? std::string() : manifestPath);
        }
        if (rank == 0 && opts.log)
          opts.log(files.empty() ? fmt::format("{}: no checkpoint at step {}: /trainer/checkpoint/dir is not set, so "
                                               "there is nowhere to write one; training goes on", sig, step)
                   : ts.checkpoint.async
                       ? fmt::format("{}: checkpoint at step {} being written to {} (checkpoint.async; {} follows with "
                                     "the next checkpoint)", sig, step, files, manifestPath)
                       : fmt::format("{}: checkpoint at step {} written to {} and {}", sig, step, files, manifestPath));
      }
      control.phase(TrainControl::kTraining);
    }
  }
  trace.setOn(false);
  if (const std::string problem = trace.write(); !problem.empty()) opts.warning(problem);
  result.steps = step;
  result.steps_run = step - firstStep;
  result.samples_per_s = progress.samplesPerSecond(step);
  {
    // Whole-run timing: each stage's compute per step (replica 0) and the mean bubble.
    // (stage_ms stays empty when no step was timed: a run of one step)
    std::vector<double> t(static_cast<size_t>(P) + 2, 0.0);
    const long long steps = step - firstStep - 1;
    if (d == 0 && steps > 0) t[static_cast<size_t>(p)] = 1e3 * totalCompute / static_cast<double>(steps);
    t[static_cast<size_t>(P)] = totalCompute;
    t[static_cast<size_t>(P) + 1] = p == 0 ? totalSchedule : 0;
    worldComm.allreduceHost(t.data(), t.size(), comm::DataType::kFloat64, comm::ReduceOp::kSum);
    if (steps > 0) result.stage_ms.assign(t.begin(), t.begin() + P);
    result.bubble_fraction = detail::pipelineBubble(t[static_cast<size_t>(P)], t[static_cast<size_t>(P) + 1], P);
  }
  control.phase(TrainControl::kSaving);
  finishSave();  // the last checkpoint is durable before the result (and hostParams are free)
  // (a stop from here ends the process: the curve so far is drawn, rank 0's summary says
  // where the run stopped; train_signals.h)
  detail::FinishingWords lastWords(control, [&metrics, &opts, step] {
    metrics.finish();
    if (opts.on_stop_while_finishing) opts.on_stop_while_finishing(step);
  });
  checkWeightsFinite();  // (the last step may have overflowed with finite gradients)
  result.peak_activation_bytes = model.peakBytes();

  site.at(detail::AllocationSite::kEval);
  // Held-out evaluation: chunks of up to B samples round-robin over the replicas, each
  // through the pipeline without micro-batching.
  const uint64_t E = evalSet->size();
  double ev[3] = {0, 0, 0};
  for (uint64_t start = static_cast<uint64_t>(d) * B; start < E; start += globalBatch) {
    const int n = static_cast<int>(std::min<uint64_t>(B, E - start));
    if (opts.heartbeat) opts.heartbeat();
    if (firstStage || lastStage)
      for (int i = 0; i < n; ++i) load(*evalSet, start + static_cast<uint64_t>(i), i);
    float* inBuf = model.input(0, n);
    if (firstStage) model.copyToBackend(inBuf, x.data(), static_cast<size_t>(n) * in * sizeof(float));
    else pipe.recv(inBuf, static_cast<size_t>(n) * actIn * sizeof(float), prevStage);
    const float* o = model.forward(0);
    if (lastStage) {
      int correct = 0;
      ev[0] += model.loss(0, y.data(), n, &correct) * n;
      ev[1] += correct;
      ev[2] += n;
    } else {
      sendAct(o, n);
    }
  }
  worldComm.allreduceHostAlive(ev, 3, comm::DataType::kFloat64, comm::ReduceOp::kSum, opts.heartbeat);
  result.eval_loss = ev[2] > 0 ? ev[0] / ev[2] : 0;
  result.eval_accuracy = ev[2] > 0 ? ev[1] / ev[2] : 0;
  result.eval_samples = static_cast<uint64_t>(ev[2]);
  if (ev[2] > 0) metrics.recordEval(step, result.eval_loss, mse ? std::nan("") : result.eval_accuracy);
  metrics.finish();

  // Replicas of a stage must hold bit-identical weights. (hostParams hold them: copied by
  // checkWeightsFinite after training; the evaluation does not change them.)
  const std::string stageHash = sha256Hex(hostParams.data(), nParams * sizeof(float));
  std::vector<char> all(64 * static_cast<size_t>(world));
  worldComm.allgatherHost(stageHash.data(), all.data(), 64 / 4, comm::DataType::kInt32);
  for (int r = 0; r < D; ++r) {
    const char* h = all.data() + 64 * static_cast<size_t>(lay.rankOf(r, p));
    if (std::memcmp(h, stageHash.data(), 64) != 0)
      throw InternalError(fmt::format("trainer: stage {}: rank {}'s weights differ from rank {}'s after training (sha256 {} "
                                      "vs {})", p, lay.rankOf(r, p), rank, std::string(h, 64), stageHash));
  }
  // The job's hash is that of the whole model laid out as with P = 1 (layer by layer), so it
  // compares across layouts: replica 0's stages send their parts to rank 0, which hashes the
  // concatenation and broadcasts it.
  char jobHash[64] = {};
  if (rank == 0) {
    site.at(detail::AllocationSite::kGather);
    std::vector<float> whole(nParams);
    std::copy(hostParams.begin(), hostParams.end(), whole.begin());
    for (int s = 1; s < P; ++s) {
      const size_t at = whole.size();
      whole.resize(at + stageSize[static_cast<size_t>(s)]);
      worldComm.recvHost(whole.data() + at, stageSize[static_cast<size_t>(s)] * sizeof(float), lay.rankOf(0, s));
    }
    const std::string h = sha256Hex(whole.data(), whole.size() * sizeof(float));
    std::memcpy(jobHash, h.data(), 64);
    if (opts.final_params) *opts.final_params = std::move(whole);
  } else {
    if (d == 0) worldComm.sendHost(hostParams.data(), nParams * sizeof(float), 0);
    if (opts.final_params) *opts.final_params = hostParams;
  }
  worldComm.broadcastHost(jobHash, 64 / 4, comm::DataType::kInt32, 0);
  result.weights_sha256.assign(jobHash, 64);
  return result;
}

}  // namespace

TrainResult trainPipeline(const spec::TrainerSpec& ts, comm::Communicator& comm, const TrainOptions& opts) {
  return detail::withAllocationSite(ts, comm.rank(), comm.size(), [&](detail::AllocationSite& site) {
    return trainPipelineStage(ts, comm, opts, site);
  });
}

}  // namespace dtrain::train
