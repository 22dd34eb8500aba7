/*
 * symcomm.h: the C ABI of libsymcomm, the native half of the symcomm Python package.
 *
 * Groups of entry points, one per source file:
 *   symcomm_pool_*, symcomm_alloc/free   pool_alloc.cc  sub-allocator over registered symmetric
 *                                                       regions (host only, no CUDA calls)
 *   symcomm_ar_*                         custom_ar.cu   symcomm's own all-reduce and reduce-
 *                                                       scatter kernels over peer-mapped memory
 *                                        peer_gather.cu (symcomm_ar_gatherv) gather by push
 *   symcomm_fp4_*                        fp4.cu         NVFP4 quantize / dequantize
 *   symcomm_rmsnorm*                     rmsnorm.cu     residual add + RMSNorm (+ FP8 / NVFP4)
 *   symcomm_ep_*                         ep.cu          MoE expert-parallel dispatch and combine
 *
 * The library is loaded with ctypes; symcomm/_native.py holds the matching ctypes table and
 * tests/test_native_header.py fails when the two disagree. Every source file includes this
 * header, so the compiler rejects a definition that drifts from its declaration. Hooks that
 * exist only for tests and measurements (simulated ranks, CPU twins of the kernels) are
 * declared in csrc/symcomm_testing.h instead: exported, but not part of the API.
 *
 * Only <stddef.h> and <stdint.h> are needed: callers without the CUDA toolkit (ctypes, plain C)
 * can use the header as is.
 */
#ifndef SYMCOMM_H_
#define SYMCOMM_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The ABI version: it changes whenever a declaration of this header or of symcomm_testing.h
 * changes incompatibly. symcomm_abi_version() returns the version the library was built with;
 * the Python side refuses a library whose version is not its own (a stale build).
 */
#define SYMCOMM_ABI_VERSION 15
int symcomm_abi_version(void);

/*
 * Whether symcomm's kernels signal the next kernel on their stream that it may start early
 * (programmatic dependent launch, csrc/launch.cuh): on by default. Off, every kernel of the
 * library lets the next one start only when it exits; symcomm turns it off where the loaded
 * NCCL has symmetric kernels that start early without waiting for their predecessor (2.28 through
 * 2.30.6). Process-wide; affects later launches only. Returns the previous setting.
 */
int symcomm_set_early_dependents(int enabled);

/*
 * Status codes. Functions that can fail return a symcomm_status_t:
 *   0         success
 *   > 0       the cudaError_t the CUDA runtime reported; arguments that symcomm rejects itself
 *             (bad shape, dtype, slot, world size) report cudaErrorInvalidValue (1)
 *   < 0       symcomm's own codes, listed below
 * symcomm_cuda_error_string turns any of them into text.
 */
typedef int symcomm_status_t;
enum {
  SYMCOMM_SUCCESS = 0,
  /* symcomm_pool_add_region: unknown pool, or a region that is empty or not 512-byte aligned */
  SYMCOMM_ERROR_INVALID_REGION = -1
};

/*
 * Element types of the all-reduce and fp4 entry points. The values are part of the ABI
 * (symcomm/_native.py's DTYPE_CODES).
 */
typedef enum {
  SYMCOMM_FLOAT32 = 0,
  SYMCOMM_FLOAT16 = 1,
  SYMCOMM_BFLOAT16 = 2,
  /* Gives the type int's full range in C++ too, so an out-of-range code from Python is a
     defined value that the switch statements reject, not undefined behaviour. */
  SYMCOMM_DTYPE_MAX_ENUM = 0x7fffffff
} symcomm_dtype_t;

/* The three all-reduce kernels (csrc/custom_ar.cu explains each). */
typedef enum {
  SYMCOMM_AR_FLAGFREE = 0,
  SYMCOMM_AR_ONESHOT = 1,
  SYMCOMM_AR_TWOSHOT = 2,
  SYMCOMM_AR_ALGO_MAX_ENUM = 0x7fffffff
} symcomm_ar_algo_t;

/*
 * A CUDA stream. This is the very type behind cudaStream_t and CUstream, named without the
 * CUDA headers, so C callers pass their cudaStream_t unchanged and Python passes the integer
 * handle torch reports (ctypes c_void_p). NULL is the legacy default stream.
 */
typedef struct CUstream_st* symcomm_stream_t;

/* One rank's custom all-reduce state: its mapped buffers, the peers' mappings, slot tables. */
typedef struct symcomm_ar_ctx* symcomm_ar_t;

/* Bytes of one IPC handle as written by symcomm_ar_handle / symcomm_ar_buffer_handle. */
#define SYMCOMM_AR_HANDLE_BYTES 64

/*
 * Why a context's kernels stopped: the word symcomm_ar_alarm points at holds 0 while the
 * context is healthy, else (kind << 32) | (phase << 16) | peer. phase: 0, 1, 2 for the start,
 * middle and end barrier (1 also for the MoE dispatch's wait for every peer's counts, 2 for a
 * meeting of every block of every rank), 3 for the flag-free kernel's data, 4 for a meeting's
 * wait for a block of the rank's own grid (then peer is the rank itself). Once set it stays set,
 * and every later kernel of the context returns at once without writing its output.
 */
enum {
  SYMCOMM_AR_ABORT_TIMEOUT = 1,      /* peer `peer` did not arrive within timeout_s */
  SYMCOMM_AR_ABORT_UNREGISTERED = 2, /* a graph read a slot whose pointer for `peer` was never set */
  SYMCOMM_AR_ABORT_CLOSED = 3,       /* symcomm_ar_retire: the context was closed */
  SYMCOMM_AR_ABORT_MISMATCH = 4      /* rank `peer` disagrees with this rank. Phase 1: in symcomm_ep_dispatch,
                                        other sizes (capacity, row bytes, topk, align, max_tokens, experts,
                                        quant, cols, dtype); no row moved. Phase 2: in symcomm_ep_combine,
                                        another quant or dtype, or another dispatch's sizes; nothing summed */
};

/* ------------------------------------------------------------------------------------------
 * Symmetric pool (pool_alloc.cc). Pools are small integer ids. Every call is thread-safe,
 * touches no GPU and never blocks beyond an internal mutex. Placement is deterministic: the
 * same sequence of requests yields the same (region, offset) on every rank.
 */

/* Creates an empty pool; returns its id (>= 0). */
int symcomm_pool_create(void);

/* Adds the caller-owned region [base, base + size) to `pool`. The caller registers regions on
 * every rank in the same order (registration is collective; this call is not). Returns
 * SYMCOMM_SUCCESS or SYMCOMM_ERROR_INVALID_REGION. */
symcomm_status_t symcomm_pool_add_region(int pool, uintptr_t base, size_t size);

/* Makes `pool` the one symcomm_alloc serves on the calling thread (-1: none); returns the
 * previous one so scopes can nest. */
int symcomm_pool_set_active(int pool);

/* Bytes currently handed out by `pool` (0 for an unknown pool). */
size_t symcomm_pool_bytes_in_use(int pool);

/* Allocations of `pool` not yet freed (0 for an unknown pool). */
size_t symcomm_pool_live_allocations(int pool);

/* The size of the latest request `pool` could not serve (0 if none), and clears it. */
size_t symcomm_pool_take_failed_request(int pool);

/* Retires `pool`. Later frees of its allocations are accepted and ignored. */
void symcomm_pool_destroy(int pool);

/* torch's pluggable-allocator entry points: carve `size` bytes (rounded up to 512) out of the
 * calling thread's active pool, or return NULL when it has no room (device and stream are
 * unused: regions belong to one device and are not stream-ordered here). */
void* symcomm_alloc(size_t size, int device, symcomm_stream_t stream);
void symcomm_free(void* ptr, size_t size, int device, symcomm_stream_t stream);

/* ------------------------------------------------------------------------------------------
 * Custom all-reduce (custom_ar.cu). Setup is a sequence of local calls; the caller exchanges
 * the handles between ranks (symcomm/peer/setup.py does it by vote). Every call selects
 * the context's device itself.
 */

/* Allocates this rank's buffers (signals, staging and scratch of staging_bytes each, three
 * flag-free receive buffers of flagfree_bytes per rank) and a table of max_slots pointer
 * slots. world is 2, 4, 6 or 8; both byte counts are multiples of 16; timeout_s bounds every
 * wait on a peer inside the kernels. Writes the new context to *out. Not collective; blocks
 * until the buffers are initialised on the device. */
symcomm_status_t symcomm_ar_create(int rank, int world, int device, size_t staging_bytes, size_t flagfree_bytes,
                                   int max_slots, double timeout_s, symcomm_ar_t* out);

/* Writes the IPC handle of this rank's buffer (SYMCOMM_AR_HANDLE_BYTES) to handle_out. Host
 * only, does not block. */
symcomm_status_t symcomm_ar_handle(symcomm_ar_t ctx, char* handle_out);

/* Maps every peer's buffer. handles holds world handles from symcomm_ar_handle, in rank order
 * (this rank's own entry is ignored). Every rank calls it before any symcomm_ar_run; it does
 * not wait for peers. Blocks for a host-to-device copy. */
symcomm_status_t symcomm_ar_open(symcomm_ar_t ctx, const char* handles);





/* Peer-to-peer self test, step 1: writes token into every peer's probe word. Blocks until the
 * device is idle. The caller waits for all ranks before step 2. */
symcomm_status_t symcomm_ar_probe_write(symcomm_ar_t ctx, uint32_t token);

/* Step 2: reads 2 x 8 words into got: what peer p wrote here, then what peer p wrote into its
 * own probe word. Blocks. */
symcomm_status_t symcomm_ar_probe_read(symcomm_ar_t ctx, uint32_t* got);

/* The IPC handle of the cudaMalloc allocation holding ptr (handle_out,
 * SYMCOMM_AR_HANDLE_BYTES) and ptr's offset inside it, for buffers recorded during graph
 * capture. Host only. */
symcomm_status_t symcomm_ar_buffer_handle(symcomm_ar_t ctx, const void* ptr, char* handle_out,
                                          uint64_t* offset_out);

/* Fills slot `slot` (1 <= slot < max_slots) with every rank's address of one buffer: peers'
 * from handles (world x SYMCOMM_AR_HANDLE_BYTES) plus offsets (world entries), this rank's as
 * own. Releases what the slot held before. On failure the slot is left empty (null pointers,
 * which the kernels refuse). Blocks for a host-to-device copy. */
symcomm_status_t symcomm_ar_set_slot(symcomm_ar_t ctx, int slot, const char* handles, const uint64_t* offsets,
                                     const void* own);

/* Empties slot `slot`: unmaps the peer buffers no other slot uses and zeroes the slot. Call it
 * once no graph that reads the slot can be replayed. Blocks for a device memset. */
symcomm_status_t symcomm_ar_release_slot(symcomm_ar_t ctx, int slot);

/* Ties a token to the graph being captured on stream (a CUDA user object), so that
 * symcomm_ar_take_released reports the token once the graph and every instance of it are
 * destroyed. Writes the token (> 0) to *token_out. Host only; stream must be capturing. */
symcomm_status_t symcomm_ar_guard_capture(symcomm_ar_t ctx, symcomm_stream_t stream, uint64_t* token_out);

/* Moves up to `capacity` tokens of destroyed graphs into tokens and their number into
 * *count_out. Host only; safe while CUDA destroys graphs on other threads. */
symcomm_status_t symcomm_ar_take_released(symcomm_ar_t ctx, uint64_t* tokens, int capacity, int* count_out);

/* Makes `after` wait for everything enqueued on `before` so far (an event), so kernels of one
 * context run in call order when the caller switches streams. Host only. */
symcomm_status_t symcomm_ar_order_streams(symcomm_ar_t ctx, symcomm_stream_t before, symcomm_stream_t after);

/* Writes to *word_out the host address of the context's alarm word (SYMCOMM_AR_ABORT_*
 * layout above), which the kernels set when they give up. Reading it needs no CUDA call. */
symcomm_status_t symcomm_ar_alarm(symcomm_ar_t ctx, const uint64_t** word_out);

/* A POSIX file descriptor for the cuMem allocation starting at base (NCCL's symmetric
 * regions have no CUDA IPC handle). The caller sends it to peers and closes it. Host only. */
symcomm_status_t symcomm_ar_export_region(symcomm_ar_t ctx, const void* base, int* fd_out);

/* Maps a peer's region of `size` bytes from the descriptor fd (received from
 * symcomm_ar_export_region) and writes its local address to *mapped_out. The mapping lives
 * until symcomm_ar_destroy. Host only. */
symcomm_status_t symcomm_ar_import_region(symcomm_ar_t ctx, int fd, size_t size, void** mapped_out);

/* Fills slot `slot` with world device addresses given directly (imported pool regions).
 * Blocks for a host-to-device copy. */
symcomm_status_t symcomm_ar_set_slot_ptrs(symcomm_ar_t ctx, int slot, const uint64_t* ptrs);

/* One sum all-reduce of nbytes (a multiple of 16, at most the buffer size of the algorithm;
 * a one-shot that reads a slot other than 0 without staging may be any size) from in to out,
 * enqueued on stream; returns without waiting for it. stage != 0 first copies in to the
 * staging buffer and reads slot 0; otherwise one-shot/two-shot read slot `slot` at in_offset,
 * and flag-free reads in directly. Collective: every rank enqueues the same algo, dtype and
 * nbytes, and the kernel waits on its peers; a peer missing past timeout_s makes the kernel
 * give up and set the alarm word (SYMCOMM_AR_ABORT_TIMEOUT), never trap: the CUDA context
 * stays usable, the output of that call and of every later one is not written. */
symcomm_status_t symcomm_ar_run(symcomm_ar_t ctx, symcomm_ar_algo_t algo, symcomm_dtype_t dtype, const void* in,
                                int slot, uint64_t in_offset, void* out, uint64_t nbytes, int stage,
                                symcomm_stream_t stream);

/* One-shot sum all-reduce in place, of any size, of an input every rank reads through slot
 * `slot` (not 0: a mapped pool region) at in_offset, which is also inout's address here. The
 * sums go to scratch (nbytes of this rank's own memory), and each block copies its share to
 * inout once its end barrier shows every peer has read it; a kernel that gives up leaves inout
 * as it was. nbytes and both pointers are multiples of 16. Collective like symcomm_ar_run. */
symcomm_status_t symcomm_ar_oneshot_in_place(symcomm_ar_t ctx, symcomm_dtype_t dtype, int slot, uint64_t in_offset,
                                             void* scratch, void* inout, uint64_t nbytes, symcomm_stream_t stream);

/* Two-shot sum all-reduce by remote stores, into an output that every rank holds at out_offset
 * of the pool region in slot `out_slot` (not 0), which is also out's address here. `in` is read
 * locally only; `own` holds this rank's chunk of it (in + rank * chunk, or a copy of that chunk
 * taken before the launch when out == in: a peer overwrites that chunk of out). The chunk is
 * ceil(nbytes / 16 / world) vectors. At world 2 any size; at a larger world the W-2 other peers'
 * contributions pass through the scratch buffer, so (world - 2) chunks must fit in it. nbytes
 * and every pointer are multiples of 16. Collective like symcomm_ar_run. */
symcomm_status_t symcomm_ar_twoshot_push(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, const void* own,
                                         int out_slot, uint64_t out_offset, void* out, uint64_t nbytes,
                                         symcomm_stream_t stream);

/* Flag-free all-gather(v): rank r's chunk of chunk_bytes[r] bytes (one entry per rank, the same
 * array on every rank; each a multiple of 16 and at most the context's flag-free buffer size)
 * goes from its `in` to offset chunk_bytes[0] + ... + chunk_bytes[r-1] of every rank's `out`.
 * Equal chunks are the even all-gather. The flag-free all-reduce's protocol (push into peers'
 * receive buffers, poll for the sentinel to vanish) and its buffers: calls of all three may
 * follow each other in any order. dtype is SYMCOMM_FLOAT32, SYMCOMM_FLOAT16 or
 * SYMCOMM_BFLOAT16, where the sentinel word 0xFFFFFFFF is a NaN; such a word arrives as the
 * NaN 0x7FFF7FFF on every rank (own chunk included), every other word bit for bit. in and out
 * are 16-byte aligned and either do not overlap or in is this rank's chunk of out. Chunks that
 * add up to 0 enqueue nothing. Collective like symcomm_ar_run, bounded the same way. */
symcomm_status_t symcomm_ar_flagfree_all_gatherv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, void* out,
                                                 const uint64_t* chunk_bytes, symcomm_stream_t stream);

/* Flag-free reduce-scatter(v) (sum): `in` holds every rank's chunk back to back (chunk_bytes,
 * limits as above); this rank writes to out the fp32 rank-order sum of every rank's chunk
 * `rank`, rounded once (with equal chunks, the same bits as that chunk of the flag-free
 * all-reduce). Dtypes, alignment and overlap (out is this rank's chunk of in, or disjoint) as
 * for symcomm_ar_flagfree_all_gatherv. */
symcomm_status_t symcomm_ar_flagfree_reduce_scatterv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in,
                                                     void* out, const uint64_t* chunk_bytes, symcomm_stream_t stream);

/* Most tensors one symcomm_ar_gatherv call moves. */
#define SYMCOMM_AR_MAX_PIECES 8

/* Uneven all-gather by push, for outputs in mapped symmetric regions: for each of npieces
 * tensors, this rank's nbytes[k] bytes at srcs[k] (device addresses, any memory of this rank)
 * are written to byte dst_offsets[k] of slot slots[k] on every rank, itself included, then
 * the ranks meet. Every rank calls it with the same npieces and slots and the same total_bytes
 * (the whole gathered output, which sizes the grid); a rank with no rows passes nbytes 0 and
 * still takes part. Addresses, offsets and sizes are multiples of 16. Enqueued on stream;
 * waits are bounded as in symcomm_ar_run. */
symcomm_status_t symcomm_ar_gatherv(symcomm_ar_t ctx, int npieces, const uint64_t* srcs, const int* slots,
                                    const uint64_t* dst_offsets, const uint64_t* nbytes, uint64_t total_bytes,
                                    symcomm_stream_t stream);

/* Fused NVFP4 dispatch (arguments in symcomm_gatherv_fp4_args_t below): quantizes this rank's
 * rows x [rows, cols] (dtype bf16 or fp16, cols a
 * positive multiple of 16, x 16-byte aligned) with the codec of symcomm_fp4_quantize, bit for
 * bit, and writes the payload (cols/2 bytes per row) and the linear block scales (cols/16
 * bytes per row) straight into every rank's gathered outputs, itself included, at row
 * row_offset; then the nextra extra tensors (extra_row_bytes[k] bytes per row, this rank's rows
 * at extra_srcs[k]) likewise; then the ranks meet. Each gathered output is total_rows rows whose
 * row 0 sits at byte payload_offset / scales_offset / extra_offsets[k] of the symmetric region
 * in slot payload_slot / scales_slot / extra_slots[k]. The global scale is read on the device
 * from gs_ptr (one float) when it is not NULL, else gs_value. nextra is at most
 * SYMCOMM_AR_MAX_PIECES - 2; payload_offset is a multiple of 8; extra addresses, offsets and
 * row sizes are multiples of 16. Every rank passes the same cols, total_rows, slots, offsets and
 * row sizes (they size the grid); a rank with no rows passes rows 0 and still takes part.
 * Enqueued on stream; waits are bounded as in symcomm_ar_run. */
typedef struct {
  const void* x;              /* this rank's rows x cols, 16-byte aligned */
  symcomm_dtype_t dtype;      /* SYMCOMM_BFLOAT16 or SYMCOMM_FLOAT16 */
  int64_t rows;
  int64_t cols;
  int64_t row_offset;         /* this rank's first row in the gathered outputs */
  int64_t total_rows;
  const void* gs_ptr;         /* the global scale on the device, or NULL: gs_value */
  float gs_value;
  int payload_slot;
  uint64_t payload_offset;
  int scales_slot;
  uint64_t scales_offset;
  int nextra;
  const uint64_t* extra_srcs;
  const int* extra_slots;
  const uint64_t* extra_offsets;
  const uint64_t* extra_row_bytes;
} symcomm_gatherv_fp4_args_t;
symcomm_status_t symcomm_ar_gatherv_fp4(symcomm_ar_t ctx, const symcomm_gatherv_fp4_args_t* args,
                                        symcomm_stream_t stream);

/* Flag-free NVFP4 all-gatherv (arguments in symcomm_flagfree_fp4_args_t below): quantizes this
 * rank's rows x [rows[rank], cols] with the codec of symcomm_fp4_quantize, bit for bit, and
 * pushes payload and linear block scales into every peer's flag-free receive buffer, whence
 * each peer copies them into its own gathered outputs; this rank's own rows go straight into its
 * outputs. The outputs are plain device memory of this rank (sum(rows) rows of cols/2 payload
 * bytes and cols/16 scale bytes, rank order, any alignment): no peer maps them. The protocol,
 * buffers and bounds of symcomm_ar_flagfree_all_gatherv, so calls of every flag-free entry point
 * may follow each other in any order. On the wire a rank's chunk is ceil(rows*cols/32) payload
 * vectors then ceil(rows*cols/256) scale vectors of 16 bytes, at most the context's flag-free
 * buffer size; the codec never writes a word that would read as the sentinel there (see
 * csrc/peer_gather.cu). dtype is bf16 or fp16, cols a positive multiple of 16, x 16-byte aligned;
 * rows[] (world entries) and cols are the same on every rank. The global scale is read on the
 * device from gs_ptr when it is not NULL, else gs_value. Rows that add up to 0 enqueue nothing. */
typedef struct {
  const void* x;          /* this rank's rows x cols, 16-byte aligned */
  symcomm_dtype_t dtype;  /* SYMCOMM_BFLOAT16 or SYMCOMM_FLOAT16 */
  int64_t cols;
  const int64_t* rows;    /* every rank's row count, in rank order (world entries) */
  const void* gs_ptr;     /* the global scale on the device, or NULL: gs_value */
  float gs_value;
  void* payload;          /* this rank's gathered payload, sum(rows) x cols/2 bytes */
  void* scales;           /* this rank's gathered linear block scales, sum(rows) x cols/16 bytes */
} symcomm_flagfree_fp4_args_t;
symcomm_status_t symcomm_ar_flagfree_gatherv_fp4(symcomm_ar_t ctx, const symcomm_flagfree_fp4_args_t* args,
                                                 symcomm_stream_t stream);


/* Uneven reduce-scatter (sum): every rank's input holds total_bytes; this rank sums the
 * nbytes at row_offset of every rank's input, in rank order in fp32 (the one-shot kernel), into
 * out. The input is read through slot `slot` at in_offset, or, with stage != 0, first copied
 * whole into the staging buffer (total_bytes at most the staging size). Every rank passes the
 * same total_bytes; a rank with no rows passes nbytes 0 and still takes part. Sizes and
 * offsets are multiples of 16. Enqueued on stream; waits bounded as in symcomm_ar_run. */
symcomm_status_t symcomm_ar_reduce_scatterv(symcomm_ar_t ctx, symcomm_dtype_t dtype, const void* in, int slot,
                                            uint64_t in_offset, uint64_t total_bytes, uint64_t row_offset, void* out,
                                            uint64_t nbytes, int stage, symcomm_stream_t stream);

/* Unmaps peers and frees this rank's memory; ctx is invalid afterwards. The caller ensures no
 * kernel still uses it on any rank (peers read this rank's buffer). May block in cudaFree. */
symcomm_status_t symcomm_ar_destroy(symcomm_ar_t ctx);

/* Closes ctx while graphs that launch its kernels may still be replayed: marks it closed
 * (SYMCOMM_AR_ABORT_CLOSED), so such a replay returns at once, and frees only host state. Its
 * device memory and peer mappings stay until the process exits; ctx is invalid afterwards.
 * Blocks for a host-to-device copy. */
symcomm_status_t symcomm_ar_retire(symcomm_ar_t ctx);

/* Static text for any status code of this library (never NULL). */
const char* symcomm_cuda_error_string(symcomm_status_t code);

/* ------------------------------------------------------------------------------------------
 * NVFP4 (fp4.cu); symcomm/fp4.py defines the format. Shapes are the unquantized [rows, cols],
 * cols a positive multiple of 16: x and out are rows x cols of dtype, packed is
 * rows x cols/2 bytes, scales rows x cols/16 bytes, or with swizzle the 128x4-tiled layout
 * [rows rounded up to 128, cols/16 rounded up to 4] with the padding written 0.
 */

/* Quantizes device memory x on stream; returns without waiting. The global scale is read on
 * the device from gs_ptr (one float) when it is not NULL, otherwise gs_value is used. */
symcomm_status_t symcomm_fp4_quantize(const void* x, symcomm_dtype_t dtype, int64_t rows, int64_t cols,
                                      const void* gs_ptr, float gs_value, void* packed, void* scales, int swizzle,
                                      symcomm_stream_t stream);

/* Decodes device memory packed/scales into out (dtype) on stream; global scale as above. */
symcomm_status_t symcomm_fp4_dequantize(const void* packed, const void* scales, int64_t rows, int64_t cols,
                                        const void* gs_ptr, float gs_value, int swizzled, void* out,
                                        symcomm_dtype_t dtype, symcomm_stream_t stream);


/* ------------------------------------------------------------------------------------------
 * Residual add + RMSNorm (rmsnorm.cu; csrc/rmsnorm.cuh holds the math, the rounding contract
 * and the reduction order). Rows are [rows, cols] of dtype (bf16 or fp16 only), cols a
 * positive multiple of 8 and at most 32768 (of 16 for NVFP4):
 *   h = a + residual (a alone when residual is NULL), rounded to dtype, written to residual_out
 *       unless it is NULL; residual_out may be a or residual itself (each element is read
 *       before it is written);
 *   y = h * rsqrt(mean(h^2) + eps) * weight (weight: cols values), rounded to dtype, written to
 *       out as dtype (SYMCOMM_NORM_NONE), as e4m3 bytes of y / scale saturated to +-448
 *       (SYMCOMM_NORM_FP8: scale is a dequant scale, y ~= e4m3 * scale), or NVFP4-encoded with
 *       global scale `scale` (SYMCOMM_NORM_NVFP4: out is the rows x cols/2 packed codes, scales
 *       the block scales, linear or with swizzle the layout of the fp4 section above).
 * out must not overlap any input or residual_out. Pointers are 16-byte aligned (out: 8 bytes
 * for FP8, 4 for NVFP4). rows == 0 does nothing.
 */
typedef enum {
  SYMCOMM_NORM_NONE = 0,
  SYMCOMM_NORM_FP8 = 1,
  SYMCOMM_NORM_NVFP4 = 2,
  SYMCOMM_NORM_QUANT_MAX_ENUM = 0x7fffffff
} symcomm_norm_quant_t;

/*
 * The arguments of one residual add + RMSNorm, after its input a: symcomm_rmsnorm and the
 * testing header's symcomm_rmsnorm_host take them.
 * The scale is read on the device from scale_ptr (one float) when it is not NULL, otherwise
 * scale_value is used (ignored for SYMCOMM_NORM_NONE; the host twin reads scale_value only).
 */
typedef struct {
  const void* residual;       /* rows x cols of dtype, or NULL */
  const void* weight;         /* cols values of dtype */
  symcomm_dtype_t dtype;      /* SYMCOMM_BFLOAT16 or SYMCOMM_FLOAT16 */
  int64_t rows;
  int64_t cols;
  float eps;
  void* residual_out;         /* h; NULL: not written */
  symcomm_norm_quant_t quant;
  void* out;                  /* y, its FP8 bytes, or its NVFP4 codes */
  void* scales;               /* NVFP4 block scales, else NULL */
  const void* scale_ptr;
  float scale_value;
  int swizzle;
} symcomm_rmsnorm_args_t;

/* Enqueues one kernel (a programmatic dependent launch: csrc/launch.cuh) on stream, plus a
 * memset of the swizzled scale padding; returns without waiting. */
symcomm_status_t symcomm_rmsnorm(const void* a, const symcomm_rmsnorm_args_t* args, symcomm_stream_t stream);

/* ------------------------------------------------------------------------------------------
 * MoE expert-parallel dispatch and combine (ep.cu) over a context's mapped symmetric regions.
 * symcomm/ep/layout.py defines where every row lands and how combine adds; symcomm/ep/fp8.py the
 * FP8 blocks, symcomm/fp4.py NVFP4. Every rank's buffers named by (slot, offset) sit at the same
 * offset of a region mapped in that slot; the rest are this rank's own device memory. Every rank
 * passes the same cols, topk, num_experts, max_tokens, align, quant, capacity, slots and offsets
 * (they size the grids and the buffers); a rank with no tokens passes rows 0 and still takes
 * part. Enqueued on stream, no host synchronisation (capturable); waits bounded as in
 * symcomm_ar_run.
 */
typedef enum {
  SYMCOMM_EP_NONE = 0,   /* rows as they are */
  SYMCOMM_EP_NVFP4 = 1,  /* symcomm_fp4_quantize's codes and block scales (dispatch only) */
  SYMCOMM_EP_FP8 = 2,    /* e4m3 codes, one float32 scale per 128 values */
  SYMCOMM_EP_QUANT_MAX_ENUM = 0x7fffffff
} symcomm_ep_quant_t;

/* Most experts, and most top-k slots, the kernels take. */
#define SYMCOMM_EP_MAX_EXPERTS 1024
#define SYMCOMM_EP_MAX_TOPK 32

typedef struct {
  const void* x;              /* this rank's tokens, rows x cols of dtype, 16-byte aligned */
  symcomm_dtype_t dtype;      /* bf16 or fp16; fp32 only with SYMCOMM_EP_NONE */
  int64_t rows;
  int64_t cols;               /* a row is whole 16-byte vectors; NVFP4: a multiple of 16; FP8: of 128 */
  const void* topk_ids;       /* rows x topk, int32 or (ids_int64 != 0) int64 */
  int ids_int64;
  const void* weights;        /* rows x topk top-k weights of weights_dtype: they travel to the */
  symcomm_dtype_t weights_dtype;  /* experts' ranks in recv_group, where combine adds by them */
  int topk;                   /* 1..SYMCOMM_EP_MAX_TOPK */
  int num_experts;            /* a multiple of the world size, at most SYMCOMM_EP_MAX_EXPERTS */
  int64_t max_tokens;
  int align;                  /* each local expert's rows start at a multiple of align */
  int64_t capacity;           /* rows of every receive buffer (symcomm/ep/layout.py's capacity) */
  symcomm_ep_quant_t quant;
  const void* gs_ptr;         /* NVFP4's global scale on the device (one float), or NULL: gs_value */
  float gs_value;
  int swizzle;                /* NVFP4 block scales in the 128x4 layout of a capacity-row matrix */
  int recv_slot;              /* received rows: capacity x (cols*itemsize | cols/2 | cols) bytes */
  uint64_t recv_offset;
  int scales_slot;            /* NVFP4 e4m3 scales, or FP8 float32 scales [capacity, cols/128] */
  uint64_t scales_offset;
  int src_slot;               /* recv_src: capacity int32, where each received row came from */
  uint64_t src_offset;
  int table_slot;             /* the counts table: world x (num_experts + 1) int32 (the last column
                                 is each rank's fingerprint of its sizes: symcomm/ep/layout.py) */
  uint64_t table_offset;
  int group_slot;             /* recv_group: world x max_tokens x topk x 2 int32, the rows and weights */
  uint64_t group_offset;      /*   of each rank's token here (symcomm/ep/layout.py); 8-byte aligned */
  int32_t* send_rows;         /* this rank's, max_tokens x topk: each entry's row on its rank, or -1 */
  int32_t* expert_counts;     /* this rank's, num_experts / world */
  int32_t* expert_offsets;    /* this rank's, num_experts / world + 1 */
} symcomm_ep_dispatch_args_t;

/* Dispatch: exchanges every rank's per-expert counts and the fingerprint of its sizes (a bounded
 * wait for every peer's stamped counts; ranks whose fingerprints differ all stop with
 * SYMCOMM_AR_ABORT_MISMATCH before any row moves), places this rank's entries, then writes each
 * token (quantized per quant) into the receive buffers of the ranks holding its experts, with its
 * origin in their recv_src and its group and weight in their recv_group, and meets the peers again.
 * When it completes on a rank, every row sent to that rank has landed. One launch. */
symcomm_status_t symcomm_ep_dispatch(symcomm_ar_t ctx, const symcomm_ep_dispatch_args_t* args,
                                     symcomm_stream_t stream);

typedef struct {
  const void* expert_out;     /* this rank's, capacity x cols of dtype (bf16, fp16 or fp32) */
  symcomm_dtype_t dtype;
  int64_t cols;               /* a multiple of 8; FP8: of 128 */
  int64_t capacity;
  symcomm_ep_quant_t quant;   /* SYMCOMM_EP_NONE or SYMCOMM_EP_FP8 */
  const int32_t* recv_group;  /* this rank's (dispatch's), world x max_tokens x topk x 2, 8-byte aligned */
  int num_local;
  int returned_slot;          /* world * max_tokens partial rows coming back to each rank */
  uint64_t returned_offset;
  int64_t max_tokens;
  int topk;
  int64_t rows;               /* this rank's tokens */
  const int32_t* send_rows;   /* this rank's (dispatch's), rows x topk */
  const void* topk_ids;       /* this rank's (dispatch's), rows x topk, int32 or (ids_int64) int64 */
  int ids_int64;
  void* out;                  /* rows x cols of dtype */
} symcomm_ep_combine_args_t;

/* Combine, by rank (symcomm/ep/layout.py): every rank adds up each group of rows it holds (one
 * token's entries on this rank) in slot order, weighted by the weights dispatch carried, in fp32,
 * and writes the sum (in dtype, FP8-quantized per quant) into the returned buffer of the rank
 * that owns the token; every block meets every peer block, and each rank adds its tokens'
 * partials in rank order, in fp32, into out. Ranks that passed another quant or dtype (or sizes
 * of another dispatch) all stop at the meeting with SYMCOMM_AR_ABORT_MISMATCH and write no out.
 * One launch. */
symcomm_status_t symcomm_ep_combine(symcomm_ar_t ctx, const symcomm_ep_combine_args_t* args,
                                    symcomm_stream_t stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* SYMCOMM_H_ */
