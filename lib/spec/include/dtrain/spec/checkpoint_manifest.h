#pragma once
// The manifest of a pipeline trainer's checkpoint directory (trainer.checkpoint.dir with
// pipeline_stages > 1): DIR/manifest.json names the newest checkpoint that every stage has
// written, and the layout that wrote it. Each stage's file is its own (DIR/stage-<p>-of-<P>/
// ckpt-<step>.bin); the manifest ties them together. JSON stays inside lib/spec.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::spec {

struct PipelineManifest {
  long long step = 0;           // the step every stage's file holds
  long long epoch = 0;          // where training resumes: epoch and sample cursor
  uint64_t cursor = 0;
  int world = 0;                // workers that wrote it
  int stages = 0;               // P
  std::vector<int> stage_layers;  // weight layers per stage (the partition)
  std::string config_hash;      // hex, as in the stage files
  std::vector<std::string> files;  // relative to the directory, stage 0 first
};

// Atomically (temporary file, fsync, rename, fsync of the directory). Throws IoError.
// `dirFd`: when not -1, the directory `path` is in, held open: the file is made and renamed
// there (a directory swapped in under its name meanwhile gets none of it), `path` only names
// it in errors.
void writePipelineManifest(const std::string& path, const PipelineManifest& m, int dirFd = -1);

// nullopt when the file does not exist; SpecError naming the file and the field when it
// exists but is not a manifest this version can read.
std::optional<PipelineManifest> readPipelineManifest(const std::string& path);

}  // namespace dtrain::spec
