"""Dynamic dimensions at export: torch's size symbols (s31) under the names the user gave them (T), their ranges,
and tensor specs that carry those names into the program."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from onecopy.errors import ExportError
from onecopy.program import TensorSpec
from onecopy.program.validate import DTYPES

__all__ = ["spec_dtype", "tensor_spec", "rename_symbols", "symbol_names", "symbol_ranges"]


def tensor_spec(node: fx.Node, where: str, names: Mapping[str, str] | None = None) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ExportError(f"{where}: '{node.name}' is not a tensor ({type(val).__name__}); only tensors cross a method's boundary.")
    shape = [int(d) if isinstance(d, int) or not hasattr(d, "node") else rename_symbols(str(d), names or {}) for d in val.shape]
    return TensorSpec(shape=shape, dtype=spec_dtype(val.dtype, f"{where}: '{node.name}'"))


def spec_dtype(dtype: torch.dtype, what: str) -> str:
    """The program's name for a tensor's dtype where the runtime hands the tensor over as a numpy array (a method's
    inputs and outputs, constants, states): refused here when numpy has no such dtype, so that no file is written
    that no runtime could load."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        hint = ("cast it at the method's boundary inside the model (x.float() or x.half()), or export the model "
                "in float32 and load it with precision='bf16' to compute in bf16") if name == "bfloat16" else (
                "cast it at the method's boundary inside the model to one of those")
        raise ExportError(f"{what} is {name}, which the runtime cannot hand over: numpy has no such dtype (a "
                          f"program's tensors are one of {', '.join(sorted(DTYPES))}). To fix it, {hint}.")
    return name


_TORCH_SYMBOL = re.compile(r"\b[su]\d+\b")  # torch's names for sizes: s31 (from inputs), u0 (data-dependent)


def rename_symbols(text: str, names: Mapping[str, str]) -> str:
    """`text` with torch's symbols (s31) replaced by the names the user knows them by (T)."""
    return _TORCH_SYMBOL.sub(lambda m: names.get(m.group(), m.group()), text) if names else text


def symbol_names(ep: ExportedProgram) -> dict[str, str]:
    """torch symbol -> the name of the user's `torch.export.Dim` for it (s31 -> T), or `x.shape[1]` for a dynamic
    dimension the user did not name (Dim.AUTO). torch keeps the Dim names only in the shape environment of the
    example values (which source, e.g. L['x'].size()[0], got which Dim name): read where present, else the input
    and axis where the symbol first appears."""
    names: dict[str, str] = {}
    user_inputs = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for axis, d in enumerate(node.meta["val"].shape):
            expr = getattr(getattr(d, "node", None), "expr", None)
            if not isinstance(expr, sympy.Symbol) or str(expr) in names:
                continue
            names[str(expr)] = _dim_name(d, expr) or f"{node.name}.shape[{axis}]"
    return names


def _dim_name(d: Any, symbol: sympy.Symbol) -> str | None:
    try:
        shape_env = d.node.shape_env
        debug_names = shape_env.source_name_to_debug_name
        for source in shape_env.var_to_sources.get(symbol, ()):
            source_name = source.name() if callable(source.name) else source.name
            if source_name in debug_names:
                return str(debug_names[source_name])
    except AttributeError:  # torch internals moved: fall back to the input and axis
        return None
    return None


def symbol_ranges(ep: ExportedProgram) -> dict[str, tuple[int, int | None]]:
    ranges = {}
    for symbol, vr in ep.range_constraints.items():
        if not isinstance(vr.lower, sympy.Integer):
            # A value read from the data (x.sum().item(): an unbacked float, or an int with no lower bound), not a
            # size: no shape names it, and its -oo does not convert to an int.
            continue
        # torch's unbounded upper end is `int_oo`, which claims `is_finite` and cannot be converted by int().
        upper = vr.upper
        ranges[str(symbol)] = (int(vr.lower), int(upper) if isinstance(upper, sympy.Integer) else None)
    return ranges
