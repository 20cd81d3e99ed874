#include "dtrain/spec/summary.h"

#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dtrain/common/errors.h"
#include "dtrain/common/files.h"

namespace dtrain::spec {

using nlohmann::json;

namespace {

json trainerJson(const TrainerOutcome& t) {
  auto orNull = [](const std::optional<double>& v) { return v ? json(*v) : json(nullptr); };
  json j{{"final_loss", orNull(t.final_loss)},
         {"eval_accuracy", orNull(t.eval_accuracy)},
         {"eval_loss", orNull(t.eval_loss)},
         {"samples_per_s", orNull(t.samples_per_s)},
         {"steps", t.steps},
         {"weights_sha256", t.weights_sha256.empty() ? json(nullptr) : json(t.weights_sha256)},
         {"checkpoint", t.checkpoint.empty() ? json(nullptr) : json(t.checkpoint)},
         {"stopped", t.stopped}};
  if (t.pipeline_stages > 1) {
    j["pipeline_stages"] = t.pipeline_stages;
    j["bubble_fraction"] = orNull(t.bubble_fraction);
    j["stage_ms"] = t.stage_ms.empty() ? json(nullptr) : json(t.stage_ms);
  }
  return j;
}

}  // namespace

std::string formatEvent(const JobEvent& e) {
  std::string out = fmt::format("dtrain: event {} (round {})", e.kind, e.round);
  if (!e.host.empty()) out += fmt::format(" host {}", e.host);
  if (e.rank >= 0) out += fmt::format(" rank {}", e.rank);
  return out + ": " + e.reason;
}

bool isRunSummaryText(const std::string& text) {
  const json j = json::parse(text, nullptr, false);
  return !j.is_discarded() && j.is_object() && j.contains("status") && j.contains("exit_code");
}

std::string toJson(const RunSummary& s) {
  json j;
  j["job"] = s.job.empty() ? json(nullptr) : json(s.job);
  j["run_id"] = s.run_id.empty() ? json(nullptr) : json(s.run_id);  // (a run refused on its command line has none)
  j["status"] = s.running ? "running" : s.succeeded ? "succeeded" : "failed";
  j["exit_code"] = s.running ? json(nullptr) : json(s.exit_code);
  j["restarts"] = s.restarts;
  j["wall_s"] = s.wall_s;
  j["stopped_by"] = s.stopped_by.empty() ? json(nullptr) : json(s.stopped_by);
  j["error"] = s.error.empty() ? json(nullptr) : json(s.error);
  j["ranks"] = json::array();
  for (const auto& r : s.ranks) {
    json rj{{"rank", r.rank}, {"local_rank", r.local_rank}, {"host", r.host}, {"stopped_by_dtrain", r.stopped_by_dtrain}};
    rj["lost"] = r.lost;
    if (r.lost) {
      rj["exit_code"] = nullptr;
      rj["signal"] = nullptr;
    } else if (r.signal.empty()) {
      rj["exit_code"] = r.exit_code;
      rj["signal"] = nullptr;
    } else {
      rj["exit_code"] = nullptr;
      rj["signal"] = r.signal;
    }
    j["ranks"].push_back(rj);
  }
  j["trainer"] = s.trainer ? trainerJson(*s.trainer) : json(nullptr);
  j["events"] = json::array();
  for (const auto& e : s.events) {
    json ej = {{"time", e.time}, {"round", e.round}, {"kind", e.kind}, {"reason", e.reason}};
    ej["host"] = e.host.empty() ? json(nullptr) : json(e.host);
    ej["rank"] = e.rank < 0 ? json(nullptr) : json(e.rank);
    j["events"].push_back(ej);
  }
  // Names and messages come from workers and file names: bytes that are not UTF-8 become
  // U+FFFD rather than an exception that would cost the summary.
  return j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

void writeTrainerOutcome(const std::string& path, const TrainerOutcome& t) {
  // (whole or not at all; a path that is not UTF-8 is written with U+FFFD, not refused)
  writeOutputFile(path, trainerJson(t).dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
}

std::optional<TrainerOutcome> readTrainerOutcome(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  TrainerOutcome t;
  try {
    auto optional = [&](const char* key) {
      return j.at(key).is_null() ? std::optional<double>() : std::optional<double>(j.at(key).get<double>());
    };
    t.final_loss = optional("final_loss");
    t.eval_accuracy = optional("eval_accuracy");
    if (j.contains("eval_loss")) t.eval_loss = optional("eval_loss");
    t.samples_per_s = optional("samples_per_s");
    t.steps = j.at("steps").get<long long>();
    if (!j.at("weights_sha256").is_null()) t.weights_sha256 = j.at("weights_sha256").get<std::string>();
    if (j.contains("checkpoint") && !j.at("checkpoint").is_null()) t.checkpoint = j.at("checkpoint").get<std::string>();
    if (j.contains("stopped")) t.stopped = j.at("stopped").get<bool>();
    if (j.contains("pipeline_stages")) {
      t.pipeline_stages = j.at("pipeline_stages").get<int>();
      t.bubble_fraction = optional("bubble_fraction");
      if (!j.at("stage_ms").is_null()) t.stage_ms = j.at("stage_ms").get<std::vector<double>>();
    }
  } catch (const json::exception&) {
    return std::nullopt;
  }
  return t;
}

}  // namespace dtrain::spec
