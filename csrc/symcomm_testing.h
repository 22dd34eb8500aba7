/*
 * symcomm_testing.h: what libsymcomm exports for tests and measurements only. Not API: these may
 * change with any release (SYMCOMM_ABI_VERSION still counts them, since tests load them).
 *
 * tests/gpu_sim uses the simulated-rank hooks to run W ranks' kernels on one GPU; the CPU twins
 * run the kernels' own per-row and per-block code on host memory, so CI (which has no GPU)
 * checks the kernels' math and GPU tests compare the kernels with them. symcomm/_native.py's
 * TESTING_SIGNATURES is the ctypes twin, held to this file by tests/test_native_header.py.
 */
#ifndef SYMCOMM_TESTING_H_
#define SYMCOMM_TESTING_H_

#include "symcomm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Testing: simulated ranks. Links world contexts of ONE process (ctxs[r] created with rank r,
 * all on one device, same sizes) as if symcomm_ar_open had mapped each other's buffers: the
 * peer tables and slot 0 take the other contexts' own device pointers, no IPC. Also caps every
 * later launch on these contexts at max_blocks blocks (never raised above the real caps): all
 * ranks' blocks must be resident on the one GPU at once, since each spins waiting for the
 * others. Call once, before any symcomm_ar_run on them. Proves barrier, sentinel and indexing
 * logic only; it says nothing about NVLink timing. Blocks for host-to-device copies. */
symcomm_status_t symcomm_ar_sim_link(symcomm_ar_t* ctxs, int world, int max_blocks);

/* Testing only. Sets every block's barrier epoch of this context (the device-side, local epoch
 * array) to epoch, so tests can place a world just below and across 2^31 and 2^32 without
 * making that many calls. Call it on every rank of the world with the same value, while no
 * kernel of this world is in flight on any rank; epochs only move forward, so a value below
 * any block's current epoch is refused (invalid value). Blocks for device copies. */
symcomm_status_t symcomm_ar_debug_seed_epochs(symcomm_ar_t ctx, uint64_t epoch);

/* Testing only. How many meetings of every block of every rank (the MoE combine's, and a
 * deduplicating MoE dispatch's) this context has completed. Blocks for a device copy. */
symcomm_status_t symcomm_ar_debug_meetings(symcomm_ar_t ctx, uint64_t* meetings);

/* Whether this context's later launches are programmatic dependent launches (csrc/launch.cuh):
 * on (nonzero) from symcomm_ar_create. Every rank may choose for itself; the kernels are the
 * same either way, only when their blocks are scheduled differs. It exists to measure what the
 * overlap gains. Graphs keep the launches they captured. */
symcomm_status_t symcomm_ar_set_overlap(symcomm_ar_t ctx, int enabled);

/* Testing and measurement only. From how many valid entries per rank, on average over the world,
 * this context's EP dispatches send a token once to each peer rank that holds some of its experts
 * (the receiver copies the row to the others): 0 always, a count past every call's never, -1 the
 * built-in threshold, where every context starts (csrc/ep.cu's kDedupFromBytes of rows, over the
 * call's row size). The received bytes are the same either way. Every rank of a world must pass
 * the same value before its next dispatch: a value other than the built-in one joins the call's
 * fingerprint, so ranks that disagree stop with the layout mismatch before any row moves. */
symcomm_status_t symcomm_ep_debug_dedup_from(symcomm_ar_t ctx, int64_t entries);

/* Testing and measurement only. The launch of this context's later flag-free NVFP4 gathers
 * (csrc/peer_gather.cu): `blocks` > 0 launches that many blocks (at most the widest flag-free
 * grid) of `threads` (a multiple of 32 from 128 to 1024), 0 the built-in choice; `block_major`
 * nonzero numbers the lanes block by block instead of spreading warps over the blocks. The bytes
 * written are the same either way. Every rank of a world must pass the same values (block b
 * meets block b). */
symcomm_status_t symcomm_fp4_debug_grid(symcomm_ar_t ctx, int blocks, int threads, int block_major);

/* Testing only: copies nbytes from src to dst on stream, but only after delay_ns, in a kernel
 * that lets a programmatic dependent launch behind it be scheduled at once. A peer kernel
 * launched next must still read dst's new bytes: it waits for its predecessor first. */
symcomm_status_t symcomm_debug_late_copy(void* dst, const void* src, uint64_t nbytes, uint64_t delay_ns,
                                         symcomm_stream_t stream);

/* Testing only: copies nbytes from src to dst on stream in a programmatic dependent launch that
 * never waits for its predecessor, as some NCCL versions' symmetric kernels do
 * (symcomm_set_early_dependents). It sees the kernel before it complete only where that kernel
 * did not let its dependents start early. */
symcomm_status_t symcomm_debug_unwaiting_copy(void* dst, const void* src, uint64_t nbytes, symcomm_stream_t stream);

/* symcomm_ar_gatherv_fp4's encoding and addressing on the CPU: writes this rank's payload and
 * scale bytes into host buffers holding the whole gathered payload and scales (total_rows rows
 * from row 0), exactly where the kernel writes them on every rank, through the same per-block
 * routine (args' x, dtype, rows, cols, row_offset, total_rows and gs_value; the rest is unused).
 * Needs no GPU and returns when done; exists so CI checks the fused kernel's bytes against the
 * codec without a device. */
symcomm_status_t symcomm_ar_gatherv_fp4_host(const symcomm_gatherv_fp4_args_t* args, void* payload, void* scales);

/* symcomm_ar_flagfree_gatherv_fp4's wire format on the CPU, for the rank `rank` of args->rows:
 * writes its chunk as the kernel sends it (wire: its vectors, 16 bytes each) and then decodes
 * that chunk, through the kernel's own decoding routine, into host buffers holding the whole
 * gathered payload and scales, where every peer's kernel writes it (args' x, dtype, cols, rows
 * and gs_value; the rest is unused). Needs no GPU; exists so CI checks that the wire never holds
 * the sentinel word and that it decodes to the codec's bytes. */
symcomm_status_t symcomm_flagfree_fp4_wire_host(const symcomm_flagfree_fp4_args_t* args, int world, int rank,
                                                void* wire, void* payload, void* scales);

/* The same per-block code as the kernels, run on the CPU over host memory; needs no GPU and
 * returns when done. Exists so CI checks the kernels' math without a device. */
symcomm_status_t symcomm_fp4_quantize_host(const void* x, symcomm_dtype_t dtype, int64_t rows, int64_t cols,
                                           float global_scale, void* packed, void* scales, int swizzle);
symcomm_status_t symcomm_fp4_dequantize_host(const void* packed, const void* scales, int64_t rows, int64_t cols,
                                             float global_scale, int swizzled, void* out, symcomm_dtype_t dtype);

/* The same per-row code on the CPU over host memory (the reduction in the kernel's order), so
 * CI checks the kernel's math without a device and GPU tests compare the kernel with it. */
symcomm_status_t symcomm_rmsnorm_host(const void* a, const symcomm_rmsnorm_args_t* args);

/* How many blocks symcomm_rmsnorm gives each of `rows` rows of `cols` 2-byte values when `slots`
 * blocks can each have an SM (the SM count), for these pointers (only compared, never read):
 * 1 wherever residual_out overlaps a or residual. Needs no GPU; exists so CI checks the rule. */
int symcomm_norm_row_parts(int64_t rows, int64_t cols, int64_t slots, const void* a, const void* residual,
                           const void* residual_out);

/* symcomm_ep_dispatch for `world` simulated ranks on host memory: args[r] is rank r's call (its
 * slot and offset fields unused), recv[r], scales[r] (NULL without quant), src[r] and table[r] rank
 * r's buffers in place of the slots. The same per-entry and per-row code as the kernels
 * (csrc/ep.cuh), positions and offsets computed one by one in the order symcomm/ep/layout.py
 * states. Needs no GPU and returns when done; exists so CI checks the kernels' bytes. */
symcomm_status_t symcomm_ep_dispatch_host(int world, const symcomm_ep_dispatch_args_t* args, void* const* recv,
                                          void* const* scales, int32_t* const* src, int32_t* const* table,
                                          int32_t* const* group);

/* symcomm_ep_combine likewise: args[r] rank r's call, returned[r] its returned buffer. */
symcomm_status_t symcomm_ep_combine_host(int world, const symcomm_ep_combine_args_t* args, void* const* returned);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* SYMCOMM_TESTING_H_ */
