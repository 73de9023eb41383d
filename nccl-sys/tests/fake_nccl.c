/* A stand-in libnccl for tests/fake_lib.rs: a handful of NCCL entry points that check the
 * arguments they receive against fixed values, so the Rust side can verify that calls through
 * NcclLib reach C with the right ABI (by-value structs, many stack arguments, void returns,
 * struct layouts). Self-contained on purpose: it does not include nccl.h. */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int ncclResult_t; /* C enums are int-sized */
enum { OK = 0, INVALID_ARGUMENT = 4 };
typedef struct ncclComm* ncclComm_t;
typedef struct ncclWindow_vidmem* ncclWindow_t;
typedef struct CUstream_st* cudaStream_t;
typedef struct { char internal[128]; } ncclUniqueId;

typedef struct {
  size_t size; unsigned int magic; unsigned int version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char* netName;
  int splitShare, trafficClass;
  const char* commName;
  int collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs, nChannelsPerNetPeer, nvlinkCentricSched,
      graphUsageMode, numRmaCtx, maxP2pPeers, graphStreamOrdering, launchOrderImplicit, numRmaSig,
      rmaEagerInit, hostCftMode, nvlsHostMode;
} ncclConfig_t;

typedef struct {
  size_t size; unsigned int magic; unsigned int version;
  void* ext;
  int minCTAs, maxCTAs, nvlsCTAs, cgaClusterSize;
  const char* algSelection;
  int forceAlgSelection, CTAPolicy;
  uint64_t userProfilerTag;
  void* launchCompletionEvent;
} ncclCollConfig_t;

static int reset_calls;

ncclResult_t ncclGetVersion(int* version) { *version = 23203; return OK; }

const char* ncclGetErrorString(ncclResult_t result) {
  return result == 8 ? "fake: timeout" : "fake: other";
}

void ncclResetDebugInit(void) { reset_calls++; }

/* Reports how often ncclResetDebugInit ran. */
const char* ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  static const char* counts[] = {"reset 0", "reset 1", "reset 2", "reset many"};
  return counts[reset_calls < 3 ? reset_calls : 3];
}

/* The unique id arrives by value (128 bytes): fold it into the returned handle. */
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  uintptr_t sum = 0;
  for (int i = 0; i < 128; i++) sum += (uintptr_t)(unsigned char)id.internal[i] * (uintptr_t)(i + 1);
  *comm = (ncclComm_t)(sum * 1000 + (uintptr_t)nranks * 10 + (uintptr_t)rank);
  return OK;
}

/* Accepts exactly NCCL_CONFIG_INITIALIZER with blocking = 0. */
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* c) {
  (void)id;
  if (c->size != sizeof(ncclConfig_t) || sizeof(ncclConfig_t) != 120) return INVALID_ARGUMENT;
  if (c->magic != 0xcafebeef || c->version != 23203) return INVALID_ARGUMENT;
  if (c->blocking != 0 || c->netName || c->commName) return INVALID_ARGUMENT;
  const int* undef[] = {&c->cgaClusterSize, &c->minCTAs, &c->maxCTAs, &c->splitShare,
                        &c->trafficClass, &c->collnetEnable, &c->CTAPolicy, &c->shrinkShare,
                        &c->nvlsCTAs, &c->nChannelsPerNetPeer, &c->nvlinkCentricSched,
                        &c->graphUsageMode, &c->numRmaCtx, &c->maxP2pPeers,
                        &c->graphStreamOrdering, &c->launchOrderImplicit, &c->numRmaSig,
                        &c->rmaEagerInit, &c->hostCftMode, &c->nvlsHostMode};
  for (size_t i = 0; i < sizeof undef / sizeof undef[0]; i++)
    if (*undef[i] != INT_MIN) return INVALID_ARGUMENT;
  *comm = (ncclComm_t)(uintptr_t)(nranks * 10 + rank);
  return OK;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, int datatype,
                           int op, ncclComm_t comm, cudaStream_t stream) {
  int ok = sendbuff == (const void*)0x1000 && recvbuff == (void*)0x2000 &&
           count == ((size_t)1 << 40) + 3 && datatype == 11 && op == 4 &&
           comm == (ncclComm_t)0x3000 && stream == (cudaStream_t)0x4000;
  return ok ? OK : INVALID_ARGUMENT;
}

/* Same call plus a per-collective config equal to NCCL_COLLCONFIG_INITIALIZER. */
ncclResult_t ncclAllReduceConfig(const void* sendbuff, void* recvbuff, size_t count, int datatype,
                                 int op, ncclComm_t comm, cudaStream_t stream,
                                 const ncclCollConfig_t* c) {
  if (ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream) != OK) return INVALID_ARGUMENT;
  int ok = c->size == 72 && sizeof(ncclCollConfig_t) == 72 && c->magic == 0xcafebeef &&
           c->version == 23203 && !c->ext && c->minCTAs == INT_MIN && c->maxCTAs == INT_MIN &&
           c->nvlsCTAs == INT_MIN && c->cgaClusterSize == INT_MIN && !c->algSelection &&
           c->forceAlgSelection == 1 && c->CTAPolicy == INT_MIN && c->userProfilerTag == 0 &&
           !c->launchCompletionEvent;
  return ok ? OK : INVALID_ARGUMENT;
}

/* Eleven arguments: several of them are passed on the stack. */
ncclResult_t ncclPutSignal(const void* localbuff, size_t count, int datatype, int peer,
                           ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx,
                           unsigned int flags, ncclComm_t comm, cudaStream_t stream) {
  int ok = localbuff == (const void*)0x10 && count == 20 && datatype == 7 && peer == -3 &&
           peerWin == (ncclWindow_t)0x50 && peerWinOffset == ((size_t)1 << 33) && sigIdx == 70 &&
           ctx == 80 && flags == 0xfffffff0u && comm == (ncclComm_t)0xa0 &&
           stream == (cudaStream_t)0xb0;
  return ok ? OK : INVALID_ARGUMENT;
}

/* nccl_device/host.h 2.32.3, written out as there (C enums are unsigned int-sized here). */
typedef struct {
  size_t size; unsigned int magic; unsigned int version;
  int rank, nRanks, cudaDev, nvmlDev;
  _Bool deviceApiSupport, multimemSupport;
  unsigned int ginType;
  int nLsaTeams;
  _Bool hostRmaSupport;
  unsigned int railedGinType;
  uint64_t commHash;
  int ginMinStride;
  unsigned int ginConnectionType;
  _Bool ginSupport[64];
  size_t devCommRuntimeVersionSize;
  _Bool cftSupport, cftMulticastSupport, cftCountedSupport;
} ncclCommProperties_t;

/* Accepts NCCL_COMM_PROPERTIES_INITIALIZER (any version up to 2.32.3) and fills every field
 * with a value derived from its offset, so the Rust side can check each one. */
ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t* p) {
  if (p->size != sizeof(ncclCommProperties_t) || sizeof(ncclCommProperties_t) != 152)
    return INVALID_ARGUMENT;
  if (p->magic != 0xcafebeef || p->version > 23203) return INVALID_ARGUMENT;
  p->rank = (int)(uintptr_t)comm;
  p->nRanks = (int)offsetof(ncclCommProperties_t, nRanks);
  p->cudaDev = (int)offsetof(ncclCommProperties_t, cudaDev);
  p->nvmlDev = (int)offsetof(ncclCommProperties_t, nvmlDev);
  p->deviceApiSupport = 1;
  p->multimemSupport = 0;
  p->ginType = 3;
  p->nLsaTeams = (int)offsetof(ncclCommProperties_t, nLsaTeams);
  p->hostRmaSupport = 1;
  p->railedGinType = 2;
  p->commHash = 0x0123456789abcdefULL;
  p->ginMinStride = (int)offsetof(ncclCommProperties_t, ginMinStride);
  p->ginConnectionType = 1;
  for (int i = 0; i < 64; i++) p->ginSupport[i] = (i == 2 || i == 3);
  p->devCommRuntimeVersionSize = offsetof(ncclCommProperties_t, devCommRuntimeVersionSize);
  p->cftSupport = 1;
  p->cftMulticastSupport = 0;
  p->cftCountedSupport = 1;
  return OK;
}

/* Device-API host functions of nccl_device/host.h 2.32.3 (teams are returned by value, in
 * registers on x86-64; requirements are written through pointers). */
typedef struct { int nRanks, rank, stride; } ncclTeam_t;
typedef struct { uint32_t bufHandle; int nBarriers; } ncclLsaBarrierHandle_t;
typedef struct ncclDevResourceRequirements {
  struct ncclDevResourceRequirements* next;
  size_t bufferSize, bufferAlign;
  uint32_t* outBufferHandle;
  int ginSignalCount, ginCounterCount;
  uint32_t* outGinSignalStart;
  uint32_t* outGinCounterStart;
} ncclDevResourceRequirements_t;

ncclTeam_t ncclTeamLsa(ncclComm_t comm) {
  ncclTeam_t t = {(int)(uintptr_t)comm, 3, 1};
  return t;
}

int ncclTeamRankToWorld(ncclComm_t comm, ncclTeam_t team, int rank) {
  return (int)(uintptr_t)comm + (rank - team.rank) * team.stride;
}

/* As NCCL 2.32.3 computes it (src/nccl_device/lsa_barrier.cc). */
ncclResult_t ncclLsaBarrierCreateRequirement(ncclTeam_t team, int nBarriers,
                                             ncclLsaBarrierHandle_t* outHandle,
                                             ncclDevResourceRequirements_t* outReq) {
  if (sizeof(ncclDevResourceRequirements_t) != 56) return INVALID_ARGUMENT;
  memset(outReq, 0, sizeof(*outReq));
  outHandle->nBarriers = nBarriers;
  outReq->bufferSize = (3 * nBarriers + nBarriers * team.nRanks) * sizeof(uint32_t);
  outReq->bufferAlign = sizeof(uint32_t);
  outReq->outBufferHandle = &outHandle->bufHandle;
  return OK;
}
