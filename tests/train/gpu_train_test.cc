// The GPU trainer against the CPU path (CUDA builds only; skipped without a visible GPU):
// the same model, data and seed give the same numbers within float rounding, for the
// data-parallel trainer (GpuTrain) and the pipeline's GPU stages (GpuPipeline). The CPU path
// is the reference: its gradients are checked against finite differences in train_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/train/backend.h"
#include "dtrain/train/data.h"
#include "dtrain/train/device.h"
#include "dtrain/train/trainer.h"

namespace dtrain::comm {
std::unique_ptr<Communicator> createNcclCommunicator(std::shared_ptr<store::Store> store, int rank, int size,
                                                     const CommOptions& opts);
}

namespace dtrain::train {
namespace {

// NCCL communicators fail a stuck collective in a minute, not the default five: a hang costs
// this test, not the GPU check's whole budget (scripts/gpu_check.sh).
const comm::CommOptions kGpuCommOptions = [] {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(60);
  return o;
}();

#define REQUIRE_GPUS(n)                                                                   \
  do {                                                                                    \
    if (visibleGpus() < (n)) GTEST_SKIP() << "needs " << (n) << " visible GPU(s), found " \
                                          << visibleGpus();                               \
  } while (0)

// max |a - b| / (atol + rtol * |b|) <= 1, reported with the worst index.
void expectClose(const std::vector<float>& a, const std::vector<float>& b, double atol, double rtol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double r = std::fabs(static_cast<double>(a[i]) - b[i]) / (atol + rtol * std::fabs(static_cast<double>(b[i])));
    if (!(r <= worst)) {
      worst = r;
      at = i;
    }
  }
  EXPECT_LE(worst, 1.0) << what << ": element " << at << " gpu " << a[at] << " cpu " << b[at];
}

struct Batch {
  std::vector<float> x, y;
};

Batch makeBatch(const MlpConfig& cfg, int n, uint64_t first) {
  const int in = cfg.layers.front(), out = cfg.layers.back();
  const bool mse = cfg.loss == Loss::kMse;
  Batch b;
  b.x.resize(static_cast<size_t>(n) * in);
  b.y.resize(static_cast<size_t>(n) * (mse ? out : 1));
  SyntheticData d(in, out, 11);
  for (int i = 0; i < n; ++i) {
    int label = 0;
    d.sample(first + static_cast<uint64_t>(i), false, b.x.data() + static_cast<size_t>(i) * in, &label,
             mse ? b.y.data() + static_cast<size_t>(i) * out : nullptr);
    if (!mse) b.y[static_cast<size_t>(i)] = static_cast<float>(label);
  }
  return b;
}

std::vector<float> paramsOf(detail::MathBackend& be) {
  std::vector<float> p(be.numParams());
  be.storeParams(p.data());
  return p;
}
std::vector<float> gradsOf(detail::MathBackend& be) {
  std::vector<float> g(be.numParams());
  be.storeGrads(g.data());
  return g;
}
std::vector<float> stateOf(detail::MathBackend& be) {
  std::vector<float> s(be.stateSize());
  be.storeState(s.data());
  return s;
}

// The GPU math is a plugin loaded on first use (lib/train/CMakeLists.txt): it must load and
// reach CUDA here, GPU or not. Without a device the plugin's CUDA calls fail, but with a CUDA
// error, not a loader error.
TEST(GpuTrain, PluginLoadsOnDemand) {
  try {
    auto be = detail::makeCudaBackend({{4, 3}, Activation::kRelu, Loss::kCrossEntropy}, 0, false, 0);
    EXPECT_NE(be, nullptr);
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).find("cannot load the GPU trainer"), std::string::npos) << e.what();
  }
}

TEST(GpuTrain, DeviceSelection) {
  if (visibleGpus() == 0) {
    EXPECT_EQ(resolveDevice("auto", 0).name, "cpu");
    try {
      resolveDevice("cuda", 0);
      FAIL() << "cuda without a GPU";
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()).find("trainer.device is \"cuda\" but no GPU is visible"), std::string::npos)
          << e.what();
    }
    try {
      detail::makeCudaBackend({{4, 3}, Activation::kRelu, Loss::kCrossEntropy}, 0, false, 0);
      FAIL() << "a CUDA backend without a GPU";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA error"), std::string::npos) << e.what();
    }
    return;
  }
  const int n = visibleGpus();
  EXPECT_EQ(resolveDevice("auto", 0).name, "cuda:0");
  EXPECT_EQ(resolveDevice("cuda", n + 1).index, (n + 1) % n);  // LOCAL_RANK % visible GPUs
  EXPECT_EQ(resolveDevice("cuda", n + 1).name, "cuda:" + std::to_string((n + 1) % n));
  EXPECT_TRUE(resolveDevice("auto", 0, n).cuda);
  EXPECT_FALSE(resolveDevice("auto", 0, n + 1).cuda);  // more local workers than GPUs: cpu
  EXPECT_THROW(resolveDevice("cuda", 0, n + 1), SpecError);
  EXPECT_FALSE(resolveDevice("cpu", 0).cuda);
}

// Forward (loss, accuracy) and backward (all gradients, layer order) on a small MLP.
void compareForwardBackward(Activation act, Loss loss) {
  MlpConfig cfg{{24, 33, 17, 5}, act, loss};
  auto cpu = detail::makeCpuBackend(cfg, 5, false);
  auto gpu = detail::makeCudaBackend(cfg, 5, false, 0);
  ASSERT_EQ(paramsOf(*cpu), paramsOf(*gpu)) << "the same initial weights";
  EXPECT_EQ(cpu->layerOffsets(), gpu->layerOffsets());
  for (int n : {13, 64}) {
    Batch b = makeBatch(cfg, n, 100);
    cpu->forward(b.x.data(), n, b.y.data());
    gpu->forward(b.x.data(), n, b.y.data());
    int cc = -1, gc = -1;
    double cl = cpu->result(&cc), gl = gpu->result(&gc);
    EXPECT_NEAR(gl, cl, 1e-5 + 1e-5 * std::fabs(cl)) << "n " << n;
    EXPECT_NEAR(gc, cc, 1) << "n " << n;  // a near tie may flip one argmax
    std::vector<int> order;
    cpu->backward({});
    gpu->backward([&](int l) { order.push_back(l); });
    EXPECT_EQ(order, (std::vector<int>{2, 1, 0}));
    for (int l = 2; l >= 0; --l) gpu->waitLayer(l);
    expectClose(gradsOf(*gpu), gradsOf(*cpu), 1e-6, 1e-4, "gradients");
  }
}

TEST(GpuTrain, ForwardBackwardMatchCpu) {
  REQUIRE_GPUS(1);
  compareForwardBackward(Activation::kRelu, Loss::kCrossEntropy);
  compareForwardBackward(Activation::kGelu, Loss::kCrossEntropy);
  compareForwardBackward(Activation::kRelu, Loss::kMse);
  compareForwardBackward(Activation::kGelu, Loss::kMse);
}

// Clipping and the optimizer steps on identical inputs: each step starts the GPU from the
// CPU's weights, state and gradients, so only the update math is compared (AdamW's first
// steps move every weight by about lr whatever the gradient's size, so a gradient that is
// rounding noise would otherwise decide a sign).
void compareSteps(bool adam, double clip) {
  MlpConfig cfg{{24, 40, 6}, Activation::kGelu, Loss::kCrossEntropy};
  auto cpu = detail::makeCpuBackend(cfg, 8, adam);
  auto gpu = detail::makeCudaBackend(cfg, 8, adam, 0);
  const char* what = adam ? "adamw" : clip > 0 ? "sgd + clip" : "sgd";
  for (int step = 0; step < 3; ++step) {
    Batch b = makeBatch(cfg, 32, static_cast<uint64_t>(step) * 32);
    cpu->forward(b.x.data(), 32, b.y.data());
    cpu->backward({});
    gpu->loadParams(paramsOf(*cpu).data());
    gpu->loadState(stateOf(*cpu).data());
    auto g = gradsOf(*cpu);
    gpu->copyToBackend(gpu->grads(), g.data(), g.size() * sizeof(float));
    for (auto* be : {cpu.get(), gpu.get()}) {
      if (clip > 0) be->clipGradNorm(clip);
      if (adam) {
        const double t = step + 1;
        be->adamwStep({1e-2f, 0.01f, 0.9f, 0.999f, 1e-8f, static_cast<float>(1 - std::pow(0.9, t)),
                       static_cast<float>(std::sqrt(1 - std::pow(0.999, t)))});
      } else {
        be->sgdStep({0.05f, 1e-3f, 0.9f, step % 2 == 1});
      }
      be->synchronize();
    }
    expectClose(gradsOf(*gpu), gradsOf(*cpu), 1e-7, 1e-5, what);
    expectClose(paramsOf(*gpu), paramsOf(*cpu), 1e-6, 1e-5, what);
    expectClose(stateOf(*gpu), stateOf(*cpu), 1e-7, 1e-5, what);
  }
}

TEST(GpuTrain, SgdAndAdamWStepsMatchCpu) {
  REQUIRE_GPUS(1);
  compareSteps(false, 0);
  compareSteps(true, 0);
  compareSteps(false, 0.05);  // small enough to clip every step
}

spec::TrainerSpec small(const std::string& device) {
  spec::TrainerSpec t;
  t.device = device;
  t.model.layers = {20, 32, 16, 4};
  t.model.activation = "gelu";
  t.data.train_samples = 4096;
  t.data.eval_samples = 512;
  t.batch_size = 64;
  t.epochs = 1;
  t.max_steps = 30;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  t.grad_clip_norm = 5;
  t.bucket_mb = 0.001;  // several buckets
  return t;
}

TrainResult runAlone(const spec::TrainerSpec& t, std::vector<float>* params, bool nccl = false) {
  auto store = std::make_shared<store::HashStore>();
  auto c =
      nccl ? comm::createNcclCommunicator(store, 0, 1, kGpuCommOptions) : comm::createTcpCommunicator(store, 0, 1, {});
  TrainOptions o;
  o.final_params = params;
  return train(t, *c, o);
}

TEST(GpuTrain, OneRankTrainingMatchesCpu) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  for (const char* opt : {"sgd", "adamw"}) {
    auto t = small("cpu");
    t.optimizer.type = opt;
    if (std::string(opt) == "adamw") t.optimizer.lr = 3e-3;
    std::vector<float> cpuP, gpuP, ncclP;
    TrainResult c = runAlone(t, &cpuP);
    t.device = "cuda";
    TrainResult g = runAlone(t, &gpuP);                 // host communicator
    TrainResult n = runAlone(t, &ncclP, /*nccl=*/true);  // device communicator, staged host collectives
    // AdamW amplifies rounding where a gradient is noise (its update is about lr whatever
    // the gradient's size): a looser bound there.
    const bool adam = std::string(opt) == "adamw";
    EXPECT_EQ(g.steps, c.steps);
    EXPECT_NEAR(g.final_loss, c.final_loss, 1e-3 + (adam ? 1e-2 : 1e-3) * c.final_loss) << opt;
    EXPECT_NEAR(g.eval_accuracy, c.eval_accuracy, 0.02) << opt;
    expectClose(gpuP, cpuP, adam ? 1e-2 : 5e-4, adam ? 1e-2 : 5e-3, opt);
    EXPECT_EQ(ncclP, gpuP) << opt << ": the GPU is deterministic whatever the communicator";
    EXPECT_EQ(n.weights_sha256, g.weights_sha256);
  }
}

std::string tempDir(const std::string& name) {
  std::string d = ::testing::TempDir() + "/dtrain_gpu_ckpt_" + name + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(d);
  return d;
}

// A checkpoint is one file format: written on the GPU it resumes on the CPU, and back.
TEST(GpuTrain, CheckpointsMoveBetweenGpuAndCpu) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  auto t = small("cpu");  // SGD with momentum: the state travels too
  t.max_steps = 40;
  std::vector<float> straight;
  runAlone(t, &straight);  // the CPU reference, no checkpoints

  for (bool gpuFirst : {true, false}) {
    auto r = t;
    r.checkpoint.dir = tempDir(gpuFirst ? "g2c" : "c2g");
    r.max_steps = 15;
    r.device = gpuFirst ? "cuda" : "cpu";
    runAlone(r, nullptr);
    r.max_steps = 40;
    r.device = gpuFirst ? "cpu" : "cuda";
    std::vector<float> resumed;
    TrainResult res = runAlone(r, &resumed);
    EXPECT_EQ(res.steps, 40);
    expectClose(resumed, straight, 5e-4, 5e-3, gpuFirst ? "gpu -> cpu" : "cpu -> gpu");
    std::filesystem::remove_all(r.checkpoint.dir);
  }
}

// Device memory that runs out is one line naming what was being allocated and the field to
// change (a SpecError: the worker's exit 2), not cudaMalloc's IoError: here the activations
// of a batch of 262144 x (16-65536-10), ~275 GB, more than any GPU (the emulation's device
// holds 16 GiB) while the host's share stays small.
TEST(GpuTrain, OutOfDeviceMemoryNamesTheBatch) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  spec::TrainerSpec t;
  t.device = "cuda";
  t.model.layers = {16, 65536, 10};
  t.batch_size = 262144;
  t.data.train_samples = 262144;
  t.data.eval_samples = 0;
  t.max_steps = 1;
  try {
    runAlone(t, nullptr);
    FAIL() << "a batch of ~275 GB of activations trained";
  } catch (const SpecError& e) {
    const std::string w = e.what();
    EXPECT_EQ(w.rfind("trainer: rank 0 ran out of device memory allocating the activations and buffers of a batch of "
                      "262144 samples (cudaMalloc of ",
                      0),
              0u)
        << w;
    EXPECT_NE(w.find("out of device memory): this worker needs about "), std::string::npos) << w;
    EXPECT_NE(w.find("GiB of device memory; /trainer/batch_size: use a smaller batch_size (now 262144)"), std::string::npos)
        << w;
  }
}

// Two ranks over NCCL, one GPU each (NCCL refuses two ranks of one communicator on one
// device), against two CPU ranks over TCP.
TEST(GpuTrain, TwoRanksOverNcclMatchCpu) {
  REQUIRE_GPUS(2);
  ::unsetenv("LOCAL_RANK");  // then rank r uses GPU r, in the trainer and in NCCL alike
  ::unsetenv("LOCAL_WORLD_SIZE");
  for (bool overlap : {true, false}) {
    auto t = small("cuda");
    t.overlap = overlap;
    auto run = [&](bool nccl) {
      auto store = std::make_shared<store::HashStore>();
      std::vector<std::vector<float>> params(2);
      std::vector<TrainResult> res(2);
      std::vector<std::string> errors(2);
      std::vector<std::thread> ts;
      for (int r = 0; r < 2; ++r)
        ts.emplace_back([&, r] {
          try {
            auto c = nccl ? comm::createNcclCommunicator(store, r, 2, kGpuCommOptions)
                          : comm::createTcpCommunicator(store, r, 2, {});
            TrainOptions o;
            o.device = nccl ? "cuda" : "cpu";
            o.final_params = &params[static_cast<size_t>(r)];
            res[static_cast<size_t>(r)] = train(t, *c, o);
          } catch (const std::exception& e) {
            errors[static_cast<size_t>(r)] = e.what();
          }
        });
      for (auto& th : ts) th.join();
      for (const auto& e : errors) EXPECT_EQ(e, "");
      EXPECT_EQ(res[0].weights_sha256, res[1].weights_sha256);
      return params[0];
    };
    auto gpu = run(true);
    auto cpu = run(false);
    expectClose(gpu, cpu, 5e-4, 5e-3, overlap ? "2 ranks, overlap" : "2 ranks, no overlap");
  }
}

// ---- Pipeline parallelism (pipeline.cc) with GPU stages (cuda_stage.cu) ----

// The pipeline test model (tests/train/pipeline_test.cc) with gelu and clipping (a small
// bound: it clips most steps, so the global norm across stages is exercised).
spec::TrainerSpec pipeSpec(int stages, int micro, const std::string& schedule) {
  spec::TrainerSpec t;
  t.device = "cpu";
  t.model.layers = {20, 32, 24, 16, 4};
  t.model.activation = "gelu";
  t.data.train_samples = 4096;
  t.data.eval_samples = 300;
  t.batch_size = 32;
  t.max_steps = 12;
  t.optimizer.lr = 0.05;
  t.optimizer.momentum = 0.9;
  t.grad_clip_norm = 1.0;
  t.log_every_steps = 4;
  t.parallel.pipeline_stages = stages;
  t.parallel.micro_batches = micro;
  t.parallel.schedule = schedule;
  return t;
}

struct PipeRun {
  std::vector<TrainResult> results;
  std::vector<float> weights;  // the whole model (rank 0)
  std::string firstLine;       // rank 0's "trainer: ..." line
};

// `world` ranks as threads: device per rank by LOCAL_RANK (unset: the rank) % visible GPUs.
PipeRun runPipe(int world, const spec::TrainerSpec& t, const std::string& device, bool nccl) {
  auto store = std::make_shared<store::HashStore>();
  PipeRun out;
  out.results.resize(static_cast<size_t>(world));
  std::vector<std::vector<float>> params(static_cast<size_t>(world));
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        auto c = nccl ? comm::createNcclCommunicator(store, r, world, kGpuCommOptions)
                      : comm::createTcpCommunicator(store, r, world, {});
        TrainOptions o;
        o.device = device;
        o.final_params = &params[static_cast<size_t>(r)];
        if (r == 0)
          o.log = [&](const std::string& line) {
            if (out.firstLine.empty()) out.firstLine = line;
          };
        out.results[static_cast<size_t>(r)] = train(t, *c, o);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& th : ts) th.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (const auto& r : out.results) EXPECT_EQ(r.weights_sha256, out.results[0].weights_sha256);
  out.weights = params[0];
  return out;
}

void expectPipeClose(const PipeRun& gpu, const PipeRun& cpu, double atol, double rtol, const char* what) {
  expectClose(gpu.weights, cpu.weights, atol, rtol, what);
  EXPECT_EQ(gpu.results[0].steps, cpu.results[0].steps) << what;
  EXPECT_NEAR(gpu.results[0].final_loss, cpu.results[0].final_loss, 1e-3 + 1e-3 * cpu.results[0].final_loss) << what;
  EXPECT_NEAR(gpu.results[0].eval_loss, cpu.results[0].eval_loss, 1e-3 + 1e-3 * cpu.results[0].eval_loss) << what;
  EXPECT_NEAR(gpu.results[0].eval_accuracy, cpu.results[0].eval_accuracy, 0.02) << what;
}

// P = 2, D = 1: GPU stages against CPU stages (both losses), GPipe bit-identical to 1F1B on
// the GPU, "auto" picks the GPU, the same activation memory accounting, and (with a device
// per rank) the nccl communicator bit-identical to tcp.
TEST(GpuPipeline, TwoStagesMatchCpu) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  for (const char* loss : {"cross_entropy", "mse"}) {
    SCOPED_TRACE(loss);
    auto t = pipeSpec(2, 4, "1f1b");
    t.model.loss = loss;
    auto cpu = runPipe(2, t, "cpu", false);
    auto gpu = runPipe(2, t, "cuda", false);
    EXPECT_NE(gpu.firstLine.find("math on cuda:"), std::string::npos) << gpu.firstLine;
    expectPipeClose(gpu, cpu, 5e-4, 5e-3, "P=2 D=1");
    for (size_t r = 0; r < 2; ++r)
      EXPECT_EQ(gpu.results[r].peak_activation_bytes, cpu.results[r].peak_activation_bytes) << "rank " << r;
    auto g = t;
    g.parallel.schedule = "gpipe";
    auto gpipe = runPipe(2, g, "auto", false);
    EXPECT_NE(gpipe.firstLine.find("math on cuda:"), std::string::npos) << "auto: " << gpipe.firstLine;
    EXPECT_EQ(gpipe.weights, gpu.weights) << "both schedules accumulate the micro-batches in the same order";
    EXPECT_EQ(gpipe.results[0].weights_sha256, gpu.results[0].weights_sha256);
    if (visibleGpus() >= 2) {  // NCCL wants a device per rank
      auto nccl = runPipe(2, t, "cuda", true);
      EXPECT_NE(nccl.firstLine.find("nccl communicator"), std::string::npos) << nccl.firstLine;
      EXPECT_EQ(nccl.weights, gpu.weights) << "the GPU stages are deterministic whatever the communicator";
    }
  }
}

// P = 2, D = 2: the stage groups' gradient average on the GPU (staged through the host on
// tcp, in place on nccl), with the all-reduce overlapped with the backward and not.
TEST(GpuPipeline, TwoStagesTimesTwoReplicasMatchCpu) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  for (bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    auto t = pipeSpec(2, 2, "1f1b");
    t.overlap = overlap;
    auto cpu = runPipe(4, t, "cpu", false);
    auto gpu = runPipe(4, t, "cuda", false);
    expectPipeClose(gpu, cpu, 5e-4, 5e-3, "P=2 D=2");
    auto g = t;
    g.parallel.schedule = "gpipe";
    EXPECT_EQ(runPipe(4, g, "cuda", false).weights, gpu.weights);
    if (visibleGpus() >= 4) {
      auto nccl = runPipe(4, t, "cuda", true);
      EXPECT_EQ(nccl.weights, gpu.weights) << "the GPU stages are deterministic whatever the communicator";
    }
  }
  // AdamW amplifies rounding where a gradient is noise: a looser bound (as for one rank).
  auto a = pipeSpec(2, 2, "1f1b");
  a.optimizer.type = "adamw";
  a.optimizer.lr = 3e-3;
  a.optimizer.weight_decay = 0.01;
  expectPipeClose(runPipe(4, a, "cuda", false), runPipe(4, a, "cpu", false), 1e-2, 1e-2, "P=2 D=2 adamw");
}

// Stage checkpoints: a GPU run resumed on the GPU is bit-identical to a straight one, and the
// files move between devices (written by GPU stages, resumed by CPU stages and back).
TEST(GpuPipeline, ResumeFromStageCheckpoints) {
  REQUIRE_GPUS(1);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  auto t = pipeSpec(2, 2, "1f1b");
  t.max_steps = 16;
  auto straightGpu = runPipe(4, t, "cuda", false);
  auto straightCpu = runPipe(4, t, "cpu", false);
  struct Case {
    const char* name;
    const char* before;
    const char* after;
  };
  for (const Case& c : {Case{"g2g", "cuda", "cuda"}, Case{"g2c", "cuda", "cpu"}, Case{"c2g", "cpu", "cuda"}}) {
    SCOPED_TRACE(c.name);
    auto r = t;
    r.checkpoint.dir = tempDir(std::string("pipe_") + c.name);
    r.max_steps = 8;
    runPipe(4, r, c.before, false);
    EXPECT_TRUE(std::filesystem::exists(r.checkpoint.dir + "/stage-0-of-2"));
    EXPECT_TRUE(std::filesystem::exists(r.checkpoint.dir + "/stage-1-of-2"));
    r.max_steps = 16;
    auto resumed = runPipe(4, r, c.after, false);
    EXPECT_EQ(resumed.results[0].steps, 16);
    if (std::string(c.before) == "cuda" && std::string(c.after) == "cuda")
      EXPECT_EQ(resumed.weights, straightGpu.weights);
    else
      expectClose(resumed.weights, straightCpu.weights, 5e-4, 5e-3, c.name);
    std::filesystem::remove_all(r.checkpoint.dir);
  }
}

// NCCL takes device pointers: CPU stages on it are refused on every rank, naming the fix.
TEST(GpuPipeline, NcclWithCpuStagesIsRefused) {
  REQUIRE_GPUS(2);
  ::unsetenv("LOCAL_RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  auto t = pipeSpec(2, 2, "1f1b");
  auto store = std::make_shared<store::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        auto c = comm::createNcclCommunicator(store, r, 2, kGpuCommOptions);
        TrainOptions o;
        o.device = "cpu";
        train(t, *c, o);
      } catch (const SpecError& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& th : ts) th.join();
  for (const auto& e : errors)
    EXPECT_NE(e.find("the \"nccl\" communicator needs trainer.device \"cuda\""), std::string::npos) << e;
}

}  // namespace
}  // namespace dtrain::train
