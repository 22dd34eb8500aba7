// Programmatic dependent launch (PDL) for every kernel that follows model work on a stream:
// the peer kernels (peer.cuh's begin_epoch and flagfree_begin, which every one of them enters
// through) and the standalone RMSNorm.
//
// In a decode step the all-reduce follows a GEMM on the same stream. Launched plainly, the
// all-reduce's blocks are scheduled only after the GEMM's last block has exited. Launched with
// PDL, they may be scheduled as soon as every block of the GEMM has signalled
// launch_dependents (or exited), while its tail still runs: the launch, the block scheduling
// and the kernel-parameter loads then overlap the GEMM instead of following it.
//
// The one rule that keeps this correct: a kernel launched with PDL executes
// griddepcontrol.wait before it reads or writes anything another kernel may touch. The wait
// returns once every prerequisite grid has completed and its writes are visible. Our kernels
// wait first thing, before their epoch word (the previous peer kernel of the context writes it),
// before their input (the GEMM writes it) and before any peer: a peer can never see this rank
// arrive before this rank's input is final. After the wait they signal launch_dependents at
// once (the standalone RMSNorm with more blocks than SMs signals at its end: csrc/rmsnorm.cu).
// That only lets the next kernel on the stream be *scheduled*; if it was launched with PDL it
// must wait in turn (the contract of every PDL kernel, ours included), and a kernel
// launched plainly still starts after we exit. By the time the signal counts, all our blocks
// are resident (the signal counts only once every block of the grid has given it), so a
// dependent that occupies SMs cannot keep one of our blocks from starting while its peers spin.
//
// The signal is a promise about the *next* kernel, launched by someone else: a kernel launched
// with PDL that never executes griddepcontrol.wait may then read our output before it is
// written. NCCL 2.28 through 2.30.6 launch their symmetric kernels with PDL and do not wait
// (NCCL's enqueue.cc; the generator of its symmetric kernels added the wait in 2.30.7). So
// where such an NCCL is loaded, symcomm's NCCL path turns the early signal off for the process
// (symcomm_set_early_dependents): every kernel of ours then lets the next one start only when
// it exits. The wait stays: it is what makes us a safe dependent ourselves.
//
// Both instructions are no-ops in a kernel launched without PDL; griddepcontrol needs sm_90
// (setup.py builds sm_90 and newer), and older targets compile them out.
#ifndef SYMCOMM_LAUNCH_CUH_
#define SYMCOMM_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <utility>

namespace symcomm {

// Wait for the kernel this one may overlap. Every thread calls it: the wait makes the
// predecessor's writes visible to the thread that waited.
__device__ __forceinline__ void wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel on the stream be scheduled (once every block of this grid has said so).
__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Wait for the kernel this one may overlap, then, if ``early``, let the next one be scheduled.
__device__ __forceinline__ void enter_after_predecessor(bool early) {
  wait_for_predecessor();
  if (early) let_dependents_launch();
}

// Whether kernels may signal their dependents early (symcomm_set_early_dependents; on unless
// turned off). Defined once, in custom_ar.cu; read at every launch and passed to the kernel.
bool dependents_early();

// kernel<<<grid, block, 0, stream>>>(args...), as a programmatic dependent launch when
// `overlap` is set. Returns the launch's own error, and clears it as cudaGetLastError does after
// <<<>>>: callers that check cudaGetLastError later must not see this launch's error again.
template <typename... Params, typename... Args>
cudaError_t launch(bool overlap, void (*kernel)(Params...), unsigned grid, unsigned block, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = overlap ? &attr : nullptr;
  config.numAttrs = overlap ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // namespace symcomm

#endif  // SYMCOMM_LAUNCH_CUH_
