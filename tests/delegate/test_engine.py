"""The engine adapter: what creating onecopy's CPU device costs a process, and where its workers run."""

import json
import os
import subprocess
import sys
from pathlib import Path

from onecopy.delegate.cpus import worker_count
from onecopy.delegate.engine import task_executor_flags

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json
def anon():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Anonymous:")) * 1024
import iree.runtime
from onecopy.delegate.engine import hal_device
before = anon()
hal_device("local-task")
print(json.dumps({"growth": anon() - before}))
"""


WORKERS_PROBE = """
import json, os, time
from onecopy.delegate.engine import hal_device
hal_device("local-task")
time.sleep(0.2)  # the workers name themselves and set their affinity as they start
workers = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        name = f.read().strip()
    if name.startswith("iree-worker"):
        workers[name] = sorted(os.sched_getaffinity(int(tid)))
print(json.dumps({"process": sorted(os.sched_getaffinity(0)), "workers": workers}))
"""


def run_probe(probe: str, env_flags: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "IREE_PY_RUNTIME_FLAGS"}
    if env_flags is not None:
        env["IREE_PY_RUNTIME_FLAGS"] = env_flags
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_growth(env_flags: str | None) -> int:
    return run_probe(PROBE, env_flags)["growth"]


def test_the_cpu_device_reserves_little_private_memory_unless_the_user_asks_for_more():
    # IREE reserves the CPU's L2 size per worker by default (MiBs, resident in every process); onecopy 64 KiB.
    ours = device_growth(None)
    asked = device_growth("--task_worker_local_memory=4194304")  # 4 MiB per worker: the user's flag wins
    assert ours < 1 << 20
    assert asked > ours + (3 << 20)  # at least one worker, 4 MiB each


def test_the_cpu_device_runs_one_unpinned_worker_per_physical_core():
    # Pinned workers stalled a scheduler tick whenever the calling thread held their core (see engine.py).
    seen = run_probe(WORKERS_PROBE, None)
    assert len(seen["workers"]) == worker_count()
    assert all(cpus == seen["process"] for cpus in seen["workers"].values()), seen


def test_a_users_topology_flags_decide_the_workers():
    seen = run_probe(WORKERS_PROBE, "--task_topology_group_count=1")
    assert list(seen["workers"]) == ["iree-worker-0"]
    assert task_executor_flags("--task_topology_mode=physical_cores") == [
        f"--task_worker_local_memory={64 * 1024}"]
    assert task_executor_flags("--task_worker_local_memory=1") == [
        f"--task_topology_group_count={worker_count()}"]
