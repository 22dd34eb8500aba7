import sys, time, torch, torch.distributed as dist
sys.path.insert(0, "examples"); sys.path.insert(0, "scripts")
import symcomm, tp_train_step, fsdp_train_step
import examples_world1 as ew
from layer_utils import init_distributed
modes = tuple(sys.argv[1].split(","))
init_distributed(cpu=False)
comm = symcomm.Communicator()
failed = total = 0
for name, run in (("tp_train_step", lambda: tp_train_step.run_checks(comm, tp_train_step.TrainConfig(hidden=1024, ffn=4096), modes, steps=3, tokens=64)),
                  ("fsdp_train_step", lambda: fsdp_train_step.run_checks(comm, fsdp_train_step.TrainConfig(hidden=1024, ffn=4096), modes, steps=3, tokens=64))):
    t = time.perf_counter()
    checks = run(); torch.cuda.synchronize()
    bad = [c for c in checks if not c.ok]
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {name}: {c.name}: {c.detail}", flush=True)
    print(f"{name} {modes}: {len(checks)-len(bad)}/{len(checks)} in {time.perf_counter()-t:.1f} s", flush=True)
    failed += len(bad); total += len(checks)
if "many" in sys.argv[2:]:
    for n, good, detail in ew.many_graphs(comm):
        print(f"{'ok  ' if good else 'FAIL'} many graphs: {n}: {detail}", flush=True)
        failed += not good; total += 1
comm.close(); dist.destroy_process_group()
print(f"examples_part {modes}: {total - failed}/{total} passed", flush=True)
