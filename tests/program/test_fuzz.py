"""Damaged and foreign files, seeded: each is refused with a onecopy error, or loads; and a loaded one's methods
load and run, or fail with a onecopy error. Never a foreign exception (IndexError, BufferError, ValueError…)."""

from __future__ import annotations

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.errors import OnecopyError
from onecopy.program import read_program
from onecopy.runtime import verify_program
from onecopy.runtime.method_meta import MethodMeta
from tests.program import fuzzing

SEED = 16  # issue #16


def _arrays(metas, storage: bool) -> list | None:
    """Zeros of each tensor's shape (a symbol taken as 1), or None where too big to bother; for outputs
    (`storage`), None where the runtime allocates."""
    arrays = []
    for meta in metas:
        if storage and meta.memory_planned:
            arrays.append(None)
            continue
        shape = [d if isinstance(d, int) else 1 for d in meta.shape]
        if np.prod(shape, dtype=np.float64) > 2**20:
            return None
        arrays.append(np.zeros(shape, meta.dtype))
    return arrays


def _run_methods(runtime: Runtime, source) -> int:
    """How many methods ran to their results."""
    executed = 0
    with runtime.load_program(source) as program:
        for name in program.method_names:
            try:
                method = program.load_method(name)
                meta: MethodMeta = method.method_meta
                inputs, outputs = _arrays(meta.inputs, False), _arrays(meta.outputs, True)
                if inputs is not None and outputs is not None:
                    method.execute(inputs, outputs=outputs)
                    executed += 1
            except OnecopyError:
                pass
    return executed


def check(source, runtime: Runtime | None = None, executed: list[int] | None = None) -> tuple[str, str | None]:
    """('rejected' | 'loaded', None), or ('foreign', what was raised): read, verify and, given a runtime, load every
    method and run it on zeros (adding to `executed[0]` the methods that ran)."""
    step = "read_program"
    try:
        try:
            read_program(source).close()
        except OnecopyError:
            return "rejected", None
        step = "verify_program"
        verify_program(source)
        if runtime is not None:
            step = "load_method/execute"
            try:
                ran = _run_methods(runtime, source)
            except OnecopyError:
                ran = 0
            if executed is not None:
                executed[0] += ran
    except Exception as e:  # what this test is for: anything not a onecopy error
        return "foreign", f"{step}: {type(e).__name__}: {str(e)[:200]}"
    return "loaded", None


@pytest.fixture(scope="module")
def whole(small_program) -> bytes:
    return small_program.to_bytes()


@pytest.fixture
def restored_only(whole, monkeypatch):
    """A runtime whose loads of the whole program's delegates restore from the cache, and for which anything else
    a mutant would make it compile is an error (a DelegateError, fast) rather than seconds of compiling."""
    runtime = Runtime()
    _run_methods(runtime, whole)
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")
    return runtime


def test_damaged_and_foreign_files_raise_onecopy_errors_or_load(whole, tmp_path):
    rng = np.random.default_rng(SEED)
    header_end, data_offset = fuzzing.layout(whole)
    in_memory = [
        *fuzzing.structured(whole, rng, 200),
        *fuzzing.byte_flips(whole, rng, 120, 0, header_end),
        *fuzzing.byte_flips(whole, rng, 30, data_offset, len(whole)),
        *fuzzing.foreign(whole, rng, 30),
    ]
    # Cuts are read from files: a mapping is what a failed parse must release.
    cuts = list(fuzzing.truncations(whole, rng, 60))
    outcomes: dict[str, int] = {}
    failures = []
    for name, data in in_memory:
        outcome, failure = check(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if failure:
            failures.append(f"{name}: {failure}")
    for name, data in cuts:
        path = tmp_path / f"{name}.onecopy"
        path.write_bytes(data)
        outcome, failure = check(path)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if failure:
            failures.append(f"{name}: {failure}")
    assert not failures, "\n".join(failures[:20])
    # The cases reach both sides: the checks refuse many, and many load (a valid value, or data bytes).
    assert outcomes["rejected"] > 250 and outcomes["loaded"] > 80, outcomes
    assert sum(outcomes.values()) >= 400


def test_loaded_mutants_run_or_fail_with_onecopy_errors(whole, restored_only):
    rng = np.random.default_rng(SEED + 1)
    _, data_offset = fuzzing.layout(whole)
    candidates = [*fuzzing.structured(whole, rng, 150), *fuzzing.byte_flips(whole, rng, 10, data_offset, len(whole))]
    ran, failures, executed = 0, [], [0]
    for name, data in candidates:
        outcome, failure = check(data)
        if outcome != "loaded":
            continue
        outcome, failure = check(data, restored_only, executed)
        ran += 1
        if failure:
            failures.append(f"{name}: {failure}")
        if ran == 60:
            break
    assert not failures, "\n".join(failures[:20])
    assert ran == 60
    assert executed[0] > 30  # many mutants (a changed name, a wider range, flipped weights) still run


def test_the_harness_catches_a_foreign_error(whole, restored_only, monkeypatch):
    # Without the structural checks, the call of delegate 7 of the program's 2 reached the runtime, which raised
    # IndexError: the harness must report it, or it could never fail.
    from onecopy.program import file

    damaged = fuzzing.with_field(whole, ("methods", 0, "instructions", 0, "delegate"), 7)
    assert check(damaged, restored_only) == ("rejected", None)
    monkeypatch.setattr(file, "structure_problems", lambda definition, **layout: [])
    outcome, failure = check(damaged, restored_only)
    assert outcome == "foreign" and failure.startswith("load_method/execute: IndexError: "), failure
