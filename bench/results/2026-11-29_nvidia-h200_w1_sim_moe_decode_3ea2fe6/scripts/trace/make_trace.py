"""Builds a traced copy of symcomm into diag/trace/pkg: csrc/ep.cu with globaltimer/clock64
stamps at each phase of every EP kernel (rank 0, block 0, thread 0; the last call wins), read by
symcomm_debug_ep_trace. Diagnosis only; never part of the package."""
import re, shutil, subprocess, sys
from pathlib import Path

root = Path(__file__).resolve().parents[2]
dst = Path(__file__).resolve().parent / "build"
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(root, dst, ignore=shutil.ignore_patterns(".venv", ".git", "diag", "build", "*.so", "__pycache__"))
ep = dst / "csrc" / "ep.cu"
s = ep.read_text()
helper = '''
__device__ unsigned long long g_trace[64][2];
#define TRACE(i) do { if (s.rank == 0 && blockIdx.x == 0 && threadIdx.x == 0) { \\
  unsigned long long g_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)); \\
  g_trace[i][0] = g_; g_trace[i][1] = clock64(); } } while (0)
'''
s = s.replace("namespace {\nusing namespace symcomm::ar;", helper + "namespace {\nusing namespace symcomm::ar;", 1)
def after(pattern, text, count=1):
    global s
    assert pattern in s, pattern
    s = s.replace(pattern, pattern + text, count)
def before(pattern, text):
    global s
    assert pattern in s, pattern
    s = s.replace(pattern, text + pattern, 1)
def put(anchor, text, before_anchor=False):
    global s
    assert s.count(anchor) >= 1, anchor
    i = s.index(anchor)
    s = s[:i] + text + s[i:] if before_anchor else s[:i + len(anchor)] + text + s[i + len(anchor):]
# layout
put("__global__ void __launch_bounds__(1024) ep_layout(Sync s, const Peers* slots, Dispatch job) {\n", "  TRACE(0);\n")
put("  __shared__ int32_t table[kLayoutInts];", "  TRACE(1);\n", True)
put("  if (!mapped) return;\n", "  TRACE(2);\n")
put("  if (!barrier(s, kStart, W, epoch)) return;\n  // This rank's row", "  TRACE(3);\n", True)
put("  // This rank's row of every table", "  TRACE(4);\n", True)
put("  if (!barrier(s, kEnd, W, epoch)) return;\n  const int32_t* all", "  TRACE(5);\n", True)
put("  const int32_t* all = reinterpret_cast", "  TRACE(6);\n", True)
put("  if (!__syncthreads_and(agree)) return;\n", "  TRACE(7);\n")
put("  // Each entry's row on its destination, by the lane that numbered it.\n", "  TRACE(8);\n", True)
put("  if (threadIdx.x == 0) own_signal(s)->ep_dispatched = 1;\n", "  __syncthreads();\n  TRACE(9);\n")
# push
put("__global__ void __launch_bounds__(kThreads) ep_push(Sync s, const Peers* slots, Dispatch job) {\n", "  TRACE(10);\n")
put("  const Buf buffers[] = {job.recv, job.src, job.scales};", "  TRACE(11);\n", True)
i = s.index("  barrier(s, kEnd, W, epoch);\n}\n\n// ------------------------------------------------------------------ combine")
s = s[:i] + "  __syncthreads();\n  TRACE(12);\n  barrier(s, kEnd, W, epoch);\n  TRACE(13);\n" + s[i + len("  barrier(s, kEnd, W, epoch);\n"):]
# combine
put("__global__ void __launch_bounds__(kThreads) ep_combine(Sync s, const Peers* slots, Combine job) {\n", "  TRACE(20);\n")
put("  __shared__ bool after_dispatch;", "  TRACE(21);\n", True)
put("  if (!after_dispatch && !barrier(s, kStart, W, epoch)) return;\n", "  TRACE(22);\n")
put("  if (!barrier(s, kEnd, W, epoch) || !grid_barrier(s)) return;\n", "  __syncthreads();\n  TRACE(23);\n", True)
s = s.replace("  if (!barrier(s, kEnd, W, epoch) || !grid_barrier(s)) return;\n",
              "  if (!barrier(s, kEnd, W, epoch)) return;\n  TRACE(24);\n  if (!grid_barrier(s)) return;\n  TRACE(25);\n", 1)
i = s.index("    ep::store8(static_cast<T*>(job.out) + t * job.cols + u * ep::kCombineUnit, acc);\n  }\n}\n")
s = s[:i] + "    ep::store8(static_cast<T*>(job.out) + t * job.cols + u * ep::kCombineUnit, acc);\n  }\n  __syncthreads();\n  TRACE(26);\n}\n" + s[i + len("    ep::store8(static_cast<T*>(job.out) + t * job.cols + u * ep::kCombineUnit, acc);\n  }\n}\n"):]
s += '''
extern "C" int symcomm_debug_ep_trace(unsigned long long* out) {
  return cudaMemcpyFromSymbol(out, g_trace, sizeof(g_trace));
}
'''
assert s.count("TRACE(") >= 20, s.count("TRACE(")
ep.write_text(s)
subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dst, check=True)
print(sorted(p.name for p in (dst / "symcomm" / "_native").glob("*.so")))
