#include "dtrain/train/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "dtrain/common/errors.h"
#include "dtrain/common/files.h"
#include "dtrain/common/time.h"

namespace dtrain::train {

MetricsLog::MetricsLog(const std::string& dir, const MetricsRun& run) : dir_(dir), run_(run) {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  std::string path = (std::filesystem::path(dir_) / "metrics.jsonl").string();
  // Never through a symbolic link or into a FIFO (a log_dir others can write in): a regular
  // file or no metrics, said.
  // (read and write: its last byte is looked at below)
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  std::string why = fd < 0 ? (errno == ELOOP ? "it is a symbolic link" : std::strerror(errno)) : "";
  struct stat st {};
  if (fd >= 0 && (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
    ::close(fd);
    fd = -1;
    why = "it is not a regular file";
  }
  if (fd >= 0) {
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    // A line cut short (a full disk, a writer killed mid-write) is ended first: this
    // attempt's start row, appended to it, would be lost with it, and the reader would take
    // the replayed steps for new ones.
    char last = '\n';
    if (st.st_size > 0 && ::pread(fd, &last, 1, st.st_size - 1) == 1 && last != '\n')
      (void)writeAllBlocking(fd, "\n");
    f_ = ::fdopen(fd, "a");
    if (!f_) {
      why = std::strerror(errno);
      ::close(fd);
    }
  }
  if (!f_) {
    // Metrics are a record, not the job: on a host where the log directory cannot be made
    // (a multi-node job's node 0 that lacks the launching host's path) training goes on.
    std::fprintf(stderr, "dtrain: warning: no metrics: cannot open %s: %s\n", path.c_str(), why.c_str());
    return;
  }
  write(spec::metricsStartLine(run_, utcNow()));
}

MetricsLog::~MetricsLog() {
  if (f_ && !finished_) {
    try {
      finish();
    } catch (...) {  // (a record, not the job; and a destructor, maybe in an exception's unwinding)
    }
  }
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const std::string& line) {
  // One whole line per write, flushed: a reader (tail -f, a dashboard) never sees half a row.
  std::fputs(line.c_str(), f_);
  std::fflush(f_);
}

void MetricsLog::record(const MetricsPoint& p) {
  if (f_) write(spec::metricsTrainLine(run_, p));
}

void MetricsLog::recordEval(long long step, double loss, double accuracy) {
  if (f_) write(spec::metricsEvalLine(run_, step, loss, accuracy));
}

void MetricsLog::finish() {
  if (!f_) return;
  finished_ = true;
  std::ifstream in(std::filesystem::path(dir_) / "metrics.jsonl");
  const spec::MetricsCurve curve = spec::readMetricsRun(in, run_);
  // A fresh file renamed over metrics.svg: a symbolic link there is replaced, not followed.
  const std::string path = (std::filesystem::path(dir_) / "metrics.svg").string();
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return;  // (a record, not the job)
  const std::string svg = metricsSvg(curve.points, curve.eval_accuracy);
  const bool written = writeAllBlocking(fd, svg);
  ::close(fd);
  if (!written || ::rename(tmp.c_str(), path.c_str()) != 0) ::unlink(tmp.c_str());
}

std::string metricsSvg(const std::vector<MetricsPoint>& pts, double evalAccuracy) {
  const double W = 640, H = 360, L = 60, R = 60, T = 30, B = 40;
  const double pw = W - L - R, ph = H - T - B;
  long long maxStep = 1;
  double maxLoss = 1e-9;
  for (const auto& p : pts) {
    maxStep = std::max(maxStep, p.step);
    if (std::isfinite(p.loss)) maxLoss = std::max(maxLoss, p.loss);
  }
  auto x = [&](long long s) { return L + pw * static_cast<double>(s) / static_cast<double>(maxStep); };
  auto yLoss = [&](double v) { return T + ph * (1 - v / maxLoss); };
  auto yAcc = [&](double v) { return T + ph * (1 - v); };
  std::string loss, acc;
  for (const auto& p : pts) {
    if (!std::isfinite(p.loss)) continue;  // a diverged loss has no place on the curve
    loss += fmt::format("{:.1f},{:.1f} ", x(p.step), yLoss(p.loss));
    if (std::isfinite(p.accuracy)) acc += fmt::format("{:.1f},{:.1f} ", x(p.step), yAcc(p.accuracy));  // none: regression
  }
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<rect x=\"{2}\" y=\"{3}\" width=\"{4}\" height=\"{5}\" fill=\"none\" stroke=\"#999\"/>\n",
      W, H, L, T, pw, ph);
  for (int i = 0; i <= 4; ++i) {
    double f = i / 4.0;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\" fill=\"#c0392b\">{:.3g}</text>\n", L - 6,
                       T + ph * (1 - f) + 4, maxLoss * f);
    if (!acc.empty())  // (no accuracy axis for regression)
      svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#2471a3\">{:.0f}%</text>\n", W - R + 6,
                         T + ph * (1 - f) + 4, 100 * f);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n", L + pw * f, H - B + 16,
                       static_cast<long long>(static_cast<double>(maxStep) * f));
  }
  svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">step</text>\n", L + pw / 2, H - 8);
  svg += fmt::format("<polyline fill=\"none\" stroke=\"#c0392b\" stroke-width=\"2\" points=\"{}\"/>\n", loss);
  if (!acc.empty())
    svg += fmt::format("<polyline fill=\"none\" stroke=\"#2471a3\" stroke-width=\"2\" points=\"{}\"/>\n", acc);
  std::string title = acc.empty()          ? std::string("training loss")
                      : evalAccuracy >= 0 ? fmt::format("training loss (red) and accuracy (blue); held-out accuracy {:.2f}%",
                                                         100 * evalAccuracy)
                                          : std::string("training loss (red) and accuracy (blue)");
  svg += fmt::format("<text x=\"{:.1f}\" y=\"18\" text-anchor=\"middle\">{}</text>\n</svg>\n", W / 2, title);
  return svg;
}

}  // namespace dtrain::train
