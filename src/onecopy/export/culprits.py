"""Which op of a module IREE cannot compile, found at export so that the first load never is where it shows.

Only run after a module failed to compile, so an export that compiles pays nothing here. First the ops the
compiler's diagnostic names (`failed to legalize operation 'torch.aten.convolution'`) are compiled alone, each
distinct signature once; when that finds none (a codegen failure names no op), each failing partition is bisected:
the shortest prefix of its ops that fails ends with the culprit. Every trial goes through the same lowering path
(turbine import, then iree-compile with the target's flags, data tiling or its fallback).
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from onecopy.errors import ExportError
from onecopy.export.lowering import CompileFailed, StagedFunction, compile_error, stage
from onecopy.export.partitioner import op_name
from onecopy.export.subgraph import cut, dynamic_shapes, example

__all__ = ["Culprit", "find_culprits", "source_line", "reason"]


class _Partition(Protocol):
    method: str
    index: int
    nodes: list[fx.Node]
    weights: dict[fx.Node, str]
    ranges: dict[str, tuple[int, int | None]]


@dataclass
class Culprit:
    method: str
    node: fx.Node
    error: str  # the compiler's reason


_NAMED_OP = re.compile(r"torch\.(aten|prims)\.([A-Za-z0-9_]+)")


def _base_name(node: fx.Node) -> str | None:
    """`aten.convolution` for `aten.convolution.default`: how torch-mlir names the op in a diagnostic."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.replace("::", ".")
    return None


def _signature(node: fx.Node) -> tuple:
    """What decides whether an op compiles: the op, its tensors' shapes and dtypes, its other arguments."""

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("tensor", tuple(str(d) for d in val.shape), str(val.dtype))
            return ("value", str(val))
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)

    return (op_name(node), arg(tuple(node.args)), tuple(sorted((k, arg(v)) for k, v in node.kwargs.items())))


def _with_elements(nodes: Sequence[fx.Node], partition: _Partition) -> list[fx.Node]:
    """`nodes` and the elements (getitem) of their multi-output results that the partition takes."""
    chosen = set(nodes)
    return [n for n in partition.nodes if n in chosen or (n.target is operator.getitem and n.args[0] in chosen)]


def _trial(nodes: Sequence[fx.Node], partition: _Partition, parameters: Mapping[str, torch.Tensor],
           failure: CompileFailed) -> str | None:
    """Why `nodes` of `partition`, as a function of their own, cannot be compiled; None when they can."""
    piece = cut(nodes, partition.weights)
    if piece is None:
        return None
    function = StagedFunction(
        "main", piece.graph_module, [partition.weights[w] for w in piece.weights],
        tuple(example(a) for a in piece.activations), tuple(example(r) for r in piece.results),
        f"method '{partition.method}', partition {partition.index}",
        dynamic_shapes(piece.activations, partition.ranges),
    )
    try:
        bytecode = stage([function], parameters)
    except ExportError as e:  # it cannot even be imported: it cannot run in the engine either
        return str(e)
    return compile_error(bytecode, failure.target, for_host=failure.for_host)


def find_culprits(
    partitions: Sequence[_Partition], failure: CompileFailed, parameters: Mapping[str, torch.Tensor]
) -> list[Culprit]:
    """The ops of `partitions` (one module that failed to compile) that IREE cannot compile; [] when no op alone
    is to blame."""
    tried: dict[tuple, str | None] = {}

    def alone(node: fx.Node, partition: _Partition) -> str | None:
        signature = _signature(node)
        if signature not in tried:
            tried[signature] = _trial(_with_elements([node], partition), partition, parameters, failure)
        return tried[signature]

    named = {f"{ns}.{op}" for ns, op in _NAMED_OP.findall(str(failure))}
    culprits = [
        Culprit(p.method, node, error)
        for p in partitions for node in p.nodes
        if _base_name(node) in named and node.target is not operator.getitem
        for error in [alone(node, p)] if error is not None
    ]
    if culprits:
        return culprits
    for p in partitions:
        ops = [n for n in p.nodes if n.target is not operator.getitem]
        whole = _trial(p.nodes, p, parameters, failure)
        if whole is None:
            continue
        culprit = _first_failing(ops, lambda prefix: _trial(_with_elements(prefix, p), p, parameters, failure))
        culprits.append(Culprit(p.method, ops[culprit], alone(ops[culprit], p) or whole))
    return culprits


def _first_failing(ops: Sequence[fx.Node], fails: Callable[[Sequence[fx.Node]], str | None]) -> int:
    """Index of the op ending the shortest failing prefix of `ops` (the whole list fails)."""
    good, bad = 0, len(ops)  # ops[:good] compiles, ops[:bad] fails
    while bad - good > 1:
        middle = (good + bad) // 2
        if fails(ops[:middle]) is None:
            good = middle
        else:
            bad = middle
    return bad - 1


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n[ \t]*([^\n]*)')
_LIBRARIES = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch,) if getattr(m, "__file__", None)
)


def source_line(node: fx.Node) -> str | None:
    """`file:line `code`` of the model's line that made `node`: the last frame of its stack trace outside torch
    (a `torch.nn.Conv3d` module's own frames are not where the user can change anything)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    user = [f for f in frames if not f[0].startswith(_LIBRARIES)]
    path, line, code = (user or frames)[-1]
    return f"{path}:{line} `{code.strip()}`" if code.strip() else f"{path}:{line}"


def reason(error: str) -> str:
    """The compiler's reason in one line: its first `error:`, without the IR it dumps after it."""
    found = re.search(r"error: (.*)", error)
    text = found.group(1) if found else error.strip().splitlines()[0] if error.strip() else "unknown error"
    text = re.split(r": %\S+ = |\s+loc\(", text)[0]
    return text if len(text) <= 300 else text[:297] + "..."
