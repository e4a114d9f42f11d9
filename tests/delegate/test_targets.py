import os

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.delegate import available_compute_units
from onecopy.delegate.targets import TARGETS, check_target_runs_here, host_cpu_target, runtime_driver, select_target
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.export import CompileSpec, export_program
from tests.conftest import eager

OTHER_CPU = "aarch64" if host_cpu_target().name == "x86_64" else "x86_64"


def test_cpu_is_always_available():
    assert "cpu" in available_compute_units()
    assert select_target("cpu", "here") == host_cpu_target()
    assert select_target("all", "here").compute_unit in available_compute_units()


@pytest.mark.skipif("gpu" in available_compute_units(), reason="this machine has a GPU")
def test_missing_compute_unit_lists_what_the_machine_has(small_program_path):
    with pytest.raises(DelegateError, match=r"compute units 'gpu' are not available on this machine; it has cpu\. Pass backend option compute_units='cpu'"):
        with Runtime().load_program(small_program_path, backend_options={"IreeBackend": {"compute_units": "gpu"}}) as p:
            p.load_method("forward")


def test_unknown_compute_units_option_is_invalid(small_program_path):
    with pytest.raises(InvalidArgument, match=r"unknown compute units 'tpu'; expected one of cpu, gpu, all"):
        with Runtime().load_program(small_program_path, backend_options={"IreeBackend": {"compute_units": "tpu"}}) as p:
            p.load_method("forward")


@pytest.fixture(scope="module")
def two_target_program(small_methods):
    return export_program(small_methods, compile_spec=CompileSpec(packaging="vmfb", targets=("x86_64", "aarch64")))


def test_vmfb_carries_one_bundle_per_target_and_parameters_once(two_target_program):
    manifests = [d.manifest for d in two_target_program.definition.delegates]
    assert all(set(m["bundle"]) == {"x86_64", "aarch64"} for m in manifests)
    keys = two_target_program.data.keys()
    assert len([k for k in keys if k.startswith("param/")]) == 6


def test_vmfb_picks_this_machines_bundle(two_target_program, small_model, rng):
    x = rng.standard_normal((16, 64), dtype=np.float32)
    with Runtime().load_program(two_target_program.to_bytes()) as program:
        (y,) = program.load_method("prefill").execute([x])
    np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


def test_vmfb_without_this_machines_target_lists_its_targets(small_methods):
    program = export_program(small_methods, compile_spec=CompileSpec(packaging="vmfb", targets=(OTHER_CPU,)))
    with pytest.raises(DelegateError, match=rf"the program has code for {OTHER_CPU} but this machine runs {host_cpu_target().name}.*re-export with targets including"):
        with Runtime().load_program(program.to_bytes()) as p:
            p.load_method("forward")


def test_aot_code_needing_missing_cpu_features_is_refused(monkeypatch):
    import onecopy.delegate.targets as targets

    monkeypatch.setattr(targets, "_cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(DelegateError, match=r"needs CPU features avx2, fma, bmi2, f16c that this CPU lacks"):
        check_target_runs_here(TARGETS["x86_64"], "here")


@pytest.mark.parametrize("executor, driver", [
    (None, ""), ("auto", ""), ("parallel", "local-task"), ("inline", "local-sync")])
def test_a_cpu_executor_picks_the_driver(executor, driver):
    # "": picked at load from the specialization's calibration (tests/delegate/test_executors.py)
    assert runtime_driver(TARGETS["x86_64"], executor, "here") == driver


@pytest.mark.parametrize("executor", [None, "auto"])
def test_a_gpu_runs_on_its_own_driver(executor):
    assert runtime_driver(TARGETS["vulkan"], executor, "here") == "vulkan"


def test_an_unknown_executor_or_one_on_a_gpu_is_refused():
    with pytest.raises(InvalidArgument, match=r"here: backend option executor='threads' is not one of 'auto', 'parallel', 'inline'"):
        runtime_driver(TARGETS["x86_64"], "threads", "here")
    with pytest.raises(InvalidArgument, match=r"executor='inline' applies to CPU targets only; this delegate runs on vulkan"):
        runtime_driver(TARGETS["vulkan"], "inline", "here")


def test_inline_runs_on_the_calling_thread_with_the_same_results(small_program_path, small_model, rng, tmp_path):
    x = rng.standard_normal((1, 64)).astype(np.float32)
    runtime = Runtime(cache_dir=tmp_path)
    with runtime.load_program(small_program_path) as parallel, runtime.load_program(
            small_program_path, backend_options={"IreeBackend": {"executor": "inline"}}) as inline:
        forward = inline.load_method("forward")
        np.testing.assert_allclose(forward.execute([x])[0], parallel.load_method("forward").execute([x])[0],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(forward.execute([x])[0], eager(small_model, x)[0], rtol=1e-4, atol=1e-5)
        (delegate,) = forward._delegates.values()
        assert delegate.model.driver == "local-sync"
        assert len(list((tmp_path / "v1" / "entries").iterdir())) == 1  # the same code: one cache entry for both


def test_an_unknown_executor_fails_the_load_naming_the_method(small_program_path, tmp_path):
    with Runtime(cache_dir=tmp_path).load_program(
            small_program_path, backend_options={"IreeBackend": {"executor": "fast"}}) as program:
        with pytest.raises(InvalidArgument, match=r"Method 'forward'.*executor='fast' is not one of"):
            program.load_method("forward")


def test_threads_run_on_the_workers_and_contradict_inline():
    assert runtime_driver(TARGETS["x86_64"], None, "here", threads=1) == "local-task"
    assert runtime_driver(TARGETS["x86_64"], "auto", "here", threads=3) == "local-task"
    assert runtime_driver(TARGETS["x86_64"], "parallel", "here", threads=3) == "local-task"
    with pytest.raises(InvalidArgument, match=r"here: backend options threads=2 and executor='inline' contradict"):
        runtime_driver(TARGETS["x86_64"], "inline", "here", threads=2)
    for bad in (0, -1, True):
        with pytest.raises(InvalidArgument, match=r"threads=.* must be a positive int"):
            runtime_driver(TARGETS["x86_64"], None, "here", threads=bad)
    with pytest.raises(InvalidArgument, match=r"threads applies to CPU targets only; this delegate runs on vulkan"):
        runtime_driver(TARGETS["vulkan"], None, "here", threads=2)


THREADS_PROBE = """
import json, os, sys, time
import numpy as np
from onecopy import Runtime
with Runtime(cache_dir=sys.argv[2]).load_program(sys.argv[1], backend_options={"IreeBackend": {"threads": 1}}) as p:
    forward = p.load_method("forward")
    y = forward.execute([np.ones(forward.method_meta.inputs[0].shape, np.float32)])[0]
    (delegate,) = forward._delegates.values()
    time.sleep(0.2)  # the workers name themselves as they start
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print(json.dumps({"driver": delegate.model.driver, "workers": [n for n in names if n.startswith("iree-worker")],
                      "sum": float(y.sum())}))
"""


def test_threads_start_that_many_task_workers(small_program_path, small_model, tmp_path):
    import json
    import subprocess
    import sys

    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as warm:  # specialized (and timed) here
        warm.load_method("forward")
    done = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(small_program_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "ONECOPY_FORBID_SPECIALIZE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["driver"] == "local-task" and seen["workers"] == ["iree-worker-0"]  # one worker, not one per core
    want = eager(small_model, np.ones((1, 64), np.float32))[0]
    assert abs(seen["sum"] - float(want.sum())) < 1e-3 * max(1.0, abs(float(want.sum())))
