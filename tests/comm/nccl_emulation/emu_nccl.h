#pragma once
// Test controls and counters of the emulated NCCL (fake/nccl.h). Ranks here are ranks within
// a communicator: a control applies to every live communicator of that rank (the tests run
// one job at a time).
#include "nccl.h"

namespace emu_nccl {

struct Counters {
  int destroys = 0;       // ncclCommDestroy with nothing outstanding
  int hungDestroys = 0;   // ncclCommDestroy with operations outstanding: hangs with real NCCL
  int aborts = 0;         // ncclCommAbort
  int useAfterAbort = 0;  // any call on a communicator after ncclCommAbort/Destroy freed it
};
Counters counters();
// Forgets every communicator, control and counter (between tests).
void reset();
// The next enqueue (collective, send, recv, group end) by `rank` returns `r`.
void failNextEnqueue(int rank, ncclResult_t r);
// ncclCommGetAsyncError of every live communicator of `rank` reports `r` from now on.
void setAsyncError(int rank, ncclResult_t r);
// Non-blocking communicators of `rank` never finish connecting: their first enqueue stays
// ncclInProgress.
void hangConnect(int rank);
// ncclCommFinalize of `rank`'s non-blocking communicators never finishes.
void hangFinalize(int rank);
// What ncclGetLastError reports (default "": nothing went wrong yet).
void setLastError(const char* text);
// What ncclGetVersion reports (default NCCL_VERSION_CODE).
void setVersion(int version);

}  // namespace emu_nccl
