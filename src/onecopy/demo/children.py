"""The demo's fresh processes: each figure that needs a process of its own (time to first result, memory growth)
is measured by `python -m onecopy.demo KIND ARGS` (this module's `main`), which prints its figures as one line of
JSON. `run_child` starts one from the demo and returns what it printed; the functions below run inside it.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["run_child", "decode_one", "main"]


def run_child(kind: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run `python -m onecopy.demo KIND ARGS` and return the JSON it prints last. subprocess.run kills the child
    on any exception, KeyboardInterrupt included, before this returns."""
    result = subprocess.run([sys.executable, "-m", "onecopy.demo", kind, *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"demo child {kind} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _growth(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {key: (after[key] - before[key]) / 2**20 for key in after}


def _child_load_onecopy(program: str, cache_dir: str) -> dict:
    started = time.perf_counter()
    import iree.runtime  # noqa: F401  (the engine's import, paid by every process, cold or warm)
    import numpy as np

    import onecopy.delegate.backend  # noqa: F401  (imported on first load otherwise; imports are not loading)
    from onecopy import Runtime

    imported = time.perf_counter()
    with Runtime(cache_dir=cache_dir).load_program(program) as loaded:
        loaded.load_method("forward").execute([np.ones((1, 1024), np.float32)])
        first = time.perf_counter()
    return {"import_ms": (imported - started) * 1e3, "first_result_ms": (first - imported) * 1e3}


def _child_load_ort(onnx_path: str) -> dict:
    started = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    imported = time.perf_counter()
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones((1, 1024), np.float32)})
    first = time.perf_counter()
    return {"import_ms": (imported - started) * 1e3, "first_result_ms": (first - imported) * 1e3}


def _wait_unmapped(paths: tuple[str, ...], release: Callable[[], None], timeout_s: float = 5.0) -> None:
    """Wait until this process maps nothing under `paths`: the baseline must not hold the warm-up's weights, or
    the first load maps the same pages again and looks free. A closed program's weights go a moment after its
    close (quarantine) and the cache entry's mappings with its last reference, which a cycle can hold until a
    collection."""
    deadline = time.monotonic() + timeout_s
    while True:
        release()
        gc.collect()
        with open("/proc/self/maps") as f:
            held = [line for line in f if any(p in line for p in paths)]
        if not held:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up's files are still mapped {timeout_s} s after its close: {held[0].strip()}")
        time.sleep(0.02)


def _child_memory_onecopy(program: str, cache_dir: str, share: bool, k: int) -> dict:
    import numpy as np

    from onecopy import Runtime
    from onecopy.delegate import quarantine
    from onecopy.measure import memory
    from onecopy.models import METHOD_BATCH, WIDTH

    runtime = Runtime(cache_dir=cache_dir)
    with runtime.load_program(program) as warm:  # engine libraries and threads: loaded, not counted
        warm.load_method("forward").execute([np.ones((1, WIDTH), np.float32)])
    _wait_unmapped((program, cache_dir), quarantine.drain)
    before = memory()
    options = {"IreeBackend": {"share_multifunction_model": share}}
    programs = []
    for _ in range(k):
        loaded = runtime.load_program(program, backend_options=options)
        for name, batch in METHOD_BATCH.items():
            loaded.load_method(name).execute([np.ones((batch, WIDTH), np.float32)])
        programs.append(loaded)
    after = memory()
    for loaded in programs:
        loaded.close()
    return _growth(before, after)


def _child_memory_ort(onnx_path: str, warmup_path: str, k: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from onecopy.measure import memory

    # Warm up on another (tiny) model: a session of this one, freed, would leave its weights' pages in the
    # allocator for the next session to reuse, and K=1 would look free.
    tiny = ort.InferenceSession(warmup_path, providers=["CPUExecutionProvider"])
    tiny.run(None, {"x": np.ones((1, 16), np.float32)})
    del tiny
    gc.collect()
    before = memory()
    sessions = []
    for _ in range(k):
        session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones((1, 1024), np.float32)})
        sessions.append(session)
    return _growth(before, memory())


def decode_one(decode, state, token: int, position: int):
    import numpy as np

    (logits,) = decode.execute([np.array([[token]], np.int64), np.array([position])], state=state)
    return logits


def _child_memory_llm(program: str, cache_dir: str) -> dict:
    """PSS/RSS growth (bytes) of 1 and then 4 States of one loaded program, one decode on each, over a process
    that already holds the program and a warmed-up State (kept: its freed pages would serve the next one)."""
    from onecopy import Runtime
    from onecopy.measure import memory, release_free_memory

    with Runtime(cache_dir=cache_dir).load_program(program) as prog:
        decode = prog.load_method("decode")
        warm = prog.create_state()
        decode_one(decode, warm, 1, 0)
        gc.collect()
        release_free_memory()  # else the States reuse what the load freed, and seem to cost nothing
        before = memory()
        states = []
        found = {}
        for n in (1, 4):
            while len(states) < n:
                state = prog.create_state()
                decode_one(decode, state, 1, 0)
                states.append(state)
            after = memory()
            found[str(n)] = {key: after[key] - before[key] for key in after}
        del states, warm
    return found


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("python -m onecopy.demo KIND ARGS runs one of the demo's fresh processes; "
                         "for the demo itself run `onecopy demo`")
    kind, args = argv[0], argv[1:]
    if kind == "load-onecopy":
        found = _child_load_onecopy(args[0], args[1])
    elif kind == "load-ort":
        found = _child_load_ort(args[0])
    elif kind == "memory-onecopy":
        found = _child_memory_onecopy(args[0], args[1], args[2] == "on", int(args[3]))
    elif kind == "memory-llm":
        found = _child_memory_llm(args[0], args[1])
    elif kind == "memory-ort":
        found = _child_memory_ort(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown demo child {kind!r}")
    print(json.dumps(found))

