"""Indices the engine reads or writes memory at, kept in range: IREE checks none.

A gather with an index past its table (an embedding fed a token id past the vocabulary, `index_select`, `gather`,
`x[idx]`) reads whatever memory lies there: garbage results, or a segfault (an Embedding(50, 16) given 10**9
crashed the process; 70 or -1 came back as garbage). A scatter (`index_put`, `index_copy`, `scatter`, ...) writes
there and corrupts the heap. torch eager raises IndexError for both. Two guards, both at export:

- `input_bounds`: a method input that reaches an index argument unchanged (through views, reshapes and integer
  casts) gets the values its table allows recorded in `MethodDef.input_bounds`, which the runtime checks before
  every call (`onecopy.runtime.arguments.check_bounds`): a bad token id is refused with an error, as eager refuses
  it.
- `guard_indices`: every index argument of those ops is wrapped into range in the engine's graph (`remainder` by
  the indexed dimension's size), so an index computed inside the method (which no input check can see) reads or
  writes a row of its table instead of foreign memory. For the ops that take negative indices (`x[idx]`,
  `index_put`) the wrap is torch's own meaning of them (-1: the last row); for the others eager would have raised,
  and the engine gives a row of the table: wrong, never a crash.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import fx

__all__ = ["guard_indices", "input_bounds"]

aten = torch.ops.aten

# op -> (position of the indexed tensor, position of the dim (None: dim 0), position of the index argument,
# whether the index is a list of per-dimension indices, whether negative indices are valid)
_PER_DIMENSION = (0, None, 1, True, True)  # x[i, j], x.index_put((i, j), v): torch takes negative indices
_ALONG_DIM = (0, 1, 2, False, False)  # op(self, dim, index, ...)
_INDEXING = {
    aten.embedding.default: (0, None, 1, False, False),
    aten.index.Tensor: _PER_DIMENSION,
    aten.index_put.default: _PER_DIMENSION,
    aten.index_put_.default: _PER_DIMENSION,
    **dict.fromkeys((
        aten.index_select.default, aten.gather.default, aten.index_copy.default, aten.index_copy_.default,
        aten.index_add.default, aten.index_add_.default, aten.scatter.src, aten.scatter.value, aten.scatter_.src,
        aten.scatter_.value, aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two,
        aten.scatter_reduce_.two,
    ), _ALONG_DIM),
}

# Ops an index passes through unchanged in value: what an input reaching an index argument through them holds is
# what indexes the table.
_PASS_THROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints, aten.expand.default,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten._to_copy.default, aten.to.dtype,
    aten.permute.default, aten.t.default, aten.transpose.int,
}


def _indices(node: fx.Node) -> Iterator[tuple[int | None, fx.Node, int, bool, int | None]]:
    """(argument position, index node, the indexed dimension's size, negatives valid, list position) for each
    integer index argument of `node` whose dimension has a static size."""
    table_at, dim_at, index_at, listed, negatives = _INDEXING[node.target]
    table = node.args[table_at] if len(node.args) > table_at else None
    if not isinstance(table, fx.Node) or not isinstance(table.meta.get("val"), torch.Tensor):
        return
    shape = table.meta["val"].shape
    if len(node.args) <= index_at:
        return
    index = node.args[index_at]
    entries = list(enumerate(index)) if listed else [(None, index)]
    for position, entry in entries:
        if not isinstance(entry, fx.Node) or not isinstance(entry.meta.get("val"), torch.Tensor):
            continue
        if entry.meta["val"].dtype == torch.bool or entry.meta["val"].is_floating_point():
            continue  # a mask selects, it does not index
        dim = position if listed else (node.args[dim_at] if dim_at is not None and len(node.args) > dim_at else 0)
        if not isinstance(dim, int) or not shape:
            continue
        size = shape[dim % len(shape)]
        if isinstance(size, int) and size > 0:  # an empty table has no row to wrap into (nor to read)
            yield index_at, entry, size, negatives, position


def guard_indices(graph: fx.Graph) -> int:
    """Wrap every integer index argument of an indexing op of `graph` into range (`remainder` by the indexed
    dimension's size); how many it wrapped."""
    wrapped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _INDEXING:
            continue
        args = list(node.args)
        for index_at, entry, size, _, position in list(_indices(node)):
            with graph.inserting_before(node):
                safe = graph.call_function(aten.remainder.Scalar, (entry, size))
            safe.meta = dict(entry.meta)
            if position is None:
                args[index_at] = safe
            else:
                listed = list(args[index_at])
                listed[position] = safe
                args[index_at] = listed
            wrapped += 1
        node.args = tuple(args)
    return wrapped


def input_bounds(graph: fx.Graph, inputs: Sequence[fx.Node]) -> dict[int, list[int]]:
    """Input position -> [low, high] of the values the inputs `inputs` (the method's, in order) may hold where
    they reach an indexing op's index unchanged; an input indexing several tables gets the tightest range."""
    bounds: dict[int, list[int]] = {}
    sources: Mapping[fx.Node, int] = {node: i for i, node in enumerate(inputs)}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _INDEXING:
            continue
        for _, entry, size, negatives, _ in _indices(node):
            origin = _origin(entry)
            if origin not in sources:
                continue
            low, high = (-size if negatives else 0), size - 1
            i = sources[origin]
            old = bounds.get(i)
            bounds[i] = [low, high] if old is None else [max(old[0], low), min(old[1], high)]
    return bounds


def _origin(node: fx.Node) -> fx.Node | None:
    """The node whose values `node` holds unchanged (through `_PASS_THROUGH` ops, integer casts only)."""
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        source = node.args[0]
        if not isinstance(source, fx.Node):
            return None
        value = source.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return None  # a float cast to an index is not the input's values
        node = source
    return node
