"""Executor calibration: each function timed on IREE's workers and on the calling thread at specialization, the
faster one picked at every load (backend option executor="auto", the default), the user's choice kept."""

import itertools
import json
import time

import numpy as np
import pytest

import onecopy.delegate.executors as executors
from onecopy import Runtime
from onecopy.cli import main as cli
from onecopy.delegate.cpus import worker_count
from onecopy.delegate.executors import EXECUTORS, calibrate, choose
from onecopy.delegate.manifest import STATE_FUNCTIONS
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, Partitioner, export_program
from tests.conftest import accumulator_methods


def record(**ratios: float) -> dict:
    """A calibration record where each function takes 1 ms on the workers and `ratio` ms inline."""
    return {"functions": {f: {"parallel_ms": 1.0, "inline_ms": r} for f, r in ratios.items()}}


def test_each_function_gets_the_executor_with_the_lower_mean():
    timed = record(decode=0.5, prefill=1.4)
    assert choose(timed, ["decode"]) == "inline"
    assert choose(timed, ["prefill"]) == "parallel"


def test_one_model_serving_several_functions_weighs_each_alike():
    # geometric mean: 0.5 x 1.4 -> 0.84 (inline), whatever the functions' absolute times
    assert choose(record(decode=0.5, prefill=1.4), ["decode", "prefill"]) == "inline"
    assert choose(record(decode=0.8, prefill=1.6), ["decode", "prefill"]) == "parallel"


def test_figures_measured_with_another_number_of_workers_decide_nothing():
    timed = {**record(decode=0.5), "workers": 4}
    assert choose(timed, ["decode"], workers=4) == "inline"
    assert choose(timed, ["decode"], workers=2) is None
    assert choose(record(decode=0.5), ["decode"], workers=2) == "inline"  # a record that does not say


@pytest.mark.parametrize("timed, functions", [
    (None, ["f"]), ({}, ["f"]), ({"functions": {}}, ["f"]), (record(g=0.5), ["f"]), (record(f=0.5), []),
    ({"functions": {"f": {"parallel_ms": 0.0, "inline_ms": 1.0}}}, ["f"]),
    ({"functions": {"f": {"parallel_ms": "x", "inline_ms": 1.0}}}, ["f"]),
])
def test_a_record_that_does_not_cover_the_functions_decides_nothing(timed, functions):
    assert choose(timed, functions) is None


def test_calibrate_times_every_function_on_both_executors_interleaved():
    costs = {("parallel", "a"): 0.006, ("inline", "a"): 0.001, ("parallel", "b"): 0.001, ("inline", "b"): 0.006}
    calls = []

    def run(executor, function):
        calls.append((executor, function))
        time.sleep(costs[executor, function])

    timed = calibrate(run, ["a", "b"], budget_s=0.0)
    assert timed["rounds"] == 5  # the minimum, the budget being spent
    assert {(e, f) for e, f in calls} == set(costs)
    assert calls[-3 * 2:] != calls[:6]  # the order of executors alternates between rounds
    a, b = timed["functions"]["a"], timed["functions"]["b"]
    assert a["inline_ms"] < a["parallel_ms"] and b["inline_ms"] > b["parallel_ms"]
    assert a["parallel_p90_ms"] >= a["parallel_p50_ms"] >= 6.0  # a sleep never ends early
    assert choose(timed, ["a"]) == "inline" and choose(timed, ["b"]) == "parallel"


def drivers(program, *names):
    return {name: d.model.driver for name in names for d in program.load_method(name)._delegates.values()}


@pytest.fixture
def fake_calibration(monkeypatch):
    """Calibration returns `timed` instead of timing (the figures of a machine where they are known)."""
    timed: dict = {}

    def fake(load, calls, budget_s, where):
        for executor in EXECUTORS:
            load(executor).close()  # the real models are made and closed as they are when timed
        made = {"functions": {f: dict(timed[f]) for f in calls if f in timed},
                "caller_wait": executors.caller_wait_mode()}
        return {**made, "workers": timed["workers"]} if "workers" in timed else made

    monkeypatch.setattr("onecopy.delegate.specialize.calibrate_models", fake)
    return timed


@pytest.fixture(scope="module")
def multifunction_path(builtin, tmp_path_factory):
    """The built-in model's forward and prefill as functions forward_0 and prefill_0 of one module."""
    from onecopy.models import builtin_methods

    return export_program(builtin_methods(builtin), partitioner=Partitioner(multifunction=True)).save(
        tmp_path_factory.mktemp("executors") / "b.onecopy")


def test_a_load_runs_each_function_on_the_executor_its_calibration_picked(multifunction_path, tmp_path,
                                                                         fake_calibration):
    fake_calibration.update({"forward_0": {"parallel_ms": 1.0, "inline_ms": 0.9},
                             "prefill_0": {"parallel_ms": 1.0, "inline_ms": 1.2}})
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path) as program:
        assert drivers(program, "forward", "prefill") == {"forward": "local-sync", "prefill": "local-task"}
    # Explicit options win over the figures; every load uses the one entry made above.
    for option, driver in (("parallel", "local-task"), ("inline", "local-sync")):
        with Runtime(cache_dir=tmp_path).load_program(
                multifunction_path, backend_options={"IreeBackend": {"executor": option}}) as program:
            assert drivers(program, "forward", "prefill") == {"forward": driver, "prefill": driver}
    assert len(list((tmp_path / "v1" / "entries").iterdir())) == 1


def test_a_shared_model_runs_each_function_on_its_own_executor_over_one_copy_of_the_code_and_weights(
        multifunction_path, tmp_path, fake_calibration, rng):
    fake_calibration.update({"forward_0": {"parallel_ms": 1.0, "inline_ms": 0.5},
                             "prefill_0": {"parallel_ms": 1.0, "inline_ms": 1.4}})
    options = {"IreeBackend": {"share_multifunction_model": True}}
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path, backend_options=options) as program, \
            Runtime(cache_dir=tmp_path).load_program(multifunction_path) as unshared:
        assert drivers(program, "forward", "prefill") == {"forward": "local-sync", "prefill": "local-task"}
        assert drivers(unshared, "forward", "prefill") == {"forward": "local-sync", "prefill": "local-task"}
        (forward,) = program.load_method("forward")._delegates.values()
        (prefill,) = program.load_method("prefill")._delegates.values()
        # Two executors, so two engine models; they hold the same bytes (the program's mapped weights, the cache
        # entry's module and packed weights), and only the first holds the cache entry.
        assert forward.model is not prefill.model
        twin, first = sorted([forward.model, prefill.model], key=lambda m: m._keepalive is not None)
        assert twin._keepalive is None and first._keepalive is not None
        assert twin._vmfb is first._vmfb and twin._parameters is first._parameters and twin._encoded is first._encoded
        for name, batch in (("forward", 1), ("prefill", 16)):
            x = rng.standard_normal((batch, 1024), dtype=np.float32)
            (want,) = unshared.load_method(name).execute([x])
            (got,) = program.load_method(name).execute([x])
            np.testing.assert_array_equal(got, want)
        assert "local-sync" in " ".join(program.load_method("forward").runs_on.values())
        assert "local-task" in " ".join(program.load_method("prefill").runs_on.values())
    # Both functions on one executor: one engine model, as before.
    fake_calibration.update({"prefill_0": {"parallel_ms": 1.0, "inline_ms": 0.9}})
    with Runtime(cache_dir=tmp_path / "again").load_program(multifunction_path, backend_options=options) as program:
        (forward,) = program.load_method("forward")._delegates.values()
        (prefill,) = program.load_method("prefill")._delegates.values()
        assert forward.model is prefill.model and forward.model.driver == "local-sync"


def test_figures_of_another_cpu_quota_are_not_used(small_program_path, tmp_path, fake_calibration):
    fake_calibration.update({"main": {"parallel_ms": 1.0, "inline_ms": 0.5}, "workers": worker_count() + 1})
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        assert drivers(program, "forward") == {"forward": "local-task"}


def test_without_figures_a_load_runs_on_the_workers(small_program_path, tmp_path, fake_calibration):
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        assert drivers(program, "forward") == {"forward": "local-task"}


def test_the_figures_are_measured_once_and_restored_with_the_entry(small_program_path, tmp_path, monkeypatch):
    started = time.perf_counter()
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        picked = drivers(program, "forward")
    cold = time.perf_counter() - started
    (entry,) = (tmp_path / "v1" / "entries").iterdir()
    timed = json.loads((entry / "entry.json").read_text())["executors"]
    (function,) = timed["functions"]  # the module's one public function
    figures = timed["functions"][function]
    assert all(figures[f"{e}_{q}ms"] > 0 for e in EXECUTORS for q in ("", "p50_", "p90_"))  # mean, p50, p90 (ms)
    assert timed["rounds"] >= 5 and timed["elapsed_s"] < cold
    assert timed["workers"] == worker_count()
    chosen = {"inline": "local-sync", "parallel": "local-task"}[choose(timed, [function])]
    assert picked == {"forward": chosen}

    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # a restore: no compile, no timing
    monkeypatch.setattr(executors, "calibrate", lambda *a, **k: pytest.fail("a restore calibrated again"))
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        assert drivers(program, "forward") == {"forward": chosen}


def test_without_a_cache_the_figures_of_this_load_pick(small_program_path, monkeypatch, fake_calibration):
    monkeypatch.setenv("ONECOPY_DISABLE_CACHE", "1")
    fake_calibration["main"] = {"parallel_ms": 1.0, "inline_ms": 0.5}  # a module of one method: its `main`
    with Runtime().load_program(small_program_path) as program:
        assert drivers(program, "forward") == {"forward": "local-sync"}


@pytest.mark.parametrize("packaging", ["mlir", "vmfb"])
def test_a_module_with_state_is_timed_with_its_state_served(accumulator, tmp_path, monkeypatch, rng, packaging):
    """Its methods run in the pool's contexts while timed (state served as zeros); the state functions are not
    timed; every State then runs on the one executor picked for the methods together."""
    path = export_program(accumulator_methods(accumulator), compile_spec=CompileSpec(packaging=packaging),
                          partitioner=Partitioner(multifunction=True)).save(tmp_path / "acc.onecopy")
    seen = {}
    real = executors.calibrate

    def spy(run, functions, budget_s):
        seen["functions"] = list(functions)
        return real(run, functions, budget_s)

    monkeypatch.setattr(executors, "calibrate", spy)
    xs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(3)]
    results = {}
    for option in ("auto", "parallel", "inline"):
        with Runtime(cache_dir=tmp_path / "cache").load_program(
                path, backend_options={"IreeBackend": {"executor": option}}) as program:
            decode, state = program.load_method("decode"), program.create_state()
            results[option] = [decode.execute([x, np.array([i])], state=state)[0] for i, x in enumerate(xs)]
            (delegate,) = decode._delegates.values()
            if option == "auto":
                timed = json.loads(next((tmp_path / "cache" / "v1" / "entries").iterdir()).joinpath(
                    "entry.json").read_text())["executors"]
                functions = sorted(timed["functions"])
                picked = choose(timed, functions)
                assert delegate.model.driver == {"inline": "local-sync", "parallel": "local-task"}[picked]
    assert sorted(seen["functions"]) == functions == ["decode_0", "prefill_0"]
    assert not set(functions) & set(STATE_FUNCTIONS)
    for option in ("parallel", "inline"):
        for got, want in zip(results[option], results["auto"]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_module_with_state_runs_every_function_on_one_executor_even_where_they_disagree(
        accumulator, tmp_path, fake_calibration, rng):
    """A State is VM contexts on one device: prefill and decode must both run in them."""
    path = export_program(accumulator_methods(accumulator), partitioner=Partitioner(multifunction=True)).save(
        tmp_path / "acc.onecopy")
    fake_calibration.update({"prefill_0": {"parallel_ms": 1.0, "inline_ms": 1.5},
                             "decode_0": {"parallel_ms": 1.0, "inline_ms": 0.5}})
    with Runtime(cache_dir=tmp_path / "cache").load_program(path) as program:
        prefill, decode = program.load_method("prefill"), program.load_method("decode")
        ((_, p),), ((_, d),) = prefill._delegates.items(), decode._delegates.items()
        assert p.model is d.model and p.model.driver == "local-sync"  # geometric mean 0.87: the calling thread
        state = program.create_state()
        prefill.execute([rng.standard_normal((2, 16), dtype=np.float32), np.array([0, 1])], state=state)
        decode.execute([rng.standard_normal((1, 16), dtype=np.float32), np.array([2])], state=state)


def test_inspect_shows_each_function_on_both_executors(small_program_path, tmp_path, capsys):
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        program.load_method("forward")
    assert cli(["inspect", str(small_program_path), "--cache-dir", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "executors (mean latency, the faster): main parallel " in shown
    assert " / inline " in shown and ("(inline; medians " in shown or "(parallel; medians " in shown)
    old = {"functions": {"main": {"parallel_ms": 1.0, "inline_ms": 0.5}}}  # a record made before medians were kept
    assert executors.describe(old) == "main parallel 1.000 / inline 0.500 ms (inline)"
    busy = {**old, "other_cpu": 0.75, "busy_retimes": 2}
    assert executors.describe(busy) == ("main parallel 1.000 / inline 0.500 ms (inline); other processes and threads "
                                        "used 0.75 cores meanwhile (timed again by 2 of at most 3 loads, earlier "
                                        "figures having been taken on a busy machine)")


def test_a_vmfb_program_is_timed_from_the_signatures_its_manifest_carries(small_vmfb_program, tmp_path):
    """vmfb code carries no MLIR: export records each function's signature in the manifest, and the load that runs
    its parameter encoder (once per machine) times its functions on both executors from them."""
    path = small_vmfb_program.save(tmp_path / "small_vmfb.onecopy")
    manifest = json.loads(json.dumps(small_vmfb_program.definition.delegates[0].manifest))  # as the file holds it
    assert manifest["signatures"]["main"] == {"arguments": [[[1, 64], "float32"]], "results": 1}
    with Runtime(cache_dir=tmp_path / "cache").load_program(path) as program:
        picked = drivers(program, "forward")
    entry = next(p for p in (tmp_path / "cache" / "v1" / "entries").iterdir()
                 if "main" in json.loads((p / "entry.json").read_text()).get("executors", {}).get("functions", {}))
    timed = json.loads((entry / "entry.json").read_text())["executors"]
    assert {"parallel_ms", "inline_ms"} <= set(timed["functions"]["main"])
    assert picked == {"forward": {"inline": "local-sync", "parallel": "local-task"}[choose(timed, ["main"])]}


def test_a_method_says_what_runs_it(small_program_path, tmp_path):
    runtime = Runtime(cache_dir=tmp_path)
    for options, said in (({"executor": "inline"}, "IREE local-sync (the calling thread)"),
                          ({"executor": "parallel"}, "IREE local-task (IREE's task workers)"),
                          ({"threads": 1}, "IREE local-task (IREE's task workers, 1 of them)")):
        with runtime.load_program(small_program_path, backend_options={"IreeBackend": options}) as program:
            forward = program.load_method("forward")
            assert forward.runs_on == {0: said}
            assert forward.devices == {0: said.split()[1]}  # the device alone, for a table column
    with runtime.load_program(small_program_path) as program:  # auto: one of the two, as its figures say
        (said,) = program.load_method("forward").runs_on.values()
        assert said.startswith(("IREE local-sync", "IREE local-task"))


def test_measuring_again_replaces_the_functions_timed_and_keeps_the_others():
    old = {**record(forward=0.5, prefill=1.4), "workers": 2, "rounds": 5}
    new = {**record(forward=1.3), "workers": 2, "rounds": 200}
    merged = executors.merge(old, new)
    assert merged["functions"] == {**record(forward=1.3, prefill=1.4)["functions"]}
    assert merged["rounds"] == 200 and merged["workers"] == 2
    assert executors.merge(old, {**new, "workers": 4}) == {**new, "workers": 4}  # another CPU quota: new alone
    assert executors.merge(None, new) == new
    untimed = {"functions": {}, "note": "not calibrated: ..."}
    assert executors.merge(old, untimed) == untimed


def entry_executors(cache_dir) -> dict:
    (entry,) = (cache_dir / "v1" / "entries").iterdir()
    return json.loads((entry / "entry.json").read_text())["executors"]


def test_recalibrate_measures_a_restored_entry_again_and_keeps_the_new_choice(multifunction_path, tmp_path,
                                                                             fake_calibration, monkeypatch):
    """A choice first made on a busy machine: backend option recalibrate=True times the functions each load serves
    again (no compile), the entry keeps the new figures of both methods' loads, and later loads follow them."""
    fake_calibration.update({"forward_0": {"parallel_ms": 1.0, "inline_ms": 0.9},
                             "prefill_0": {"parallel_ms": 1.0, "inline_ms": 0.8}})
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path) as program:
        assert drivers(program, "forward", "prefill") == {"forward": "local-sync", "prefill": "local-sync"}
    fake_calibration.update({"forward_0": {"parallel_ms": 1.0, "inline_ms": 1.5},
                             "prefill_0": {"parallel_ms": 1.0, "inline_ms": 1.2}})
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # the entry is restored, never compiled again
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path) as program:  # figures as they were
        assert drivers(program, "forward", "prefill") == {"forward": "local-sync", "prefill": "local-sync"}
    options = {"IreeBackend": {"recalibrate": True}}
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path, backend_options=options) as program:
        assert drivers(program, "forward") == {"forward": "local-task"}
        # forward's load measured forward alone: the entry holds its new figure beside prefill's old one
        assert entry_executors(tmp_path)["functions"]["prefill_0"]["inline_ms"] == 0.8
        assert drivers(program, "prefill") == {"prefill": "local-task"}
    assert entry_executors(tmp_path)["functions"] == {f: fake_calibration[f] for f in ("forward_0", "prefill_0")}
    with Runtime(cache_dir=tmp_path).load_program(multifunction_path) as program:
        assert drivers(program, "forward", "prefill") == {"forward": "local-task", "prefill": "local-task"}
    assert [p.name for p in (tmp_path / "v1" / "tmp").iterdir()] == []  # the rewrite left nothing behind


def test_recalibrate_times_a_real_module_again(small_program_path, tmp_path, monkeypatch):
    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        program.load_method("forward")
    first = entry_executors(tmp_path)
    assert first["rounds"] >= 5 and first["other_cpu"] >= 0 and first["measured"] <= time.time()
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")
    with Runtime(cache_dir=tmp_path).load_program(
            small_program_path, backend_options={"IreeBackend": {"recalibrate": True}}) as program:
        picked = drivers(program, "forward")
    again = entry_executors(tmp_path)
    assert again["measured"] >= first["measured"] and again["functions"] != first["functions"]  # timed anew
    assert picked == {"forward": {"inline": "local-sync", "parallel": "local-task"}[choose(again, ["main"])]}


@pytest.mark.parametrize("options", [{"executor": "inline"}, {"executor": "parallel"}, {"threads": 1}])
def test_recalibrate_with_a_named_executor_is_refused(small_program_path, tmp_path, options):
    with pytest.raises(InvalidArgument, match="recalibrate=True measures which CPU executor.*names one"):
        Runtime(cache_dir=tmp_path).load_program(
            small_program_path, backend_options={"IreeBackend": {"recalibrate": True, **options}}).load_method("forward")


def test_cache_recalibrate_cli(multifunction_path, tmp_path, capsys, fake_calibration):
    fake_calibration.update({"forward_0": {"parallel_ms": 1.0, "inline_ms": 0.9},
                             "prefill_0": {"parallel_ms": 1.0, "inline_ms": 1.2}})
    assert cli(["cache", "recalibrate", str(multifunction_path), "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "forward: IREE local-sync (the calling thread)" in out
    assert "prefill: IREE local-task (IREE's task workers)" in out
    assert cli(["cache", "recalibrate", "--cache-dir", str(tmp_path)]) == 2
    assert "needs the program file" in capsys.readouterr().err


def test_figures_of_another_caller_wait_are_stale(monkeypatch):
    """A record made before the caller's batch wait (none named: "normal"), or with it turned off, times the
    workers as they no longer run: stale, for the functions it timed so, and only with as many workers."""
    monkeypatch.setattr(executors.caller_wait, "_enabled", True)
    figures = {"parallel_ms": 1.0, "inline_ms": 0.9}
    old = {"functions": {"f": figures, "g": figures}, "workers": 2}
    assert executors.stale(old, ["f"], 2) and not executors.stale(old, ["h"], 2)  # h: never timed
    assert not executors.stale(old, ["f"], 4)  # another number of workers: not used at all
    assert not executors.stale(None, ["f"], 2) and not executors.stale({"functions": {}}, ["f"], 2)
    new = {"functions": {"f": figures}, "workers": 2, "caller_wait": "batch"}
    assert not executors.stale(new, ["f"], 2)
    merged = executors.merge(old, new)  # f timed again; g's figures kept, saying how they were timed
    assert merged["functions"]["g"]["caller_wait"] == "normal" and "caller_wait" not in merged["functions"]["f"]
    assert not executors.stale(merged, ["f"], 2) and executors.stale(merged, ["g"], 2)
    assert executors.merge(merged, {**new, "functions": {"g": figures}})["functions"] == {"f": figures, "g": figures}
    monkeypatch.setattr(executors.caller_wait, "_enabled", False)  # ONECOPY_CALLER_WAIT=normal
    assert executors.stale(new, ["f"], 2) and not executors.stale(old, ["f"], 2)


def test_a_restored_entry_timed_with_another_caller_wait_is_timed_again_once(small_program_path, tmp_path,
                                                                            monkeypatch, caplog):
    import logging

    with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
        program.load_method("forward")
    (entry,) = (tmp_path / "v1" / "entries").iterdir()
    meta = json.loads((entry / "entry.json").read_text())
    assert meta["executors"]["caller_wait"] == executors.caller_wait_mode()
    other = "normal" if executors.caller_wait_mode() == "batch" else "batch"
    timed = {**meta["executors"], "caller_wait": other, "measured": 1}  # as made before the batch wait
    (entry / "entry.json").write_text(json.dumps({**meta, "executors": timed}))
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # restored, never compiled again
    with caplog.at_level(logging.INFO, logger="onecopy"):  # an executor named: nothing to choose, nothing timed
        with Runtime(cache_dir=tmp_path).load_program(
                small_program_path, backend_options={"IreeBackend": {"executor": "parallel"}}) as program:
            program.load_method("forward")
    assert entry_executors(tmp_path) == timed and not any("timing them again" in r.message for r in caplog.records)
    for load in range(2):
        with caplog.at_level(logging.INFO, logger="onecopy"):
            with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
                picked = drivers(program, "forward")
        again = entry_executors(tmp_path)
        timing_again = [r for r in caplog.records if "timing them again" in r.message]
        assert len(timing_again) == (1 if load == 0 else 0)
        assert again["caller_wait"] == executors.caller_wait_mode() and again["measured"] > 1
        assert picked == {"forward": {"inline": "local-sync", "parallel": "local-task"}[choose(again, ["main"])]}
        caplog.clear()


def test_measured_busy_reads_the_others_share_and_the_retimes():
    figures = {"parallel_ms": 1.0, "inline_ms": 0.9}
    busy = {"functions": {"f": figures}, "workers": 2, "other_cpu": 0.8}
    assert executors.measured_busy(busy, 2)
    assert not executors.measured_busy({**busy, "other_cpu": 0.3}, 2)
    assert not executors.measured_busy({**busy, "busy_retimes": executors.BUSY_RETIMES}, 2)
    assert executors.measured_busy({**busy, "busy_retimes": executors.BUSY_RETIMES - 1}, 2)
    assert not executors.measured_busy(busy, 4)  # another number of workers: not used at all
    assert not executors.measured_busy({**busy, "functions": {}}, 2) and not executors.measured_busy(None, 2)
    assert not executors.measured_busy({"functions": {"f": figures}, "workers": 2}, 2)  # a record that says nothing


def _busy_entry(small_program_path, cache_dir, monkeypatch):
    """A cache entry for the small program whose executor figures say others took 1.5 cores meanwhile."""
    with Runtime(cache_dir=cache_dir).load_program(small_program_path) as program:
        program.load_method("forward")
    (entry,) = (cache_dir / "v1" / "entries").iterdir()
    meta = json.loads((entry / "entry.json").read_text())
    (entry / "entry.json").write_text(json.dumps({**meta, "executors": {**meta["executors"], "other_cpu": 1.5}}))
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # restored, never compiled again


def _timed_again(small_program_path, cache_dir, caplog) -> int:
    import logging

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="onecopy"):
        with Runtime(cache_dir=cache_dir).load_program(small_program_path) as program:
            program.load_method("forward")
    return sum("timed while other processes or threads took" in r.message for r in caplog.records)


def test_figures_timed_on_a_busy_machine_are_timed_again_until_quiet(small_program_path, tmp_path, monkeypatch,
                                                                       caplog):
    _busy_entry(small_program_path, tmp_path, monkeypatch)
    monkeypatch.setattr(executors, "_machine_busy_s", lambda: 0.0)  # nobody else runs while it times again
    assert _timed_again(small_program_path, tmp_path, caplog) == 1
    record = entry_executors(tmp_path)
    assert record["other_cpu"] == 0 and record["busy_retimes"] == 1
    assert _timed_again(small_program_path, tmp_path, caplog) == 0  # quiet figures now: kept


def test_a_machine_that_stays_busy_times_them_again_at_most_busy_retimes_times(small_program_path, tmp_path,
                                                                               monkeypatch, caplog):
    _busy_entry(small_program_path, tmp_path, monkeypatch)
    clock = itertools.count(0.0, 100.0)  # others take 100 core-seconds between two reads: always busy
    monkeypatch.setattr(executors, "_machine_busy_s", lambda: next(clock))
    for load in range(executors.BUSY_RETIMES + 1):
        assert _timed_again(small_program_path, tmp_path, caplog) == (1 if load < executors.BUSY_RETIMES else 0)
        assert entry_executors(tmp_path)["busy_retimes"] == min(load + 1, executors.BUSY_RETIMES)


def test_a_thread_of_this_process_that_takes_a_core_makes_the_figures_busy(small_program_path, tmp_path, monkeypatch):
    """Calibration competes for the cores with the process's other threads (an application's, another engine's
    pool) as with other processes: they count in `other_cpu`, and the next restore times the figures again."""
    import hashlib
    import threading

    monkeypatch.undo()  # the real readings of /proc, not the quiet machine of tests/conftest.py
    if executors._machine_busy_s() is None:
        pytest.skip("no /proc/stat on this system: calibration records no other_cpu here")
    stop = threading.Event()
    data = bytes(1 << 22)

    def hash_until_stopped() -> None:  # sha256 of 4 MiB releases the GIL: a core taken, the caller not blocked
        while not stop.is_set():
            hashlib.sha256(data).digest()

    busy = [threading.Thread(target=hash_until_stopped) for _ in range(2)]  # a core's worth beside the workers
    for thread in busy:
        thread.start()
    try:
        with Runtime(cache_dir=tmp_path).load_program(small_program_path) as program:
            program.load_method("forward")
    finally:
        stop.set()
        for thread in busy:
            thread.join()
    record = entry_executors(tmp_path)
    assert record["other_cpu"] >= executors.BUSY_CORES, record  # about a core: the hashing threads'
    assert executors.measured_busy(record, record["workers"])
    assert executors._foreign_threads_s(threading.get_native_id()) >= 0.0


def test_the_machines_busy_time_counts_this_process_too(monkeypatch):
    monkeypatch.undo()  # the real /proc/stat reading, not the quiet machine of tests/conftest.py
    before = executors._machine_busy_s()
    if before is None:
        pytest.skip("no /proc/stat on this system: calibration records no other_cpu here")
    spin = time.process_time() + 0.3
    while time.process_time() < spin:
        pass
    assert executors._machine_busy_s() - before >= 0.2  # our own 0.3 s of CPU, as every core's busy time reads it
