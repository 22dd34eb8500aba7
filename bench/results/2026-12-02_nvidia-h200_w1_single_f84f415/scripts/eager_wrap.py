"""Runs bench/eager_overhead.py with ROOT's symcomm package first on sys.path, and says which loaded."""
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
import symcomm  # noqa: E402
print("symcomm from", symcomm.__file__, flush=True)
sys.argv = ["bench/eager_overhead.py", *sys.argv[2:]]
runpy.run_path("bench/eager_overhead.py", run_name="__main__")
