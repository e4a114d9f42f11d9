"""The engine adapter: what creating onecopy's CPU device costs a process, where its workers run, and how it
allocates."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
        f"--task_worker_local_memory={64 * 1024}", "--task_topology_mode=physical_cores"]
    assert task_executor_flags("--task_topology_mode=physical_cores", workers=3) == [
        f"--task_worker_local_memory={64 * 1024}", "--task_topology_group_count=3"]
    assert task_executor_flags("--task_worker_local_memory=1") == [
        f"--task_topology_group_count={worker_count()}"]


def _allocate_and_free(device, nbytes: int) -> None:
    import iree.runtime as rt
    import numpy as np

    buffer = device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING,
        device=device, buffer=np.ones(nbytes // 4, np.float32), element_type=rt.HalElementType.FLOAT_32)
    del buffer


@pytest.mark.parametrize("driver", ["local-task", "local-sync"])
def test_a_cpu_device_serves_a_call_from_the_buffers_earlier_calls_freed(driver):
    from onecopy.delegate.engine import hal_device

    device = hal_device(driver)
    # Earlier tests' engine buffers, freed by a garbage collection in the middle, could trim the pool and read as
    # fewer bytes allocated: collected first, and none during the loop.
    gc.collect()
    gc.disable()
    try:
        _allocate_and_free(device, 12_000)  # a buffer of this size is now in the pool, if it was not already
        allocated = device.allocator.statistics["device_bytes_allocated"]
        for _ in range(5):
            _allocate_and_free(device, 12_000)
        assert device.allocator.statistics["device_bytes_allocated"] == allocated  # all five from the pool
    finally:
        gc.enable()


def test_a_result_kept_by_the_caller_is_never_overwritten_by_later_calls(small_program_path, small_model, rng):
    from onecopy import Runtime
    from tests.conftest import eager

    xs = [rng.standard_normal((1, 64), dtype=np.float32) for _ in range(6)]
    for executor in ("parallel", "inline"):
        with Runtime().load_program(small_program_path,
                                    backend_options={"IreeBackend": {"executor": executor}}) as program:
            forward = program.load_method("forward")
            kept = [forward.execute([x])[0] for x in xs]  # each call's buffers go back to the pool after it
            for x, y in zip(xs, kept):
                np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-4, atol=1e-5)


class _Unsigned(torch.nn.Module):
    """uint8 and bool results: IREE's integer buffers carry no sign (both come back as i8 buffers)."""

    def forward(self, x):
        return (x * 50).to(torch.uint8), x > 2


class _UnsignedThenHost(torch.nn.Module):
    """A uint8 engine result read by a host op (relu, skipped to the host) that keeps its dtype."""

    def forward(self, x):
        return torch.relu((x * 50).to(torch.uint8))


@pytest.mark.parametrize("packaging", ["mlir", "vmfb"])
@pytest.mark.parametrize("planned", [True, False])
def test_unsigned_and_bool_results_come_back_as_torch_gives_them(packaging, planned):
    from onecopy import Runtime
    from onecopy.export import CompileSpec, Partitioner, export_program

    x = np.array([0.0, 1.0, 4.0, 5.0], np.float32)  # 200 and 250: negative if read as int8
    model = _Unsigned()
    ep = torch.export.export(model, (torch.from_numpy(x),))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging),
                             memory_planned_outputs=planned)
    want = [t.numpy() for t in model(torch.from_numpy(x))]
    with Runtime().load_program(program.to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        if planned:
            for _ in range(2):  # the checked call, then the kept one
                got = forward.execute([x])
                assert [g.dtype for g in got] == [np.uint8, np.bool_]
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)
        storage = [np.zeros(4, np.uint8), np.zeros(4, np.bool_)]
        for _ in range(2):
            forward.execute([x], outputs=storage)
            for g, w in zip(storage, want):
                np.testing.assert_array_equal(g, w)
    ep = torch.export.export(_UnsignedThenHost(), (torch.from_numpy(x),))
    program = export_program({"forward": ep}, partitioner=Partitioner(skip_ops=("aten.relu.default",)),
                             compile_spec=CompileSpec(packaging=packaging))
    with Runtime().load_program(program.to_bytes()) as loaded:
        (got,) = loaded.load_method("forward").execute([x])
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _UnsignedThenHost()(torch.from_numpy(x)).numpy())


def test_unsigned_results_of_a_program_written_before_manifests_recorded_dtypes(tmp_path):
    """A file whose manifests lack `output_dtypes` (written before they were recorded): a delegate that runs its
    whole method reads its results as the method's recorded outputs."""
    import msgspec

    from onecopy import Runtime
    from onecopy.export import export_program
    from onecopy.program.file import ProgramFile

    x = np.array([0.0, 1.0, 4.0, 5.0], np.float32)
    model = _Unsigned()
    program = export_program({"forward": torch.export.export(model, (torch.from_numpy(x),))})
    delegates = [msgspec.structs.replace(d, manifest={k: v for k, v in d.manifest.items() if k != "output_dtypes"})
                 for d in program.definition.delegates]
    assert all("output_dtypes" in d.manifest for d in program.definition.delegates)
    old = ProgramFile(msgspec.structs.replace(program.definition, delegates=delegates), program.data)
    with Runtime(cache_dir=tmp_path).load_program(old.to_bytes()) as loaded:
        got = loaded.load_method("forward").execute([x])
    assert [g.dtype for g in got] == [np.uint8, np.bool_]
    for g, w in zip(got, model(torch.from_numpy(x))):
        np.testing.assert_array_equal(g, w.numpy())


@pytest.mark.parametrize("executor", ["parallel", "inline"])
def test_a_call_caught_by_its_programs_close_says_the_program_was_closed(small_program_path, executor):
    """A call already past the method's closed check when another thread closes the program finds the model's
    pool emptied: the context it makes then has no modules, and IREE's own answer (NOT_FOUND) said nothing of why."""
    from onecopy import Runtime
    from onecopy.errors import ExecutionError
    from onecopy.runtime.copy_stats import CopyStats

    program = Runtime().load_program(small_program_path, backend_options={"IreeBackend": {"executor": executor}})
    forward = program.load_method("forward")
    x = np.ones((1, 64), np.float32)
    call = forward._delegates[0]._function.copied_call([x], 1)  # the engine call, past the method's checks
    call([x], CopyStats())
    program.close()
    with pytest.raises(ExecutionError, match=r"Method 'forward', delegate 0: the program was closed while this call "
                                             r"of '\w+' ran; load the program again"):
        call([x], CopyStats())  # it made a context without modules and ran it: a segfault, or IREE's NOT_FOUND
