#include "dtrain/train/trainer.h"

#include <openssl/evp.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/memory.h"
#include "dtrain/train/backend.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/mlp.h"
#include "dtrain/train/pipeline.h"

#include "batch_loader.h"
#include "checkpoint_writer.h"
#include "control.h"
#include "diverged.h"
#include "progress.h"
#include "trace.h"
#include "host_collectives.h"
#include "out_of_memory.h"

namespace dtrain::train {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

long long plannedSteps(const spec::TrainerSpec& ts, long long step, int startEpoch, uint64_t startCursor, uint64_t samples,
                       uint64_t globalBatch) {
  long long total = step;
  for (int e = startEpoch; e < ts.epochs; ++e)
    total += static_cast<long long>((samples - (e == startEpoch ? std::min(startCursor, samples) : 0)) / globalBatch);
  return ts.max_steps > 0 ? std::min(total, ts.max_steps) : total;
}

std::string sha256Hex(const void* data, size_t bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, bytes, md, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

std::vector<Bucket> planBuckets(const std::vector<size_t>& offsets, size_t bucketFloats, size_t firstBucketFloats) {
  std::vector<Bucket> out;
  int layers = static_cast<int>(offsets.size()) - 1;
  size_t end = offsets.back();
  for (int l = layers - 1; l >= 0; --l) {
    bool lastLayer = l == 0;
    size_t cap = out.empty() ? std::min(bucketFloats, firstBucketFloats) : bucketFloats;
    if (end - offsets[static_cast<size_t>(l)] >= cap || lastLayer) {
      out.push_back({offsets[static_cast<size_t>(l)], end, l});
      end = offsets[static_cast<size_t>(l)];
    }
  }
  return out;
}

namespace {

// The data-parallel trainer; `site` says what it is allocating (out_of_memory.h).
TrainResult trainDataParallel(const spec::TrainerSpec& ts, comm::Communicator& comm, const TrainOptions& opts,
                              detail::AllocationSite& site) {
  const int rank = comm.rank(), world = comm.size();
  // (before anything is loaded: a trace directory it cannot write is said at once)
  detail::Trace trace(opts.trace_dir.empty() ? std::string() : fmt::format("{}/trace-rank{}.json", opts.trace_dir, rank),
                      rank, fmt::format("data-parallel, {} of {}", rank, world));
  MlpConfig cfg;
  cfg.layers = ts.model.layers;
  cfg.activation = ts.model.activation == "gelu" ? Activation::kGelu : Activation::kRelu;
  cfg.loss = ts.model.loss == "mse" ? Loss::kMse : Loss::kCrossEntropy;
  const bool adam = ts.optimizer.type == "adamw";
  const DeviceChoice dev = resolveDevice(opts.device.empty() ? ts.device : opts.device, localRankFromEnv(rank),
                                           localWorldSizeFromEnv(0));
  site.layout.gpu = dev.cuda;
  site.at(detail::AllocationSite::kModel);
  // The same initial weights on either backend (Mlp::init on the host from ts.seed).
  std::unique_ptr<detail::MathBackend> be =
      dev.cuda ? detail::makeCudaBackend(cfg, ts.seed, adam, dev.index) : detail::makeCpuBackend(cfg, ts.seed, adam);
  // NCCL takes device pointers; the TCP backend host pointers. A GPU backend with a host
  // communicator stages gradients through host memory (tests, single workers); a CPU
  // backend cannot feed NCCL.
  const bool commOnDevice = std::string(comm.backend()) == "nccl";
  if (commOnDevice && !be->onDevice())
    throw SpecError(fmt::format("trainer: the \"nccl\" communicator needs trainer.device \"cuda\" or \"auto\" with a GPU, "
                                "but this worker trains on {}", be->describe()));
  const bool direct = commOnDevice == be->onDevice();
  detail::HostCollectives hostComm(comm, *be);
  const size_t P = be->numParams();
  // Host copies of the weights and optimizer state: checkpoints, the hash and staging.
  site.at(detail::AllocationSite::kHostCopies);
  std::vector<float> params, momentum;
  assignFresh(params, P);
  assignFresh(momentum, be->stateSize());
  site.at(detail::AllocationSite::kSetup);
  const uint64_t hash = configHash(ts);
  const bool prefetch = prefetchBatches(ts.data.prefetch, dev.cuda);
  const int loaders = std::min(loaderThreads(ts.data.loader_threads, dev.cuda), ts.batch_size);  // (no more than rows)
  bool overlap = overlapGradients(ts.overlap, dev.cuda);
  if (world > 1 && !ts.overlap.has_value()) {
    // "auto" is decided per node (its cores): every rank overlaps only if all would, so that
    // the start line speaks for all of them.
    int32_t all = overlap ? 1 : 0;
    hostComm.allreduce(&all, 1, comm::DataType::kInt32, comm::ReduceOp::kMin);
    overlap = all == 1;
  }
  if (rank == 0 && opts.log)
    opts.log(fmt::format("trainer: {} worker{}, math on {}, {} communicator, batches {}{}{}", world, world == 1 ? "" : "s",
                         be->describe(), comm.backend(), prefetch ? "prefetched" : "loaded inline",
                         loaders > 1 ? fmt::format(" by {} threads", loaders) : "",
                         world == 1 ? "" : overlap ? ", gradients reduced during backward" : ", gradients reduced after backward"));
  // A whole backend buffer broadcast from rank 0, staged through the host when needed.
  auto broadcastBuffer = [&](float* buf, std::vector<float>& host, void (detail::MathBackend::*store)(float*),
                             void (detail::MathBackend::*load)(const float*)) {
    if (direct) return comm.broadcast(buf, host.size(), comm::DataType::kFloat32, 0);
    (be.get()->*store)(host.data());
    comm.broadcast(host.data(), host.size(), comm::DataType::kFloat32, 0);
    (be.get()->*load)(host.data());
  };

  // Resume: rank 0 finds the newest intact checkpoint and broadcasts it, so ranks need no
  // shared file system. header = {status, step, epoch, cursor, world, the LR schedule's state
  // (5 words), the training set's rows when it was written (0: not kept)}; status -1 = config
  // mismatch, -2 = a pipeline's checkpoints in the directory (every rank fails with the same
  // message): this trainer would not find them and would train from step 0 beside them.
  int64_t header[11] = {};
  std::string ckptPath, mismatch, layout;
  if (rank == 0 && !ts.checkpoint.dir.empty())
    layout = checkpointLayoutMismatch(ts, [&](const std::string& w) { opts.warning(w); });
  if (!layout.empty()) {
    header[0] = -2;
  } else if (rank == 0 && !ts.checkpoint.dir.empty()) {
    site.at(detail::AllocationSite::kCheckpoint);
    auto st = loadLatestCheckpoint(ts.checkpoint.dir, [&](const std::string& w) { opts.warning(w); },
                                   &ckptPath);
    if (st) mismatch = checkpointMismatch(ts, *st, ckptPath, params.size());
    if (st && !mismatch.empty()) {
      header[0] = -1;
    } else if (st) {
      header[0] = 1;
      header[1] = st->step;
      header[2] = st->epoch;
      header[3] = static_cast<int64_t>(st->cursor);
      header[4] = st->world;
      // (a file from before the schedule was kept: written at one global batch, of the
      // batch_size it resumes with as far as can be told)
      detail::scheduleToWords(st->schedule ? *st->schedule
                                           : legacyScheduleState(st->step, static_cast<uint64_t>(ts.batch_size) *
                                                                               static_cast<uint64_t>(st->world)),
                              header + 5);
      header[10] = static_cast<int64_t>(st->train_rows);
      be->loadParams(st->params.data());
      be->loadState(st->momentum.data());
    }
  }
  hostComm.broadcast(header, 11, comm::DataType::kInt64, 0);
  // (every rank with rank 0's detail of what changed)
  if (header[0] == -2 || header[0] == -1) {
    const std::string detail = detail::shareText(header[0] == -2 ? layout : mismatch, [&](int64_t* w, size_t n) {
      hostComm.broadcast(w, n, comm::DataType::kInt64, 0);
    });
    throw SpecError(header[0] == -2 ? checkpointLayoutRefusal(detail) : checkpointRefusal(ts, detail));
  }
  // Every replica starts from rank 0's weights (fresh or resumed).
  broadcastBuffer(be->params(), params, &detail::MathBackend::storeParams, &detail::MathBackend::loadParams);
  if (header[0] == 1)
    broadcastBuffer(be->state(), momentum, &detail::MathBackend::storeState, &detail::MathBackend::loadState);

  const int B = ts.batch_size;
  const int in = cfg.layers.front(), out = cfg.layers.back();
  const bool mse = cfg.loss == Loss::kMse;
  site.at(detail::AllocationSite::kData);
  Datasets data = openDatasets(ts);
  const std::unique_ptr<Dataset>&trainSet = data.train, &evalSet = data.eval;
  if (ts.data.type != "synthetic") site.layout.data_rows = trainSet->size() + evalSet->size();
  site.layout.data_shared = data.shared;
  if (rank == 0 && opts.log && !data.note.empty()) opts.log("trainer: data " + data.note);
  site.layout.eval_rows = static_cast<long long>(evalSet->size());
  site.at(detail::AllocationSite::kBatch);
  const uint64_t N = trainSet->size();
  const uint64_t globalBatch = static_cast<uint64_t>(B) * static_cast<uint64_t>(world);
  // drop_last: each epoch uses floor(N / global batch) full global batches; every sample of
  // those is seen exactly once across the ranks.
  const uint64_t stepsPerEpoch = N / globalBatch;
  if (stepsPerEpoch == 0)
    throw SpecError(fmt::format("trainer: the training set ({} samples) is smaller than one global batch ({} = "
                                "batch_size {} x {} workers); use more samples or a smaller batch",
                                N, globalBatch, B, world));
  // (every rank: each read the data and has rank 0's header; rank 0's words, which name the
  // file, on every rank, since whichever rank ends first gives the job its headline)
  if (header[0] == 1) {
    const std::string own = trainRowsMismatch(ts, N, static_cast<uint64_t>(header[10]),
                                              rank == 0 ? ckptPath : "the checkpoint rank 0 resumes from");
    const std::string why = detail::shareText(rank == 0 ? own : std::string(), [&](int64_t* w, size_t n) {
      hostComm.broadcast(w, n, comm::DataType::kInt64, 0);
    });
    if (!why.empty() || !own.empty()) throw SpecError(why.empty() ? own : why);
  }
  long long step = header[1];
  const int startEpoch = static_cast<int>(header[2]);
  const uint64_t startCursor = static_cast<uint64_t>(header[3]);
  const long long totalSteps = plannedSteps(ts, step, startEpoch, startCursor, N, globalBatch);
  if (header[0] == 1 && rank == 0 && opts.log) opts.log(resumeLine(ckptPath, header, world, step >= totalSteps, ts));
  // The LR schedule runs on samples trained (lr_schedule.h): a resume at another global
  // batch goes on where it was.
  const ScheduleState resumedSchedule = detail::scheduleFromWords(header + 5);
  const LrSchedule schedule =
      planSchedule(ts, header[0] == 1 ? &resumedSchedule : nullptr, step, startEpoch, startCursor, N, globalBatch);
  uint64_t samplesTrained = header[0] == 1 ? resumedSchedule.samples : 0;
  // Signals (TrainOptions::control): agreed on at step boundaries; see control.h.
  // (alone there is nothing to agree with: a request is acted on at the step it was seen)
  detail::ControlPoints control(opts.control, world > 1 && !hostComm.onDevice(),
                                world > 1 ? kControlPeriodOnDevice : 1);
  // Rank 0 writes; with checkpoint.async from `params` and `momentum` on a thread while the
  // next steps train, so nothing may refill them before writer.wait().
  detail::CheckpointWriter writer(ts.checkpoint.async && rank == 0, opts.heartbeat,
                                  [&](const std::string& w) { opts.warning(w); }, ts.checkpoint.dir);
  auto save = [&](long long epoch, uint64_t cursor) {
    if (ts.checkpoint.dir.empty()) return;
    control.phase(TrainControl::kSaving);
    writer.wait();
    // Weights that are not finite (a step that overflowed) are never written as the
    // checkpoint later runs resume from. Every rank holds the same weights, so every rank
    // stops here at once (a rank alone would leave its peers to fail on a lost peer).
    be->storeParams(params.data());
    if (!detail::allFinite(params.data(), params.size())) throw detail::divergedError(ts, step, "the weights are not finite");
    if (rank != 0) return;
    // Past the last full global batch the epoch is over: resume at the next one.
    if (cursor + globalBatch > N) {
      ++epoch;
      cursor = 0;
    }
    // The same file whichever backend wrote it: a GPU checkpoint resumes on the CPU and back
    // (params were stored above).
    be->storeState(momentum.data());
    if (opts.heartbeat) opts.heartbeat();
    writer.start(detail::checkpointJob(ts.checkpoint.dir, "",
                                       CheckpointView{hash, step, epoch, cursor, world, params, momentum, configDescription(ts),
                                                      scheduleState(schedule, samplesTrained), N},
                                       opts.on_checkpoint_bytes, std::make_shared<detail::ControlPoints::Write>(control.control())));
    if (opts.heartbeat) opts.heartbeat();
  };

  std::vector<float> x(static_cast<size_t>(B) * in), y(static_cast<size_t>(B) * (mse ? out : 1));
  auto buckets = planBuckets(be->layerOffsets(), std::max<size_t>(1, static_cast<size_t>(ts.bucket_mb * 1024 * 1024 / 4)),
                             (1u << 20) / 4);

  // This rank's batch of the epoch's order at `cursor` (the samples the ranks take together).
  auto batchAt = [&](const EpochOrder& order, uint64_t cursor) {
    std::vector<uint64_t> idx(static_cast<size_t>(B));
    const uint64_t base = cursor + static_cast<uint64_t>(rank) * B;
    for (int i = 0; i < B; ++i) idx[static_cast<size_t>(i)] = order[base + static_cast<uint64_t>(i)];
    return idx;
  };
  detail::BatchLoader loader({trainSet.get(), B, in, out, mse, true, true, prefetch, loaders});

  TrainResult result;
  const long long firstStep = step;
  // (the training's checkpoint directory and config: a later run resuming from them draws
  // this run's rows too)
  MetricsLog metrics(rank == 0 ? opts.metrics_dir : std::string(),
                     {opts.run_id, opts.attempt, world, firstStep, ts.checkpoint.dir, fmt::format("{:016x}", hash)});
  const auto runStart = Clock::now();
  double windowLoss = 0, windowCorrect = 0, windowSamples = 0;
  detail::Progress progress(firstStep, totalSteps, globalBatch);
  auto writeTrace = [&] {
    trace.setOn(false);
    if (const std::string problem = trace.write(); !problem.empty()) opts.warning(problem);
  };
  std::vector<comm::WorkPtr> works;
  std::vector<Clock::time_point> launched;  // (each work's launch, while traced)
  std::vector<size_t> closed;
  // Gradients staged through the host (GPU math, host communicator).
  std::vector<float> hostGrads;
  assignFresh(hostGrads, direct || world == 1 ? 0 : P);
  float* const grads = be->grads();
  std::vector<float> gradTail(std::min<size_t>(P, 64));
  control.phase(TrainControl::kTraining);
  for (int epoch = startEpoch; epoch < ts.epochs && step < totalSteps; ++epoch) {
    EpochOrder order(N, ts.data.seed ^ ts.seed, static_cast<uint64_t>(epoch));
    // The cursor counts samples of this epoch's order already used by all ranks together,
    // so a resume at another world size continues exactly where the epoch stopped.
    for (uint64_t cursor = epoch == startEpoch ? startCursor : 0; cursor + globalBatch <= N && step < totalSteps;
         cursor += globalBatch) {
      if (opts.on_step) opts.on_step(step);
      control.stepStarted();
      trace.setOn(step > firstStep && step <= firstStep + detail::kTraceSteps);
      if (loader.pending() == 0) loader.request(batchAt(order, cursor));  // an epoch's first step
      auto t0 = Clock::now();
      const auto& batch = loader.take();
      // (only when the step waited for its batch: a prefetched one is not worth a row)
      if (trace.on()) {
        const auto t1 = Clock::now();
        if (t1 - t0 > std::chrono::microseconds(50)) trace.add("load batch", -1, step, t0, t1);
        t0 = t1;
      }
      // The next step's batch loads while this step computes (within the epoch: the next
      // epoch's order starts with the next epoch).
      if (cursor + 2 * globalBatch <= N && step + 1 < totalSteps) loader.request(batchAt(order, cursor + globalBatch));
      if (opts.on_batch) opts.on_batch(epoch, batch.indices.data(), B);
      be->forward(batch.x.data(), B, batch.y.data());
      auto t1 = Clock::now();
      trace.add("forward", -1, step, t0, t1);
      works.clear();
      launched.clear();
      closed.clear();
      size_t next = 0;
      auto launch = [&](const Bucket& bk) {
        // (taken before the launch: the communicator may start it before the call returns)
        const auto at = trace.on() ? Clock::now() : Clock::time_point{};
        if (direct) {
          works.push_back(comm.allreduceAsync(grads + bk.begin, bk.end - bk.begin, comm::DataType::kFloat32,
                                              comm::ReduceOp::kAvg));
        } else if (world > 1) {  // alone, the average is the gradient itself: nothing to move
          be->copyToHost(hostGrads.data() + bk.begin, grads + bk.begin, (bk.end - bk.begin) * sizeof(float));
          works.push_back(comm.allreduceAsync(hostGrads.data() + bk.begin, bk.end - bk.begin, comm::DataType::kFloat32,
                                              comm::ReduceOp::kAvg));
        }
        if (trace.on() && launched.size() < works.size()) launched.push_back(at);
      };
      be->backward([&](int layer) {
        if (!overlap || next >= buckets.size() || buckets[next].closes_at != layer) return;
        // CPU: the bucket is final now. GPU: it is only enqueued; launched below.
        if (be->asyncCompute()) closed.push_back(next++);
        else launch(buckets[next++]);
      });
      // GPU: all of backward is enqueued; each bucket goes to the communicator as soon as the
      // compute stream has produced it, while the earlier layers are still being computed.
      for (size_t i : closed) {
        be->waitLayer(buckets[i].closes_at);
        launch(buckets[i]);
      }
      if (next < buckets.size()) be->waitLayer(0);  // no overlap: after the whole backward
      t0 = Clock::now();
      trace.add("backward", -1, step, t1, t0);
      for (; next < buckets.size(); ++next) launch(buckets[next]);
      for (auto& w : works) w->wait();
      if (trace.on() && !works.empty()) {
        t1 = Clock::now();
        trace.add("wait for gradients", -1, step, t0, t1);
        // Each bucket's all-reduce, on the communicator's row: when it ran, and how long it
        // waited to start after its launch, where the communicator knows it (tcp); else from
        // its launch to the wait's end (nccl: it runs on the GPU).
        for (size_t i = 0; i < works.size(); ++i) {
          const auto ran = works[i]->ranAt();
          trace.add("all-reduce", static_cast<int>(i), step, ran ? ran->start : launched[i], ran ? ran->end : t1,
                    detail::Trace::kCommLane, ran ? launched[i] : Clock::time_point{});
        }
      }
      t0 = Clock::now();
      if (!direct && world > 1)
        for (const auto& bk : buckets)
          be->copyToBackend(grads + bk.begin, hostGrads.data() + bk.begin, (bk.end - bk.begin) * sizeof(float));

      // Gradients are identical on every rank here, so clipping agrees everywhere.
      if (ts.grad_clip_norm > 0) be->clipGradNorm(ts.grad_clip_norm);
      // Diverged (a loss that is not finite on any rank): the averaged gradients, the same on
      // every rank, carry it, so every rank stops at this step together. The tail of the
      // buffer is the last layer's, which every sample's loss reaches.
      be->copyToHost(gradTail.data(), grads + P - gradTail.size(), gradTail.size() * sizeof(float));
      if (!detail::allFinite(gradTail.data(), gradTail.size()))
        throw detail::divergedError(ts, step + 1, "the loss is not finite (NaN or infinite gradients)");
      const float lr = static_cast<float>(learningRate(ts, schedule, samplesTrained));
      const float wd = static_cast<float>(ts.optimizer.weight_decay);
      if (!adam) {
        // SGD with momentum / Nesterov / weight decay, PyTorch semantics.
        be->sgdStep({lr, wd, static_cast<float>(ts.optimizer.momentum), ts.optimizer.nesterov});
      } else {
        // AdamW (decoupled weight decay), PyTorch semantics.
        const double t = static_cast<double>(step + 1);
        be->adamwStep({lr, wd, static_cast<float>(ts.optimizer.beta1), static_cast<float>(ts.optimizer.beta2),
                       static_cast<float>(ts.optimizer.eps),
                       static_cast<float>(1.0 - std::pow(ts.optimizer.beta1, t)),
                       static_cast<float>(std::sqrt(1.0 - std::pow(ts.optimizer.beta2, t)))});
      }
      // The GPU computed the loss long ago; reading it here keeps the step free of stalls.
      int correct = 0;
      const double loss = be->result(&correct);
      trace.add("optimizer", -1, step, t0, Clock::now());
      // (written once its steps are: a run stopped or failed later keeps it)
      if (trace.on() && step == firstStep + detail::kTraceSteps) writeTrace();
      ++step;
      samplesTrained += globalBatch;
      progress.stepDone(step);
      if (rank == 0 && opts.status && progress.statusDue(step))
        opts.status(fmt::format("epoch {}/{} {} loss {} {} eta {}", epoch + 1, ts.epochs, progress.bar(step),
                                result.final_loss > 0 ? fmt::format("{:.4f}", result.final_loss) : std::string("-"),
                                detail::rateText(progress.samplesPerSecond(step)), progress.eta(step)));
      // A signal's request, agreed on by every rank (a checkpoint, or a stop after one).
      const detail::ControlPoints::Request request = control.agree(
          step, step == totalSteps,
          [&](int32_t* r) { return comm.allreduceAsync(r, 1, comm::DataType::kInt32, comm::ReduceOp::kMax); },
          [&](int32_t* r) {
            if (world > 1) hostComm.allreduce(r, 1, comm::DataType::kInt32, comm::ReduceOp::kMax);
          });
      windowLoss += loss * B;
      windowCorrect += correct;
      windowSamples += B;
      // Logged before a checkpoint or a stop, so a run stopped by a signal has its last step's
      // row in metrics.jsonl too (every rank agreed on the stop: all take part in the sum).
      if (step % ts.log_every_steps == 0 || step == totalSteps || request.kind == detail::kStopRequest) {
        double stats[3] = {windowLoss, windowCorrect, windowSamples};
        hostComm.allreduce(stats, 3, comm::DataType::kFloat64, comm::ReduceOp::kSum);
        result.final_loss = stats[0] / stats[2];
        const double sps = progress.samplesPerSecond(step);
        const double acc = mse ? std::nan("") : stats[1] / stats[2];  // regression has no accuracy
        metrics.record({step, epoch + 1, result.final_loss, acc, sps > 0 ? sps : std::nan(""),  // (null: not timed yet)
                        learningRate(ts, schedule, samplesTrained - globalBatch),  // (the last step's)
                        std::chrono::duration<double>(Clock::now() - runStart).count()});
        if (rank == 0 && opts.log)
          opts.log(fmt::format("epoch {}/{} step {}/{} loss {:.4f}{} {} eta {}", epoch + 1, ts.epochs, step, totalSteps,
                               result.final_loss, mse ? "" : fmt::format(" acc {:.1f}%", 100 * acc), detail::rateText(sps),
                               progress.eta(step)));
        windowLoss = windowCorrect = windowSamples = 0;
      }
      const bool periodic =
          (ts.checkpoint.every_steps > 0 && step % ts.checkpoint.every_steps == 0) || step == totalSteps;
      const bool requested = request.kind != detail::kNoRequest;
      if (periodic || (requested && !ts.checkpoint.dir.empty())) save(epoch, cursor + globalBatch);
      if (requested) {
        const std::string sig = dtrain::signalName(request.signal);
        const std::string path = ts.checkpoint.dir.empty() ? std::string() : checkpointPath(ts.checkpoint.dir, step);
        if (request.kind == detail::kStopRequest) {
          writer.wait();  // the final checkpoint is durable before the exit
          if (rank == 0 && opts.log)
            opts.log(path.empty() ? fmt::format("{}: stopping at step {} of {}; no checkpoint written (no "
                                                "/trainer/checkpoint/dir)", sig, step, totalSteps)
                                  : fmt::format("{}: stopping at step {} of {}; final checkpoint written to {}", sig,
                                                step, totalSteps, path));
          throw TrainingStopped(request.signal, step, path);
        }
        if (rank == 0 && opts.log)
          opts.log(path.empty() ? fmt::format("{}: no checkpoint at step {}: /trainer/checkpoint/dir is not set, so "
                                              "there is nowhere to write one; training goes on", sig, step)
                   : fmt::format("{}: checkpoint at step {} {} {}{}", sig, step,
                                 writer.async() ? "being written to" : "written to", path,
                                 writer.async() ? " (checkpoint.async)" : ""));
      }
      control.phase(TrainControl::kTraining);
    }
  }
  if (trace.on()) writeTrace();  // (fewer steps than a whole trace)
  // The last checkpoint is durable before the run reports its result (and `params` is free).
  control.phase(TrainControl::kSaving);
  writer.wait();
  // (a stop from here ends the process: the curve so far is drawn, rank 0's summary says
  // where the run stopped; train_signals.h)
  detail::FinishingWords lastWords(control, [&metrics, &opts, step] {
    metrics.finish();
    if (opts.on_stop_while_finishing) opts.on_stop_while_finishing(step);
  });
  // (the last step's update may have overflowed with finite gradients; same weights everywhere)
  be->storeParams(params.data());
  if (!detail::allFinite(params.data(), params.size())) throw detail::divergedError(ts, step, "the weights are not finite");
  result.steps = step;
  result.steps_run = step - firstStep;
  result.samples_per_s = progress.samplesPerSecond(step);

  // Held-out evaluation, sharded round-robin over the ranks.
  site.at(detail::AllocationSite::kEval);
  const uint64_t E = evalSet->size();
  double ev[3] = {0, 0, 0};
  for (uint64_t first = static_cast<uint64_t>(rank) * B; first < E; first += globalBatch) {
    int n = static_cast<int>(std::min<uint64_t>(B, E - first));
    for (int i = 0; i < n; ++i) {
      int label = 0;
      evalSet->sample(first + static_cast<uint64_t>(i), x.data() + static_cast<size_t>(i) * in, &label,
                      mse ? y.data() + static_cast<size_t>(i) * out : nullptr);
      if (!mse) y[static_cast<size_t>(i)] = static_cast<float>(label);
    }
    int correct = 0;
    if (opts.heartbeat) opts.heartbeat();
    be->forward(x.data(), n, y.data());
    ev[0] += be->result(&correct) * n;
    ev[1] += correct;
    ev[2] += n;
  }
  hostComm.allreduceAlive(ev, 3, comm::DataType::kFloat64, comm::ReduceOp::kSum, opts.heartbeat);
  result.eval_loss = ev[2] > 0 ? ev[0] / ev[2] : 0;
  result.eval_accuracy = ev[2] > 0 ? ev[1] / ev[2] : 0;
  result.eval_samples = static_cast<uint64_t>(ev[2]);
  if (ev[2] > 0) metrics.recordEval(step, result.eval_loss, mse ? std::nan("") : result.eval_accuracy);
  metrics.finish();

  // (params hold the final weights: copied for the finiteness check after training; the
  // evaluation does not change them)
  if (opts.final_params) *opts.final_params = params;
  // All replicas must hold bit-identical weights.
  result.weights_sha256 = sha256Hex(params.data(), params.size() * sizeof(float));
  std::vector<char> all(64 * static_cast<size_t>(world));
  hostComm.allgather(result.weights_sha256.data(), all.data(), 64 / 4, comm::DataType::kInt32);  // 64 hex chars
  for (int r = 0; r < world; ++r)
    if (std::memcmp(all.data() + 64 * static_cast<size_t>(r), result.weights_sha256.data(), 64) != 0)
      throw InternalError(fmt::format("trainer: rank {}'s weights differ from rank {}'s after training (sha256 {} vs {})",
                                      r, rank, std::string(all.data() + 64 * static_cast<size_t>(r), 64),
                                      result.weights_sha256));
  return result;
}

}  // namespace

TrainResult train(const spec::TrainerSpec& ts, comm::Communicator& comm, const TrainOptions& opts) {
  if (ts.parallel.pipeline_stages > 1) return trainPipeline(ts, comm, opts);
  return detail::withAllocationSite(ts, comm.rank(), comm.size(), [&](detail::AllocationSite& site) {
    return trainDataParallel(ts, comm, opts, site);
  });
}

}  // namespace dtrain::train
