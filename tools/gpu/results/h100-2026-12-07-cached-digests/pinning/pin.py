"""Ad hoc (run beside tools/gpu/gpu_stack.sh, 2026-12-07): for DURATION seconds, every second, binds the vLLM
engines' process trees to ENGINE_CORES and every other python3/etcd process of the run to CONTROL_CORES (all
threads): python3 pin.py 0-11 12-15 245."""

import os
import subprocess
import sys
import time

engine_cores, control_cores, duration = sys.argv[1], sys.argv[2], float(sys.argv[3])
me = os.getpid()
end = time.time() + duration
seen: dict[int, str] = {}
while time.time() < end:
    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    rows = listing.stdout.splitlines()
    procs: dict[int, tuple[int, str]] = {}
    for row in rows:
        parts = row.split(None, 2)
        if len(parts) == 3:
            procs[int(parts[0])] = (int(parts[1]), parts[2])
    children: dict[int, list[int]] = {}
    for pid, (ppid, _args) in procs.items():
        children.setdefault(ppid, []).append(pid)
    engines: set[int] = set()
    stack = [pid for pid, (_, args) in procs.items() if "vllm.entrypoints" in args]
    while stack:
        top = stack.pop()
        if top not in engines:
            engines.add(top)
            stack += children.get(top, [])
    for pid, (_, args) in procs.items():
        if pid == me:
            continue
        if pid in engines:
            cores = engine_cores
        elif "python" in args.split()[0] or "etcd" in args.split()[0]:
            cores = control_cores
        else:
            continue
        if seen.get(pid) != cores:
            done = subprocess.run(["taskset", "-a", "-cp", cores, str(pid)], capture_output=True, text=True)
            if done.returncode == 0:
                seen[pid] = cores
                print(f"pinned {pid} to {cores}: {args[:90]}", flush=True)
    time.sleep(1)
