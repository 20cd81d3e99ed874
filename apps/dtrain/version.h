#pragma once
#include <string>

namespace dtrain::app {

// What `dtrain --version` prints; multi-node pre-flight requires the same on every host.
inline std::string versionString() {
  return std::string("dtrain ") + DTRAIN_VERSION
#ifdef DTRAIN_HAVE_CUDA
         + " (CUDA/NCCL build)";
#else
         + " (CPU build)";
#endif
}

}  // namespace dtrain::app
