#include "dtrain/spec/metrics_file.h"

#include <cmath>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace dtrain::spec {
namespace {

using json = nlohmann::json;

std::string num(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : std::string("null"); }

std::string head(const char* type, const MetricsRun& run) {
  return fmt::format("{{\"type\": \"{}\", \"run_id\": {}, \"attempt\": {}", type, json(run.run_id).dump(), run.attempt);
}

double numberOr(const json& j, const char* key, double dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : (it != j.end() && it->is_null() ? NAN : dflt);
}

}  // namespace

std::string metricsStartLine(const MetricsRun& run, const std::string& utcTime) {
  return head("start", run) + fmt::format(", \"step\": {}, \"world_size\": {}, \"time\": {}}}\n", run.start_step,
                                          run.world_size, json(utcTime).dump());
}

std::string metricsTrainLine(const MetricsRun& run, const MetricsPoint& p) {
  return head("train", run) + fmt::format(", \"step\": {}, \"epoch\": {}, \"loss\": {}, \"accuracy\": {}, "
                                          "\"samples_per_s\": {}, \"lr\": {}, \"elapsed_s\": {}}}\n",
                                          p.step, p.epoch, num(p.loss), num(p.accuracy), num(p.samples_per_s),
                                          num(p.lr), num(p.elapsed_s));
}

std::string metricsEvalLine(const MetricsRun& run, long long step, double loss, double accuracy) {
  return head("eval", run) + fmt::format(", \"step\": {}, \"loss\": {}, \"accuracy\": {}}}\n", step, num(loss), num(accuracy));
}

MetricsCurve readMetricsRun(std::istream& in, const std::string& runId) {
  MetricsCurve c;
  const std::string idField = "\"run_id\": " + json(runId).dump();
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(idField) == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_object()) continue;
    auto id = j.find("run_id");
    auto type = j.find("type");
    auto step = j.find("step");
    if (id == j.end() || !id->is_string() || *id != runId || type == j.end() || !type->is_string() ||
        step == j.end() || !step->is_number_integer())
      continue;
    const long long s = step->get<long long>();
    if (*type == "start") {
      while (!c.points.empty() && c.points.back().step > s) c.points.pop_back();
    } else if (*type == "train") {
      MetricsPoint p;
      p.step = s;
      p.epoch = static_cast<int>(numberOr(j, "epoch", 0));
      p.loss = numberOr(j, "loss", NAN);
      p.accuracy = numberOr(j, "accuracy", NAN);
      p.samples_per_s = numberOr(j, "samples_per_s", NAN);
      p.lr = numberOr(j, "lr", NAN);
      p.elapsed_s = numberOr(j, "elapsed_s", NAN);
      c.points.push_back(p);
    } else if (*type == "eval") {
      c.eval_accuracy = numberOr(j, "accuracy", -1);
    }
  }
  return c;
}

}  // namespace dtrain::spec
