#pragma once
#include <string>

#include "dtrain/store/wire.h"

namespace dtrain::app {

// What `dtrain --version` prints; multi-node pre-flight requires the same on every host. It
// names the store protocol too: processes of one job must speak the same one, and a binary
// of the same release number built before a protocol change is caught there, not as a
// VERSION error from the store after the job started.
inline std::string versionString() {
  return std::string("dtrain ") + DTRAIN_VERSION
#ifdef DTRAIN_HAVE_CUDA
         + " (CUDA/NCCL build, store protocol " + std::to_string(store::wire::kVersion) + ")";
#else
         + " (CPU build, store protocol " + std::to_string(store::wire::kVersion) + ")";
#endif
}

}  // namespace dtrain::app
