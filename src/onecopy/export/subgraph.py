"""Cutting a run of graph nodes out of a method as a function of its own: the partitions the engine takes, and
the single ops the export-time compile check tries alone to find which one IREE cannot compile."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

__all__ = ["Cut", "cut", "is_symbolic", "example", "dynamic_shapes"]


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic(node: fx.Node) -> bool:
    """A shape computation (sym_size, arithmetic on sizes): recomputed inside each partition that needs it."""
    return isinstance(node.meta.get("val"), _SYMBOLIC)


def _dim_value(d: Any) -> int:
    return int(d) if isinstance(d, int) else int(d.node.hint)


def example(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return torch.zeros([_dim_value(d) for d in val.shape], dtype=val.dtype)


def dynamic_shapes(nodes: list[fx.Node], ranges: dict[str, tuple[int, int | None]]) -> tuple | None:
    """torch.export dynamic_shapes for re-exporting a partition: one `Dim` per symbol, shared across arguments
    so the engine function keeps the method's dynamic dimensions. A dimension that is an expression reaches a
    partition across a graph break (a host op's result of size 2*T): a linear one becomes a derived Dim (2*T),
    any other a Dim of its own. Exporting it static instead would make a function that runs only at the example
    size. None when every shape is static."""
    dims: dict[str, Any] = {}
    specs = []
    for node in nodes:
        spec = {}
        for axis, d in enumerate(node.meta["val"].shape):
            if isinstance(d, int):
                continue
            spec[axis] = _dim_for(d.node.expr, dims, ranges)
        specs.append(spec or None)
    return tuple(specs) if dims else None


def _dim_for(expr: sympy.Expr, dims: dict[str, Any], ranges: dict[str, tuple[int, int | None]]) -> Any:
    def root(symbol: sympy.Symbol, min_: int = 0) -> Any:
        name = str(symbol)
        if name not in dims:
            low, high = ranges.get(name, (0, None))
            low = max(low, min_, 0)
            dims[name] = torch.export.Dim(name, min=low, max=high) if high is not None else torch.export.Dim(name, min=low)
        return dims[name]

    if isinstance(expr, sympy.Symbol):
        return root(expr)
    free = list(expr.free_symbols)
    if len(free) == 1:
        (symbol,) = free
        a, b = expr.coeff(symbol), expr.subs(symbol, 0)
        if isinstance(a, sympy.Integer) and isinstance(b, sympy.Integer) and a > 0 and sympy.expand(a * symbol + b - expr) == 0:
            # torch wants the root's minimum to keep the derived size >= 0
            return root(symbol, -(int(b) // int(a))) * int(a) + int(b)
    name = f"d{len(dims)}_" + re.sub(r"\W", "_", str(expr))
    dims[name] = torch.export.Dim(name, min=0)
    return dims[name]


@dataclass
class Cut:
    """`nodes` as a function: (weights..., activations...) -> results."""

    graph_module: fx.GraphModule
    weights: list[fx.Node]  # inputs that are the method's weights (engine parameters)
    activations: list[fx.Node]  # inputs computed outside, in graph order of first use
    results: list[fx.Node]  # nodes read outside the cut
    state_reads: list[fx.Node] = field(default_factory=list)  # inputs held by state globals, after the weights


def cut(nodes: Sequence[fx.Node], weights: Mapping[fx.Node, Any],
        in_state: Callable[[fx.Node], Any] | None = None) -> Cut | None:
    """The function computing `nodes`: shape computations they read are recomputed inside, ahead of them. None
    when nothing outside reads any of them (dead code). Inputs for which `in_state` is true are read from a state
    global (onecopy.export.state): placeholders after the weights, before the activations."""
    symbolic: list[fx.Node] = []

    def pull(node: fx.Node) -> None:
        for source in node.all_input_nodes:
            if is_symbolic(source) and source not in symbolic:
                pull(source)
                symbolic.append(source)

    for node in nodes:
        pull(node)
    members = set(symbolic) | set(nodes)
    # In graph order, not the shape computations first: a scalar read from the data (`x.sum().item()`) is one
    # too (a SymFloat), computed from a tensor of the cut itself.
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    body = sorted(members, key=position.__getitem__)
    weight_inputs: list[fx.Node] = []
    state_reads: list[fx.Node] = []
    activations: list[fx.Node] = []
    for node in body:
        for source in node.all_input_nodes:
            if source in members:
                continue
            bucket = (weight_inputs if source in weights
                      else state_reads if in_state is not None and in_state(source) else activations)
            if source not in bucket:
                bucket.append(source)
    results = [
        n for n in nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in members for u in n.users)
    ]
    if not results:
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for source in weight_inputs + state_reads + activations:
        env[source] = graph.placeholder(source.name)
        env[source].meta = dict(source.meta)
    for node in body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in results))
    return Cut(fx.GraphModule(torch.nn.Module(), graph), weight_inputs, activations, results, state_reads)
