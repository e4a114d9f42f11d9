"""The engine adapter: what creating onecopy's CPU device costs a process."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def device_growth(env_flags: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "IREE_PY_RUNTIME_FLAGS"}
    if env_flags is not None:
        env["IREE_PY_RUNTIME_FLAGS"] = env_flags
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def test_the_cpu_device_reserves_little_private_memory_unless_the_user_asks_for_more():
    # IREE reserves the CPU's L2 size per worker by default (MiBs, resident in every process); onecopy 64 KiB.
    ours = device_growth(None)
    asked = device_growth("--task_worker_local_memory=4194304")  # 4 MiB per worker: the user's flag wins
    assert ours < 1 << 20
    assert asked > ours + (3 << 20)  # at least one worker, 4 MiB each
