"""Run a script (runpy) and print, on rank 0 at exit, every (op, bytes) -> path that auto chose."""
import atexit, os, runpy, sys
from symcomm import dispatch

seen = {}
_orig = dispatch.Router.choose


def choose(self, operation, call, algo="auto", explain=False):
    path, choice = _orig(self, operation, call, algo, explain)
    key = (operation.name, call.nbytes, algo)
    if key not in seen:
        seen[key] = getattr(path, "name", None)
    return path, choice


dispatch.Router.choose = choose


@atexit.register
def _report():
    if os.environ.get("RANK", "0") == "0":
        for (op, n, algo), name in sorted(seen.items()):
            print(f"PATH {op:16s} {n:>12d} algo={algo:10s} -> {name}", flush=True)


script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
