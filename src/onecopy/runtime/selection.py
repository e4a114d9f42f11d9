"""Which delegate runs a method that has alternatives (`load_program(prefer=...)`), chosen once per machine.

- prefer="memory" (default): the method's own instructions (IREE), which keep one copy of the weights in memory;
  its alternatives are never loaded.
- prefer="latency": at the first load on this machine, the method's IREE delegate and each alternative (an
  OpenVINO delegate) run on random inputs of the method's shapes, interleaved, for about a second; an alternative
  whose outputs differ from IREE's, on those inputs or on their mirror (negated), is not kept: in shape or dtype,
  integers and flags in any value, floats beyond the precision's tolerance (fp32: 1e-4 of the outputs' scale;
  bf16, where both engines compute on bf16 inputs and round differently: 3e-2). Integer inputs vary only within
  the bounds the program records for them, and are zeros without (`agreement.random_inputs`: the engine checks no index, so
  an integer input is never given a value that might be out of range). The fastest is recorded in
  `<cache dir>/choices/<key>.json` (key: the delegates' export hashes, the method, this CPU and the engines'
  versions) with every timing and what each load added to memory, so later loads read it and time nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.errors import ProgramFormatError
from onecopy.program import DelegateCall, MethodDef, ProgramDef
from onecopy.runtime.agreement import TOLERANCES, difference, mirrored, random_inputs
from onecopy.runtime.backend import DelegateHandle, delegate_summary, get_backend
from onecopy.runtime.method_meta import Choice, MethodMeta, TensorMeta

__all__ = ["PREFERENCES", "Choice", "choice_key", "read_choice", "write_choice", "time_delegates", "memory_mb",
           "choices_dir", "selections_timed", "choose_and_load"]

log = logging.getLogger("onecopy")

PREFERENCES = ("memory", "latency")
CHOICE_FORMAT = 1
# Rounds of one call each, interleaved, order alternating: at least MIN_RUNS, then more until TIMING_BUDGET_S is
# spent (MAX_RUNS at most). Seven rounds alone (what this was) told MobileNetV3-small's delegates apart by chance:
# they differ by 7% (2.2 vs 2.4 ms) and the load picked the slower one (benchmarks/vision.py at 1024d64).
MIN_RUNS, MAX_RUNS = 7, 200
TIMING_BUDGET_S = 1.0
_timed = 0  # selections that timed delegates in this process (a cache hit times nothing)


def selections_timed() -> int:
    return _timed


def choices_dir(cache_dir: Path | None) -> Path:
    if cache_dir is None:
        from onecopy.delegate.cache_key import default_cache_dir  # a leaf module: where the cache lives

        cache_dir = default_cache_dir()
    return Path(cache_dir) / "choices"


def _host() -> str:
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "CPU part")) and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def choice_key(method: str, export_hashes: Sequence[str], engines: Sequence[str], precision: str = "fp32") -> str:
    fields = {"method": method, "export_hashes": list(export_hashes), "host": _host(), "engines": list(engines),
              "format": CHOICE_FORMAT}
    if precision != "fp32":  # fp32 keys stay those of the choices recorded before precisions existed
        fields["precision"] = precision
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def read_choice(directory: Path, key: str) -> Choice | None:
    """The recorded choice, or None when there is none or it cannot be read (then the next load times again)."""
    try:
        raw = json.loads((directory / f"{key}.json").read_text())
        return Choice(str(raw["backend"]), int(raw["delegate"]), dict(raw["latency_ms"]), dict(raw["memory_mb"]),
                      str(raw.get("note", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_choice(directory: Path, key: str, choice: Choice, method: str, program: str,
                 export_hashes: Sequence[str] = ()) -> None:
    """Write atomically (a temporary file renamed): a reader sees the whole record or none. `method`, `program`
    and `export_hashes` (of the delegates compared) let `onecopy inspect` find the record of a program."""
    directory.mkdir(parents=True, exist_ok=True)
    record = {**asdict(choice), "method": method, "program": program, "export_hashes": list(export_hashes)}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".choice-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, directory / f"{key}.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def memory_mb() -> dict[str, float]:
    """This process's RSS and PSS in MiB (Linux; empty elsewhere)."""
    found = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss"):
                    found[name.lower()] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return found


def time_delegates(runs: dict[str, Callable[[list[np.ndarray]], list[np.ndarray]]], reference: str,
                   inputs: Sequence[TensorMeta], precision: str = "fp32",
                   bounds: Mapping[int, Sequence[int]] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """Median latency (ms) of each run (a method loaded with one candidate, called as users call it), run
    interleaved on the same random inputs after a warm-up call, for about TIMING_BUDGET_S; and, for each run but
    `reference`, why it is not kept: on the random inputs or on their mirror (`agreement.mirrored`), an output differs from
    the reference's in shape, dtype or values (integers and flags exactly, floats beyond the precision's
    tolerance). `bounds`: the method's input bounds, which the integer inputs are drawn within (`agreement.random_inputs`)."""
    global _timed
    _timed += 1
    arrays = random_inputs(inputs, bounds=bounds)
    draws = [arrays, mirrored(arrays, inputs, bounds)]
    expected = [[np.array(a) for a in runs[reference](draw)] for draw in draws]  # copies, whatever a run reuses
    rejected = {}
    for name, run in runs.items():
        if name == reference:
            continue
        for draw, (given, want) in enumerate(zip(draws, expected)):
            found = [(i, why) for i, (g, e) in enumerate(zip(run(given), want))
                     if (why := difference(g, e, TOLERANCES[precision], reference)) is not None]
            if found:
                i, why = found[0]
                rejected[name] = f"output {i} {why}" + (" on the mirrored inputs" if draw else "")
                break
    for run in runs.values():  # warm-up: the calls above were the first of their context (loads, first touches)
        run(arrays)
    times: dict[str, list[float]] = {name: [] for name in runs}
    order, started, rounds = list(runs.items()), time.perf_counter(), 0
    while rounds < MIN_RUNS or (rounds < MAX_RUNS and time.perf_counter() - started < TIMING_BUDGET_S):
        for name, run in (order if rounds % 2 == 0 else order[::-1]):  # neither always runs right after the other
            began = time.perf_counter()
            run(arrays)
            times[name].append((time.perf_counter() - began) * 1e3)
        rounds += 1
    return {name: float(np.median(t)) for name, t in times.items()}, rejected


def _whole_call(definition: MethodDef, source: str) -> DelegateCall:
    (call,) = definition.instructions if len(definition.instructions) == 1 else (None,)
    if not isinstance(call, DelegateCall) or call.inputs != definition.inputs or call.outputs != definition.outputs:
        raise ProgramFormatError(
            f"Program '{source}', method '{definition.name}' names alternative delegates, but its instructions are "
            "not one delegate call over its inputs and outputs, which an alternative replaces; re-export it.")
    return call


def choose_and_load(definition: MethodDef, meta: MethodMeta, program: ProgramDef, *, source: str,
                    cache_dir: Path | None, init: Callable[[list[int]], dict[int, DelegateHandle]],
                    make: Callable[[MethodMeta, dict[int, DelegateHandle]], Any],
                    precision: str = "fp32") -> tuple[Any, dict[int, DelegateHandle]]:
    """The method loaded with the delegate prefer="latency" picks (see the module docstring), and its handles.
    `init(indices)` initializes program delegates; `make(meta, {index: handle})` builds the Method."""
    from onecopy.delegate.cache_key import cache_disabled

    call = _whole_call(definition, source)
    name = definition.name
    candidates = [-1, *definition.alternatives]  # -1: the method's own delegate call (IREE)
    backends = {c: program.delegates[call.delegate if c == -1 else c].backend for c in candidates}
    engines = [f"{backends[c]} {get_backend(backends[c]).engine_version()}" for c in candidates]
    hashes = [delegate_summary(call.delegate if c == -1 else c, program).export_hash for c in candidates]
    directory, key = choices_dir(cache_dir), choice_key(name, hashes, engines, precision)
    chosen = None if cache_disabled() else read_choice(directory, key)

    def load(candidate: int, choice: Choice | None) -> tuple[Any, dict[int, DelegateHandle]]:
        handles = init([call.delegate]) if candidate == -1 else {call.delegate: init([candidate])[candidate]}
        shown = meta if candidate == -1 else dataclasses.replace(meta, delegates=(_alternative_meta(meta, candidate),))
        return make(dataclasses.replace(shown, choice=choice), handles), handles

    if chosen is not None and chosen.delegate in candidates:
        log.info("method %s: prefer=latency: %s, as measured before (%s; choice %s restored)", name,
                 chosen.backend, _describe(chosen.latency_ms), key[:12])
        return load(chosen.delegate, chosen)

    loaded: dict[int, tuple[Any, dict[int, DelegateHandle]]] = {}
    bounds = definition.input_bounds
    memory: dict[str, dict[str, float]] = {}
    try:
        for candidate in candidates:
            before = memory_mb()
            method, handles = load(candidate, None)
            loaded[candidate] = (method, handles)
            method.execute(random_inputs(meta.inputs, bounds=bounds))  # its first call's allocations count
            after = memory_mb()
            memory[backends[candidate]] = {k: round(after[k] - before[k], 1) for k in after if k in before}
        latency, rejected = time_delegates(
            {backends[c]: (lambda m: lambda arrays: m.execute(arrays))(loaded[c][0]) for c in candidates},
            backends[-1], meta.inputs, precision, bounds)
    except BaseException:
        for _, handles in loaded.values():
            for handle in handles.values():
                handle.destroy()
        raise
    kept = [c for c in candidates if backends[c] not in rejected]
    best = min(kept, key=lambda c: latency[backends[c]])
    note = "; ".join(f"{b} not kept: {why}" for b, why in rejected.items())
    choice = Choice(backends[best], best, latency, memory, note)
    for candidate, (_, handles) in loaded.items():
        if candidate != best:
            for handle in handles.values():
                handle.destroy()
    if not cache_disabled():
        write_choice(directory, key, choice, name, source, hashes)
    log.info("method %s: prefer=latency: %s (%s%s; choice %s recorded)", name, choice.backend,
             _describe(latency), f"; {note}" if note else "", key[:12])
    method, handles = loaded[best]
    # The Method was made before its timings existed; what it shows is its meta, now with the choice.
    method._meta = dataclasses.replace(method.method_meta, choice=choice)
    return method, handles


def _alternative_meta(meta: MethodMeta, index: int):
    return next(d for d in meta.alternatives if d.index == index)


def _describe(latency: dict[str, float]) -> str:
    return ", ".join(f"{backend} {ms:.3f} ms" for backend, ms in latency.items())
