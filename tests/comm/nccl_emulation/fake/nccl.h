#pragma once
// Emulated NCCL for the NCCL backend's tests (tests/comm/nccl_emulation; never part of
// dtrain): the API subset nccl_communicator.cc uses, with NCCL's semantics where the backend
// depends on them. Ranks are threads of one process (NCCL's one-process, several-GPU mode):
// a collective completes when every rank has enqueued it, a send when its receive is posted.
// Non-blocking communicators (ncclConfig_t.blocking = 0) return ncclInProgress from
// initialisation until every rank joined, and from their first enqueue (a lazy connect) until
// the next ncclCommGetAsyncError; ncclCommAbort frees the communicator (any later call on it
// is counted as a use after abort, see emu_nccl.h), and ncclCommDestroy with operations
// outstanding, which hangs with real NCCL, is counted as a hung destroy.
#include <climits>
#include <cstddef>

#include "cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 9
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X)*1000 + (Y)*100 + (Z) : (X)*10000 + (Y)*100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)

typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER \
  { sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT }

ncclResult_t ncclGetVersion(int* version);
const char* ncclGetErrorString(ncclResult_t r);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclAllGather(const void* send, void* recv, size_t sendCount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recvCount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclSend(const void* send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void* recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
