#include "dtrain/spec/metrics_file.h"

#include <algorithm>
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
  return head("start", run) + fmt::format(", \"step\": {}, \"world_size\": {}, \"time\": {}, \"checkpoint_dir\": {}, "
                                          "\"config_hash\": {}}}\n",
                                          run.start_step, run.world_size, json(utcTime).dump(),
                                          run.checkpoint_dir.empty() ? std::string("null") : json(run.checkpoint_dir).dump(),
                                          json(run.config_hash).dump());
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

MetricsCurve readMetricsRun(std::istream& in, const MetricsRun& run) {
  MetricsCurve c;
  // The runs of the training: this one, and each whose start row names its checkpoints.
  std::vector<std::string> ids{run.run_id}, idFields{"\"run_id\": " + json(run.run_id).dump()};
  const bool chained = !run.checkpoint_dir.empty();
  auto stringField = [](const json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  std::string line;
  while (std::getline(in, line)) {
    const bool startRow = line.find("\"type\": \"start\"") != std::string::npos;
    const bool named = std::any_of(idFields.begin(), idFields.end(),
                                   [&](const std::string& f) { return line.find(f) != std::string::npos; });
    if (!named && !(startRow && chained)) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_object()) continue;
    auto id = j.find("run_id");
    auto type = j.find("type");
    auto step = j.find("step");
    if (id == j.end() || !id->is_string() || type == j.end() || !type->is_string() || step == j.end() ||
        !step->is_number_integer())
      continue;
    const std::string rowId = id->get<std::string>();
    const bool member = std::find(ids.begin(), ids.end(), rowId) != ids.end();
    const long long s = step->get<long long>();
    if (*type == "start") {
      if (!member) {
        if (!chained || stringField(j, "checkpoint_dir") != run.checkpoint_dir ||
            stringField(j, "config_hash") != run.config_hash)
          continue;
        ids.push_back(rowId);
        idFields.push_back("\"run_id\": " + json(rowId).dump());
      }
      while (!c.points.empty() && c.points.back().step > s) c.points.pop_back();
      c.eval_accuracy = -1;  // (an earlier end's evaluation: training went on from here)
    } else if (!member) {
      continue;  // (another run's row that only mentions a member's id)
    } else if (*type == "train") {
      MetricsPoint p;
      p.step = s;
      p.epoch = static_cast<int>(numberOr(j, "epoch", 0));
      p.loss = numberOr(j, "loss", NAN);
      p.accuracy = numberOr(j, "accuracy", NAN);
      p.samples_per_s = numberOr(j, "samples_per_s", NAN);
      p.lr = numberOr(j, "lr", NAN);
      p.elapsed_s = numberOr(j, "elapsed_s", NAN);
      while (!c.points.empty() && c.points.back().step >= s) c.points.pop_back();
      c.points.push_back(p);
    } else if (*type == "eval") {
      c.eval_accuracy = numberOr(j, "accuracy", -1);
    }
  }
  return c;
}

}  // namespace dtrain::spec
