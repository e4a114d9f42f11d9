import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.delegate.shared_models import LoadCoordinator, shared_models
from onecopy.errors import InvalidArgument
from onecopy.export import Partitioner, export_program
from tests.conftest import eager

SHARE = {"IreeBackend": {"share_multifunction_model": True}}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mf_path(small_methods, tmp_path_factory):
    program = export_program(small_methods, partitioner=Partitioner(multifunction=True))
    return program.save(tmp_path_factory.mktemp("shared") / "mf.onecopy")


def models_of(program):
    return [m for name in program.method_names for m in [program.load_method(name)]]


def delegate_models(methods):
    return [d.model for m in methods for d in m._delegates.values()]


# -- the option ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, True, False])
def test_option_parses(mf_path, value):
    options = None if value is None else {"IreeBackend": {"share_multifunction_model": value}}
    with Runtime().load_program(mf_path, backend_options=options) as program:
        methods = models_of(program)
        assert [d.shared for m in methods for d in m._delegates.values()] == [bool(value)] * 2


@pytest.mark.parametrize("value", [1, "true", 0])
def test_option_of_the_wrong_type_is_invalid(mf_path, value):
    with pytest.raises(InvalidArgument, match=f"option 'share_multifunction_model' expects bool, got {type(value).__name__}"):
        Runtime().load_program(mf_path, backend_options={"IreeBackend": {"share_multifunction_model": value}})


def test_option_requires_a_multifunction_export(small_program_path):
    with Runtime().load_program(small_program_path, backend_options=SHARE) as program:
        with pytest.raises(InvalidArgument, match=r"Method 'forward', delegate 0: .*share_multifunction_model=True needs a program exported with Partitioner\(multifunction=True\)"):
            program.load_method("forward")


# -- lifetime and scope ----------------------------------------------------------------------------------------


def test_every_delegate_of_every_program_uses_one_model_until_the_last_goes(mf_path):
    first = Runtime().load_program(mf_path, backend_options=SHARE)
    second = Runtime().load_program(mf_path, backend_options=SHARE)
    models = delegate_models(models_of(first) + models_of(second))
    assert len(models) == 4 and all(m is models[0] for m in models)
    (key,) = [k for k in shared_models.keys() if shared_models.refs(k) == 4]
    first.close()
    assert shared_models.refs(key) == 2
    assert models[0].module is not None  # still loaded for the second program
    second.close()
    assert shared_models.refs(key) == 0 and key not in shared_models.keys()
    assert models[0].module is None  # unloaded with the last delegate


def test_option_off_loads_a_model_per_delegate(mf_path):
    with Runtime().load_program(mf_path) as program:
        a, b = delegate_models(models_of(program))
        assert a is not b


def test_shared_models_are_scoped_to_the_cache_directory(mf_path, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    other = tmp_path / "other"
    programs = [Runtime(cache_dir=d).load_program(mf_path, backend_options=SHARE) for d in (real, alias, other)]
    try:
        on_real, on_alias, on_other = (delegate_models(models_of(p))[0] for p in programs)
        assert on_real is on_alias
        assert on_other is not on_real
    finally:
        for p in programs:
            p.close()


def test_different_compute_units_load_separate_models(mf_path):
    with Runtime().load_program(mf_path, backend_options=SHARE) as cpu, Runtime().load_program(
        mf_path, backend_options={"IreeBackend": {"share_multifunction_model": True, "compute_units": "all"}}
    ) as best:
        assert delegate_models(models_of(cpu))[0] is not delegate_models(models_of(best))[0]


# -- the load coordinator, driven by fakes -----------------------------------------------------------------------


class FakeLoader:
    """Loads on command: each call blocks until released, then returns a model or raises."""

    def __init__(self, fail_calls=()):
        self.calls = 0
        self.started = threading.Semaphore(0)
        self.gate = threading.Event()
        self.fail_calls = set(fail_calls)  # which calls (1-based) raise
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
            n = self.calls
        self.started.release()
        assert self.gate.wait(10)
        if n in self.fail_calls:
            raise RuntimeError(f"load {n} failed")
        return f"model-{n}"


def run_threads(target, count):
    results, errors = [None] * count, [None] * count

    def run(i):
        try:
            results[i] = target()
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results, errors


def join(threads):
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_concurrent_first_loads_acquire_once():
    coordinator = LoadCoordinator()
    loader = FakeLoader()
    threads, results, errors = run_threads(lambda: coordinator.acquire("k", loader), 8)
    assert loader.started.acquire(timeout=5)
    loader.gate.set()
    join(threads)
    assert errors == [None] * 8
    assert loader.calls == 1
    assert sorted(r[1] for r in results) == [False] * 7 + [True]
    assert {r[0] for r in results} == {"model-1"}
    assert coordinator.refs("k") == 8


def test_a_failed_acquisition_leaves_no_entry():
    coordinator = LoadCoordinator()
    loader = FakeLoader(fail_calls={1})
    loader.gate.set()
    with pytest.raises(RuntimeError, match="load 1 failed"):
        coordinator.acquire("k", loader)
    assert coordinator.keys() == [] and coordinator.refs("k") == 0
    assert coordinator.acquire("k", loader) == ("model-2", True)


def test_loads_of_different_models_run_concurrently():
    coordinator = LoadCoordinator()
    slow, fast = FakeLoader(), FakeLoader()
    threads, results, errors = run_threads(lambda: coordinator.acquire("slow", slow), 1)
    assert slow.started.acquire(timeout=5)  # "slow" is loading and blocked...
    fast.gate.set()
    assert coordinator.acquire("fast", fast) == ("model-1", True)  # ...and "fast" did not wait for it
    slow.gate.set()
    join(threads)
    assert results[0] == ("model-1", True)


def test_a_waiter_acquires_after_a_concurrent_load_fails():
    coordinator = LoadCoordinator()
    loader = FakeLoader(fail_calls={1})
    first, _, first_errors = run_threads(lambda: coordinator.acquire("k", loader), 1)
    assert loader.started.acquire(timeout=5)  # the first load is under way; the waiters queue behind it
    waiters, results, errors = run_threads(lambda: coordinator.acquire("k", loader), 3)
    loader.gate.set()
    join(first)
    join(waiters)
    assert str(first_errors[0]) == "load 1 failed"
    assert errors == [None] * 3
    assert loader.calls == 2  # one waiter retried; the others waited for its load
    assert sorted(results) == [("model-2", False), ("model-2", False), ("model-2", True)]
    assert coordinator.refs("k") == 3


def test_a_waiter_whose_own_retry_fails_reports_its_own_error():
    coordinator = LoadCoordinator()
    loader = FakeLoader(fail_calls={1, 2, 3})
    threads, results, errors = run_threads(lambda: coordinator.acquire("k", loader), 3)
    assert loader.started.acquire(timeout=5)
    loader.gate.set()
    join(threads)
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert len({str(e) for e in errors}) == 3  # each reported the failure of the load it ran itself
    assert loader.calls == 3 and coordinator.keys() == []


def test_release_closes_the_model_with_the_last_reference():
    closed = []
    coordinator = LoadCoordinator(closed.append)
    coordinator.acquire("k", lambda: "m")
    coordinator.acquire("k", lambda: "other")
    coordinator.release("k")
    assert closed == []
    coordinator.release("k")
    assert closed == ["m"]


# -- real IREE under load ------------------------------------------------------------------------------------


def test_eight_threads_fifty_runs_each_on_one_shared_model_are_exact(mf_path, small_model):
    rng = np.random.default_rng(7)
    # On IREE's workers, whose callers wait with the GIL released, so calls overlap: on the executor the load
    # measures faster for this tiny model (often the calling thread), a CI run saw all 400 calls one at a time.
    options = {"IreeBackend": {**SHARE["IreeBackend"], "executor": "parallel"}}
    with Runtime().load_program(mf_path, backend_options=options) as program:
        forward, prefill = program.load_method("forward"), program.load_method("prefill")
        cases = []
        for i in range(8):
            method, batch = (forward, 1) if i % 2 == 0 else (prefill, 16)
            x = rng.standard_normal((batch, 64), dtype=np.float32)
            cases.append((method, x, method.execute([x])[0]))
        mismatches = []

        def worker(i):
            method, x, expected = cases[i]
            for _ in range(50):
                (y,) = method.execute([x])
                if not np.array_equal(y, expected):
                    mismatches.append(i)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        join(threads)
        model = delegate_models([forward, prefill])[0]
        assert mismatches == []
        assert 1 < model.contexts_created <= 9  # calls ran side by side, each in a context of its own
        for method, x, expected in cases:
            np.testing.assert_allclose(expected, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


def test_load_run_close_cycles_from_several_threads_never_crash_the_process(mf_path):
    """Shared models are unloaded (and their weights unmapped) by the last release, which may come from any
    thread, right after calls on it. A child process does 60 such cycles; a crash would end it with a signal."""
    result = subprocess.run([sys.executable, "-m", "tests.delegate.shared_stress_child", str(mf_path), "60"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    assert result.stdout.split() == ["ok", "60"]


def test_an_engine_error_on_a_shared_model_names_the_method_that_called(mf_path):
    """A shared model is loaded by the first delegate that asks for it; the errors of another method's calls
    name that method and its delegate, not the one that happened to load the model (they named `forward`'s
    delegate 0 for a failed call of `prefill_0`)."""
    from onecopy.errors import ExecutionError
    from onecopy.runtime.copy_stats import CopyStats

    with Runtime().load_program(mf_path, backend_options=SHARE) as program:
        forward, prefill = program.load_method("forward"), program.load_method("prefill")
        assert forward._delegates[0].model is prefill._delegates[1].model  # one model, loaded for forward
        call = prefill._delegates[1]._function.copied_call([np.ones((16, 64), np.float32)], 1)
        with pytest.raises(ExecutionError) as caught:  # past the method's checks: the engine refuses the shape
            call([np.ones((3, 64), np.float32)], CopyStats())
    assert str(caught.value).startswith("Method 'prefill', delegate 1: the engine failed running 'prefill_0'")
