"""Lowering: stage partitions as functions of ONE turbine builder, export once, package the bundle.

Both partitioner modes go through `lower`: the default stages one partition as `main`; multifunction stages every
method's partitions at once as `<method>_<i>`. Parameters are externalized (scope `model`), so the bundle holds
code only and each weight is stored once in the program's named data, however many functions use it.

A `vmfb` bundle for a CPU target is compiled with data tiling and IREE's parameter encoder (as specialization
does for `mlir`): the bundle reads its packed weights from scope `encoded`, and the encoder, compiled for the
same target, travels beside it so a loader packs the weights once per machine instead of once per VM context.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from onecopy.delegate.manifest import PARAMETER_SCOPE, PORTABLE, FunctionSignature, bundle_key
from onecopy.delegate.precision import aot_precision, precision_flags
from onecopy.delegate.compiler import compile_bundle
from onecopy.delegate.specialize import compile_with_encoder, wants_encoder
from onecopy.delegate.targets import TARGETS, Target
from onecopy.delegate.tuning import signatures
from onecopy.errors import DelegateError, ExportError
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.state import StateBinding, register_states, stage_helpers

__all__ = ["StagedFunction", "LoweredBundle", "CompileFailed", "stage", "lower", "check_compiles", "compile_error"]


@dataclass
class StagedFunction:
    """One engine function: a pure graph taking (parameters..., activations...) and returning a tuple."""

    name: str
    graph_module: fx.GraphModule
    parameters: list[str]  # names in the shared parameter table, in placeholder order
    example_args: tuple[torch.Tensor, ...]
    example_results: tuple[torch.Tensor, ...]
    where: str  # "method 'forward', partition 0", for errors
    dynamic_args: tuple | None = None  # torch.export dynamic_shapes of the arguments
    # ... of the arguments and results, for the destination-passing form
    dynamic_results: tuple | None = None
    # Destination-passing: the results are written into trailing output arguments instead of returned.
    outputs_in_place: bool = False
    # Program state (onecopy.export.state): the globals read after the parameters, the results stored into them
    # (result index -> global) and the results returned (None: all).
    states: list[str] = field(default_factory=list)
    updates: list[tuple[int, str]] = field(default_factory=list)
    returned: list[int] | None = None


@dataclass
class LoweredBundle:
    packaging: str
    code: dict[str, bytes]  # PORTABLE -> MLIR bytecode, or target name -> vmfb
    functions: list[str]
    # target name -> its parameter encoder (vmfb), for the targets whose bundle reads scope `encoded`
    encoders: dict[str, bytes] = field(default_factory=dict)
    # public function name -> its signature (vmfb: the code carries no MLIR to read them from at load)
    signatures: dict[str, FunctionSignature] = field(default_factory=dict)


def _varargs(specs: tuple | None) -> tuple | None:
    # The staged functions take `*args`, which torch.export sees as one tuple argument.
    return (specs,) if specs else None


def _stage(fxb, function: StagedFunction) -> None:
    """Stage one function. The destination-passing form writes its results into trailing output arguments
    (`out.copy_(y)` compiles to a tied alias, so a caller's imported buffer, e.g. a bound surface, is filled in
    place) and returns a 0-d tensor, because an engine function cannot return nothing. Only one form per
    partition: a second form would make the parameter encoder pack every weight once more."""
    graph_module, names = function.graph_module, function.parameters
    n_inputs = len(function.example_args)

    def call(module, *args):
        return graph_module(*(getattr(module, name) for name in names), *args)

    states, updates, returned = function.states, function.updates, function.returned

    def call_with_state(module, *args):
        results = graph_module(*(getattr(module, name) for name in names),
                               *(getattr(module, name) for name in states), *args)
        for index, name in updates:
            getattr(module, name).copy_(results[index])  # stored in place: the update runs on the global
        kept = tuple(results[i] for i in returned) if returned is not None else tuple(results)
        # An engine function cannot return nothing. A float32 0-d placeholder whatever the arguments' dtypes: IREE's
        # torch import refuses a uint8 (or bool) literal returned as such (si8 inferred against ui8).
        return kept if kept else torch.zeros(())

    def call_in_place(module, *args):
        results = graph_module(*(getattr(module, name) for name in names), *args[:n_inputs])
        for out, result in zip(args[n_inputs:], results):
            out.copy_(result)
        return torch.zeros(())  # the placeholder result: float32, as above

    if function.outputs_in_place:
        args = function.example_args + tuple(torch.zeros_like(r) for r in function.example_results)
        dynamic, fn = function.dynamic_results, call_in_place
    else:
        args, dynamic = function.example_args, function.dynamic_args
        fn = call_with_state if states or updates else call
    fxb.export_program(name=function.name, args=args, strict=False, dynamic_shapes=_varargs(dynamic))(fn)


def stage(functions: Sequence[StagedFunction], parameters: Mapping[str, torch.Tensor],
          states: Sequence[StateBinding] = ()) -> bytes:
    """Import `functions` (and, with `states`, the program's state globals and their helper functions) through
    iree-turbine as one module: its MLIR bytecode."""
    from iree.turbine import aot

    root = torch.nn.Module()
    for function in functions:
        for name in function.parameters:
            if not hasattr(root, name):
                root.register_buffer(name, parameters[name])
    for state in states:
        if state.initial is not None and not hasattr(root, state.initial):
            root.register_buffer(state.initial, parameters[state.initial])
    register_states(root, list(states))
    aot.externalize_module_parameters(root, external_scope=PARAMETER_SCOPE)
    fxb = aot.FxProgramsBuilder(root)
    where = "; ".join(f.where for f in functions)
    try:
        for function in functions:
            _stage(fxb, function)
        if states:
            stage_helpers(fxb, list(states))
        exported = aot.export(fxb)
    except Exception as e:
        raise ExportError(f"iree-turbine could not import {where}: {e}") from e
    return _with_stable_locations(exported.mlir_module.operation)


_FX_CODE = re.compile(r'"<eval_with_key>\.\d+"')


def _with_stable_locations(module) -> bytes:
    """The module's bytecode, its locations naming the code torch.fx generates for a graph without the counter
    in that name (`<eval_with_key>.N`, N counting the graphs made so far in the process): otherwise two exports of
    one model differ in it alone, and so does their export hash, the identity under which the specialization
    cache stores a compiled module. The locations themselves stay: without any, iree-compile's output for one
    module differs from one compile to the next."""
    from iree.compiler import ir

    text = _FX_CODE.sub('"<eval_with_key>"', module.get_asm(enable_debug_info=True))
    buffer = io.BytesIO()
    ir.Module.parse(text, module.context).operation.write_bytecode(buffer)
    return buffer.getvalue()


def lower(functions: Sequence[StagedFunction], parameters: Mapping[str, torch.Tensor], spec: CompileSpec,
          states: Sequence[StateBinding] = ()) -> LoweredBundle:
    """Stage `functions` as one module and package it: MLIR bytecode (`mlir`), or code per target (`vmfb`).
    Raises `CompileFailed` when IREE cannot compile a target."""
    bytecode = stage(functions, parameters, states)
    names = [f.name for f in functions]
    if spec.packaging == "mlir":
        return LoweredBundle(spec.packaging, {PORTABLE: bytecode}, names)
    code, encoders = {}, {}
    has_parameters = any(f.parameters for f in functions) or any(s.initial for s in states)
    where = "; ".join(f.where for f in functions)
    for name in spec.targets:
        target = TARGETS[name]
        for precision in spec.precisions:
            # Another precision than fp32: its semantic flags (precision_flags), on a CPU baseline that has the
            # instructions it needs (aot_precision); its encoder packs the weights for that code.
            aot = aot_precision(name, precision)
            key = bundle_key(name, precision)
            try:
                # The baseline goes with the semantic flags: a compile that falls back (no data tiling) must not
                # fall back to a CPU without the instructions, either.
                compiled = compile_with_encoder(
                    bytecode, target, for_host=False, where=where, with_encoder=wants_encoder(has_parameters, target),
                    semantic_flags=(*(aot.compiler_flags() if aot else ()), *precision_flags(precision)))
            except DelegateError as e:
                raise CompileFailed(f"{where} ({key}): {e}", target=target, for_host=False) from e
            code[key] = compiled.module
            if compiled.encoder is not None:
                encoders[key] = compiled.encoder
    return LoweredBundle(spec.packaging, code, names, encoders, _signatures(bytecode))


def _signatures(bytecode: bytes) -> dict[str, FunctionSignature]:
    """Each public function's signature, read from the staged MLIR (empty when an argument is not a tensor numpy
    can make: a load then keeps the default executor, having nothing to time)."""
    try:
        found = signatures(bytecode)
    except ValueError:
        return {}
    return {s.name: FunctionSignature([(list(shape), dtype) for shape, dtype in s.arguments], s.results)
            for s in found}


class CompileFailed(ExportError):
    """IREE could not compile a staged module for `target`: the exporter then looks for the op to blame."""

    def __init__(self, message: str, *, target: Target, for_host: bool) -> None:
        super().__init__(message)
        self.target = target
        self.for_host = for_host


def check_compiles(bundle: LoweredBundle, has_parameters: bool, target: Target, where: str) -> None:
    """Compile a portable bundle as its first load on this machine will (`specialize`: host CPU features, data
    tiling or its fallback, the parameter encoder), so that an export that passes is a program that loads.
    Raises `CompileFailed`."""
    try:
        compile_with_encoder(bundle.code[PORTABLE], target, for_host=True, where=where,
                             with_encoder=wants_encoder(has_parameters, target))
    except DelegateError as e:
        raise CompileFailed(f"{where}: {e}", target=target, for_host=True) from e


def compile_error(bytecode: bytes, target: Target, *, for_host: bool) -> str | None:
    """Why IREE cannot compile `bytecode` for `target`, or None when it can: with data tiling, or without it as
    a load falls back to (the parameter encoder is left out: it packs weights, it does not decide which ops
    compile)."""
    try:
        compile_bundle(bytecode, target, for_host=for_host)
        return None
    except DelegateError:
        pass
    try:
        compile_bundle(bytecode, target, for_host=for_host, data_tiling=False)
        return None
    except DelegateError as e:
        return str(e)
