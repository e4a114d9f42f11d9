"""Specialization: a portable bundle becomes code for this machine, and its weights are packed once, here.

Data tiling (measured here ~1.45x faster for prefill) makes the compiled module repack ("encode") its weights
into tiled layouts. Left to the module, every VM context does that at initialization and keeps its own copy:
8 contexts of the built-in model cost +291 MiB. Instead, specialization asks iree-compile for the parameter
encoder (`--iree-parameter-encoder-output-file`, overlay mode): the module then reads encoded weights from the
parameter scope `encoded`, and a separate encoder module computes them. We run the encoder once, store its
output in the cache entry beside the module, and every context and process memory-maps that one copy.

The encoder module follows IREE's `iree-encode-parameters` protocol (reflection `iree.encode.function`):
`indices` lists the parameters to produce (scope, name, size), `encode` reads the original weights through the
`model` scope and scatters the encoded ones into writable `encoded` parameters.

`vmfb` (AOT) programs get the same: export compiles each CPU target's bundle with the encoder flags
(`compile_with_encoder`, the one implementation both paths use) and stores that target's encoder beside the
bundle (manifest field `encoders`). At load, `encode` runs it once per machine; the cache entry then holds the
encoded parameters only, while the module's code keeps running in place from the program file. A program loaded in
bf16 that also holds fp32 code for the target has both encoded and timed at that load, and the entry keeps the
faster one's weights and says which code runs (its tuning's `chosen_precision`), as tuning does for mlir.

Tuned specialization (backend option `tune`, on by default): a module holding convolutions is built in a few
compiler configurations, each timed here and checked against the default's results, and the fastest is kept
(onecopy.delegate.tuning); the choice and the timings go into the cache entry, so a restore never tunes again.

Executor timing (onecopy.delegate.executors): on a CPU, each public function of the result is then timed on IREE's
task workers and on the calling thread (for a vmfb program at the load that runs its encoder, from the signatures
its manifest carries); the figures go into the cache entry, and every load picks its executor from them.

Running an encoder at load is a specialization step: `ONECOPY_FORBID_SPECIALIZE=1` refuses it just as it refuses
a compile, so a load under that variable is a restore or an error, never a silent repack.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.delegate.compiler import compile_bundle, compile_bundle_best, fallbacks_warned_once, warn_fallback
from onecopy.delegate.engine import ENCODED_SCOPE, LoadedModel, hal_device, parameter_provider, vm_instance
from onecopy.delegate.executors import calibrate_models
from onecopy.delegate.manifest import PARAMETER_SCOPE, STATE_FUNCTIONS, FunctionSignature
from onecopy.delegate.precision import precision_flags, without_droppable
from onecopy.delegate.targets import CPU_EXECUTORS, Target
from onecopy.delegate.tuning import (
    DEFAULT, Candidate, Runner, Signature, Tuning, example_inputs, plan, signatures, with_fp32,
)
from onecopy.delegate.tuning import tune as tuned
from onecopy.errors import DelegateError
from onecopy.runtime.copy_stats import CopyStats

__all__ = [
    "AOT_TIMING_S", "ENCODED_SCOPE", "ENV_FORBID_SPECIALIZE", "RECALIBRATE_BUDGET_S", "AotCode", "Compiled",
    "Specialization",
    "compile_with_encoder", "encode", "manifest_signatures", "recalibrate", "specialize", "wants_encoder",
]

log = logging.getLogger("onecopy")

ENV_FORBID_SPECIALIZE = "ONECOPY_FORBID_SPECIALIZE"


@dataclass
class Specialization:
    """What specialization produces: the module, and the encoded parameters it reads (maybe none). `module` is None
    when the module runs from the program file (a `vmfb` program): the result is the encoded parameters only."""

    module: bytes | None
    encoded: dict[str, np.ndarray] = field(default_factory=dict)  # name in scope `encoded` -> bytes (uint8)
    data_tiling: bool = True
    tuning: dict | None = None  # the configuration chosen and every candidate's timing (see delegate/tuning.py)
    executors: dict | None = None  # each function's latency on IREE's workers and inline (delegate/executors.py)


def _encoder_flags(path: Path) -> list[str]:
    return [
        f"--iree-parameter-encoder-output-file={path}",
        f"--iree-parameter-encoder-output-scope={ENCODED_SCOPE}",
        "--iree-parameter-encoder-mode=overlay",
    ]


@dataclass
class Compiled:
    """A bundle compiled for one target, and the parameter encoder for the same target (None: nothing to encode,
    the module then reads no `encoded` scope)."""

    module: bytes
    data_tiling: bool
    encoder: bytes | None = None


def wants_encoder(has_parameters: bool, target: Target) -> bool:
    """Whether a compile for `target` asks for a parameter encoder: data tiling packs weights on CPU targets."""
    return bool(has_parameters) and target.compute_unit == "cpu"


def compile_with_encoder(
    source: bytes | memoryview, target: Target, *, for_host: bool, where: str, with_encoder: bool,
    scratch: Path | None = None, flags: Sequence[str] = (), fallback: bool = True, semantic_flags: Sequence[str] = (),
) -> Compiled:
    """Compile `source` for `target` with data tiling (and `flags`) and, when `with_encoder`, IREE's parameter
    encoder for the same target. If data tiling fell back (`fallback`; else its failure raises), or the compiler
    produced no encoder (nothing to pack), there is none. The compiler writes the encoder into a directory under
    `scratch` (the cache's, at load: a process killed here leaves it where the cache sweeps it) or the system's
    temporary directory. `semantic_flags` (the precision's) go with every compile of the module, fallback
    included; those of them that only make code faster (precision.without_droppable) are left out, with a warning,
    where the compile fails with them. Raises `DelegateError` with the compiler's diagnostics (prefixed by the
    caller)."""
    try:
        return _compile_with_encoder(source, target, for_host=for_host, where=where, with_encoder=with_encoder,
                                     scratch=scratch, flags=flags, fallback=fallback, semantic_flags=semantic_flags)
    except DelegateError as e:
        fewer = without_droppable(semantic_flags)
        if fewer == tuple(semantic_flags):
            raise
        warn_fallback("%s: compiling with %s failed (%s); compiling without them", where,
                      " ".join(f for f in semantic_flags if f not in fewer), str(e).splitlines()[0][:200])
        return _compile_with_encoder(source, target, for_host=for_host, where=where, with_encoder=with_encoder,
                                     scratch=scratch, flags=flags, fallback=fallback, semantic_flags=fewer)


def _compile_with_encoder(source: bytes | memoryview, target: Target, *, for_host: bool, where: str,
                          with_encoder: bool, scratch: Path | None, flags: Sequence[str], fallback: bool,
                          semantic_flags: Sequence[str]) -> Compiled:
    with tempfile.TemporaryDirectory(prefix="onecopy-encoder-", dir=scratch) as tmp:
        encoder_path = Path(tmp) / "encoder.mlir"
        extra = [*flags, *(_encoder_flags(encoder_path) if with_encoder else [])]
        if fallback:
            module, data_tiling = compile_bundle_best(source, target, for_host=for_host, where=where, extra_flags=extra,
                                                      semantic_flags=semantic_flags)
        else:
            module = compile_bundle(source, target, for_host=for_host, extra_flags=[*semantic_flags, *extra])
            data_tiling = True
        if not with_encoder or not data_tiling or not encoder_path.exists() or encoder_path.stat().st_size == 0:
            return Compiled(module, data_tiling)
        encoder = compile_bundle(encoder_path.read_bytes(), target, for_host=for_host, data_tiling=False)
    return Compiled(module, data_tiling, encoder)


def _check_allowed(where: str) -> None:
    if os.environ.get(ENV_FORBID_SPECIALIZE, "") not in ("", "0"):
        raise DelegateError(f"{where}: specialization is forbidden ({ENV_FORBID_SPECIALIZE} is set) but the cache has no entry.")


def _reflection(function) -> dict[str, str]:
    return dict(function.reflection)


def _run_encoder(encoder_vmfb: bytes | memoryview, parameters: Mapping[str, memoryview], target: Target) -> dict[str, np.ndarray]:
    import iree.runtime as ireert

    instance = vm_instance()
    device = hal_device(target.driver)
    module = ireert.VmModule.copy_buffer(instance, encoder_vmfb)
    functions = {}
    for name in module.function_names:
        function = module.lookup_function(name)
        role = _reflection(function).get("iree.encode.function")
        if role:
            functions[role] = function
    if "indices" not in functions or "encode" not in functions:
        raise DelegateError(f"The parameter encoder has no indices/encode functions (it has {module.function_names}).")

    # `indices` only describes the outputs; its context still needs the modules the encoder imports.
    probe_parameters = ireert.create_io_parameters_module(instance, parameter_provider(parameters, PARAMETER_SCOPE))
    probe = ireert.VmContext(instance, modules=[ireert.create_hal_module(instance, device), probe_parameters, module])
    results = ireert.VmVariantList(1)
    probe.invoke(functions["indices"], ireert.VmVariantList(0), results)
    outputs: dict[str, np.ndarray] = {}
    scopes = results.get_as_list(0)
    for s in range(scopes.size):
        scope = scopes.get_as_list(s)
        scope_name = bytes(scope.get_as_object(0, ireert.VmBuffer)).decode()
        if scope_name != ENCODED_SCOPE:
            raise DelegateError(f"The parameter encoder writes scope '{scope_name}', expected '{ENCODED_SCOPE}'.")
        entries = scope.get_as_list(1)
        for e in range(entries.size):
            entry = entries.get_as_list(e)
            name = bytes(entry.get_as_object(1, ireert.VmBuffer)).decode()
            size = int(entry.get_variant(3))
            outputs[name] = np.zeros(size, np.uint8)
    io_parameters = ireert.create_io_parameters_module(
        instance,
        parameter_provider(parameters, PARAMETER_SCOPE),
        parameter_provider(outputs, ENCODED_SCOPE, writable=True),
    )
    context = ireert.VmContext(instance, modules=[ireert.create_hal_module(instance, device), io_parameters, module])
    ready = ireert.HalFence.create_at(device.create_semaphore(0), 0)
    done = ireert.HalFence.create_at(device.create_semaphore(0), 1)
    args = ireert.VmVariantList(3)
    args.push_list(ireert.VmVariantList(0))
    args.push_ref(ready)
    args.push_ref(done)
    context.invoke(functions["encode"], args, ireert.VmVariantList(0))
    done.wait()
    return outputs


def specialize(source: memoryview, parameters: Mapping[str, memoryview], target: Target, where: str,
               scratch: Path | None = None, *, tune: bool = False, precision: str = "fp32",
               state_zeros: Mapping[str, int] | None = None) -> Specialization:
    """Compile a portable bundle for this machine and encode its parameters once. The one place an `mlir`
    bundle becomes code. `tune`: try the configurations of `onecopy.delegate.tuning` and keep the fastest.
    `precision` (onecopy.delegate.precision): every candidate is compiled in it (but the fp32 one
    `tuning.with_fp32` adds in bf16), and tuning checks each against the default candidate in that precision.
    On a CPU target, each function of the result is then timed on both executors (onecopy.delegate.executors);
    `state_zeros` serves the module's state (parameter -> bytes, zeros) to those calls.

    `ONECOPY_FORBID_SPECIALIZE=1` turns any compile into an error: tests (and users who expect a warm cache)
    use it to prove a load was restored.
    """
    _check_allowed(where)
    with_encoder = wants_encoder(bool(parameters), target)

    def build(candidate: Candidate) -> Specialization:
        semantic = precision_flags(candidate.precision or precision)
        try:
            compiled = compile_with_encoder(source, target, for_host=True, where=where, with_encoder=with_encoder,
                                            scratch=scratch, flags=candidate.flags, fallback=candidate == DEFAULT,
                                            semantic_flags=semantic)
        except DelegateError as e:
            raise DelegateError(f"{where}: {e}") from e
        if compiled.encoder is None:
            return Specialization(compiled.module, data_tiling=compiled.data_tiling)
        return Specialization(compiled.module, _encode(compiled.encoder, parameters, target, where))

    started = time.perf_counter()
    with fallbacks_warned_once():  # every candidate of a tuning falls back the same way: say it once
        made = _build_tuned(source, build, parameters, target, where, tune=tune, precision=precision)
    if target.compute_unit == "cpu":
        try:
            found = signatures(source)
        except ValueError as e:
            made.executors = {"functions": {}, "note": f"not calibrated: {e}"}
        else:
            made.executors = _calibrate_executors(made.module, found, made.encoded, parameters, target, where,
                                                  state_zeros, _budget(started))
    return made


def _budget(started: float) -> float:
    """Time for executor calibration: a tenth of what specialization took so far, 0.25 to 2 s."""
    return min(max(0.1 * (time.perf_counter() - started), 0.25), 2.0)


def _build_tuned(source: memoryview, build: Callable[[Candidate], Specialization], parameters: Mapping[str, memoryview],
                 target: Target, where: str, *, tune: bool, precision: str) -> Specialization:
    if not tune:
        return build(DEFAULT)
    options, order = plan(source)
    options = with_fp32(options, precision)  # bf16 allows bf16: kept where it measures faster (with_fp32 says why)
    if len(options) == 1:  # nothing to choose between: no model to load and time, the first load costs no more
        made = build(DEFAULT)
        made.tuning = Tuning(DEFAULT, note=order, precision=precision).record()  # plan's ONE_CONFIGURATION
        return made

    def build_code(candidate: Candidate) -> tuple[Specialization, bytes | memoryview]:
        made = build(candidate)
        assert made.module is not None  # specialize's builds always compile a module
        return made, made.module

    chosen, _ = _tuned_models(source, build_code, parameters, target, where, options=options, precision=precision,
                              order=order)
    return chosen


def _tuned_models(source: memoryview | None, build: Callable[[Candidate], tuple[Specialization, bytes | memoryview]],
                  parameters: Mapping[str, memoryview], target: Target, where: str,
                  **options: Any) -> tuple[Specialization, bytes | memoryview]:
    """tuning.tune (`options` its keywords) over what `build` makes for each candidate: its specialization and
    the code that runs with its encoded weights, loaded as a model to time. A candidate's model and weights go as
    soon as it is out of the running (no more than two held). The chosen specialization, its tuning record set,
    and its code."""
    models: dict[int, LoadedModel] = {}  # by id() of the Specialization each was loaded from
    code_of: dict[int, bytes | memoryview] = {}

    def build_and_load(candidate: Candidate) -> tuple[Specialization, Runner]:
        made, code = build(candidate)
        encoded = {name: memoryview(array) for name, array in made.encoded.items()}
        model = LoadedModel(code, parameters, target, f"{where} (tuning {candidate.name})", encoded=encoded)
        models[id(made)], code_of[id(made)] = model, code
        return made, _runner(model)

    def release(made: Specialization) -> None:  # out of the running: its model and encoded weights go now
        model = models.pop(id(made), None)
        if model is not None:
            model.close()
        made.encoded.clear()

    try:
        chosen, tuning = tuned(source, build_and_load, where, release=release, **options)
    finally:
        for model in models.values():
            model.close()
    chosen.tuning = tuning.record()
    return chosen, code_of[id(chosen)]


def _calibrate_executors(module: bytes | memoryview, found: list[Signature],
                         packed: Mapping[str, np.ndarray | memoryview],
                         parameters: Mapping[str, memoryview], target: Target, where: str,
                         state_zeros: Mapping[str, int] | None, budget_s: float) -> dict:
    """Each public function of `module` (signatures `found`) timed on IREE's workers and on the calling thread,
    on random inputs of its signature (dynamic dimensions: 1), for `choose` at every load
    (onecopy.delegate.executors). `packed`: the encoded weights the module reads."""
    rng = np.random.default_rng(0)
    # A module's state functions serve State.read/save/reset, rare calls next to its methods: not timed.
    calls = {s.name: (example_inputs(s, rng), s.results) for s in found if s.name not in STATE_FUNCTIONS}
    if not calls:
        return {"functions": {}, "note": "not calibrated: no function to time"}
    encoded = {name: memoryview(array) for name, array in packed.items()}

    def load(executor: str) -> LoadedModel:
        return LoadedModel(module, parameters, target, f"{where} (calibrating {executor})", encoded=encoded,
                           state_zeros=state_zeros, driver=CPU_EXECUTORS[executor])

    return calibrate_models(load, calls, budget_s, where)


@dataclass(frozen=True)
class AotCode:
    """A `vmfb` program's code for one target in one precision, and the parameter encoder compiled with it."""

    precision: str
    code: bytes | memoryview
    encoder: bytes | memoryview


# How long each precision of a vmfb program's code is timed when its first load chooses between them
# (`encode`): its codes were compiled at export, so the choice costs an encoder run and these timings.
AOT_TIMING_S = 0.25


def encode(aot: AotCode, parameters: Mapping[str, memoryview], target: Target, where: str, *,
           functions: Mapping[str, FunctionSignature] | None = None, state_zeros: Mapping[str, int] | None = None,
           fp32: AotCode | None = None) -> Specialization:
    """Run a `vmfb` program's parameter encoder (compiled at export for `target`) once, here: the result holds the
    encoded parameters only; the module itself runs from the program file. With the `functions` its manifest
    lists, each function is then timed on both CPU executors, as `specialize` does. A specialization step, so
    `ONECOPY_FORBID_SPECIALIZE=1` refuses it.

    `fp32`: the same target's fp32 code, when `aot` is in another precision (bf16) that the load allows rather
    than forces, as `specialize` does for an mlir program (tuning.with_fp32 says why): both are encoded and
    timed on the manifest's functions, and the result holds the one measured faster (`aot` unless fp32 is
    clearly faster, their answers agreeing), its tuning record naming it (`chosen_precision`)."""
    _check_allowed(where)
    started = time.perf_counter()
    if fp32 is None or not functions:
        made = Specialization(None, _encode(aot.encoder, parameters, target, where))
        code = aot.code
    else:
        made, code = _encode_faster(aot, fp32, parameters, target, where, manifest_signatures(functions))
    if target.compute_unit == "cpu" and functions:
        made.executors = _calibrate_executors(code, manifest_signatures(functions), made.encoded, parameters, target,
                                              where, state_zeros, _budget(started))
    return made


def _encode_faster(aot: AotCode, fp32: AotCode, parameters: Mapping[str, memoryview], target: Target, where: str,
                   found: list[Signature]) -> tuple[Specialization, bytes | memoryview]:
    """`aot` and `fp32` encoded and timed (tuning.tune, `aot` the reference): the faster one's packed weights
    and tuning record, and its code."""
    codes = {Candidate(f"the {aot.precision} code"): aot, Candidate("the fp32 code", precision="fp32"): fp32}

    def build(candidate: Candidate) -> tuple[Specialization, bytes | memoryview]:
        chosen = codes[candidate]
        return Specialization(None, _encode(chosen.encoder, parameters, target, where)), chosen.code

    return _tuned_models(None, build, parameters, target, where, options=list(codes), precision=aot.precision,
                         order=f"the program's {aot.precision} and fp32 code, compiled at export", functions=found,
                         timing_s=AOT_TIMING_S, budget_s=math.inf)


def _runner(model: LoadedModel) -> Runner:
    """Calls `model`'s functions by name on numpy arrays, each function's call planned once."""
    functions: dict[str, Any] = {}

    def run(name: str, arrays: list[np.ndarray], results: int) -> list[np.ndarray]:
        function = functions.get(name)
        if function is None:
            function = functions[name] = model.function(name).copied_call(arrays, results)
        return function(arrays, CopyStats())

    return run


def manifest_signatures(functions: Mapping[str, FunctionSignature]) -> list[Signature]:
    """The functions a `vmfb` program's manifest lists, as tuning's signatures (what calibration times)."""
    return [Signature(name, tuple((tuple(shape), dtype) for shape, dtype in sig.arguments), sig.results)
            for name, sig in functions.items()]


# A user who asks for it can afford the longest timing specialization gives itself.
RECALIBRATE_BUDGET_S = 2.0


def recalibrate(code: bytes | memoryview, found: list[Signature], encoded: Mapping[str, memoryview],
                parameters: Mapping[str, memoryview], target: Target, where: str,
                state_zeros: Mapping[str, int] | None, budget_s: float = RECALIBRATE_BUDGET_S) -> dict:
    """Time the functions `found` of a restored specialization (its `code` and `encoded` weights) on both CPU
    executors again, as specialization did: backend option `recalibrate`, for a choice first made while the
    machine was busy. Compiles nothing, so `ONECOPY_FORBID_SPECIALIZE` does not refuse it."""
    return _calibrate_executors(code, found, encoded, parameters, target, where, state_zeros, budget_s)


def _encode(encoder: bytes | memoryview, parameters: Mapping[str, memoryview], target: Target, where: str) -> dict[str, np.ndarray]:
    try:
        encoded = _run_encoder(encoder, parameters, target)
    except (RuntimeError, ValueError) as e:
        raise DelegateError(f"{where}: encoding the parameters for this machine failed: {e}") from e
    log.debug("%s: encoded %d parameters (%d bytes) for this machine", where, len(encoded),
              sum(a.nbytes for a in encoded.values()))
    return encoded
