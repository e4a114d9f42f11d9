"""Lowering: stage partitions as functions of ONE turbine builder, export once, package the bundle.

Both partitioner modes go through `lower`: the default stages one partition as `main`; multifunction stages every
method's partitions at once as `<method>_<i>`. Parameters are externalized (scope `model`), so the bundle holds
code only and each weight is stored once in the program's named data, however many functions use it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from onecopy.delegate.engine import compile_bundle_best
from onecopy.delegate.manifest import PARAMETER_SCOPE, PORTABLE
from onecopy.delegate.targets import TARGETS
from onecopy.errors import DelegateError, ExportError
from onecopy.export.compile_spec import CompileSpec

__all__ = ["StagedFunction", "LoweredBundle", "lower"]


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
    # ... of the arguments and results (the destination-passing twin's); False: not expressible, no twin
    dynamic_results: tuple | None | bool = None

    @property
    def dps_name(self) -> str:
        return f"{self.name}_dps"


@dataclass
class LoweredBundle:
    packaging: str
    code: dict[str, bytes]  # PORTABLE -> MLIR bytecode, or target name -> vmfb
    functions: list[str]
    dps_functions: list[str]


def _varargs(specs: tuple | None | bool) -> tuple | None:
    # The staged functions take `*args`, which torch.export sees as one tuple argument.
    return (specs,) if specs else None


def _stage(fxb, function: StagedFunction) -> None:
    """Stage the function, and its destination-passing twin: the same computation writing its results into
    trailing output arguments (`out.copy_(y)` compiles to a tied alias, so a caller's imported buffer is filled
    in place). The twin returns a 0-d tensor because an engine function cannot return nothing."""
    graph_module, names = function.graph_module, function.parameters
    n_inputs = len(function.example_args)

    def call(module, *args):
        return graph_module(*(getattr(module, name) for name in names), *args)

    def call_dps(module, *args):
        results = graph_module(*(getattr(module, name) for name in names), *args[:n_inputs])
        for out, result in zip(args[n_inputs:], results):
            out.copy_(result)
        return args[n_inputs].new_zeros(())

    fxb.export_program(
        name=function.name, args=function.example_args, strict=False, dynamic_shapes=_varargs(function.dynamic_args)
    )(call)
    if function.dynamic_results is False:
        return
    dps_args = function.example_args + tuple(torch.zeros_like(r) for r in function.example_results)
    fxb.export_program(
        name=function.dps_name, args=dps_args, strict=False, dynamic_shapes=_varargs(function.dynamic_results)
    )(call_dps)


def lower(functions: Sequence[StagedFunction], parameters: Mapping[str, torch.Tensor], spec: CompileSpec) -> LoweredBundle:
    from iree.turbine import aot

    root = torch.nn.Module()
    for function in functions:
        for name in function.parameters:
            if not hasattr(root, name):
                root.register_buffer(name, parameters[name])
    aot.externalize_module_parameters(root, external_scope=PARAMETER_SCOPE)
    fxb = aot.FxProgramsBuilder(root)
    where = "; ".join(f.where for f in functions)
    try:
        for function in functions:
            _stage(fxb, function)
        exported = aot.export(fxb)
        buffer = io.BytesIO()
        exported.mlir_module.operation.write_bytecode(buffer)
    except Exception as e:
        raise ExportError(f"iree-turbine could not import {where}: {e}") from e
    bytecode = buffer.getvalue()
    if spec.packaging == "mlir":
        code = {PORTABLE: bytecode}
    else:
        code = {}
        for target in spec.targets:
            try:
                code[target], _ = compile_bundle_best(bytecode, TARGETS[target], for_host=False, where=where)
            except DelegateError as e:
                raise ExportError(f"{where}: {e}") from e
    return LoweredBundle(spec.packaging, code, [f.name for f in functions],
                         [f.dps_name for f in functions if f.dynamic_results is not False])
