"""Which methods a replica may batch, and how requests are joined into one call and split back.

A method is batched only when every input and every output has a dynamic first dimension (a torch.export.Dim),
the same one: then requests joined along it are one call of the same function, and each request's rows of the
outputs are its answer. Any other method runs request by request, and `batch_refusal` says why.
Nothing here needs Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from onecopy.runtime.method_meta import MethodMeta

__all__ = ["batch_refusal", "batch_dim_range", "Group", "group_requests", "split_outputs"]


def batch_refusal(meta: MethodMeta) -> str | None:
    """None when the method can be batched, else why not (one phrase, for logs and `GET /`)."""
    if not meta.inputs:
        return "it takes no inputs"
    tensors = [*meta.inputs, *meta.outputs]
    if any(len(t.shape) == 0 for t in tensors):
        return "an input or output is a scalar"
    first = meta.inputs[0].shape[0]
    if not isinstance(first, str):
        return f"its first input's first dimension is static ({first}); export it with a torch.export.Dim"
    if any(t.shape[0] != first for t in tensors):
        return f"not every input and output has the dynamic dimension '{first}' first"
    if any(first in t.shape[1:] for t in tensors):
        return f"the dynamic dimension '{first}' appears beyond the first dimension too"
    return None


def batch_dim_range(meta: MethodMeta, symbols: Mapping[str, Sequence[int | None]]) -> tuple[int, int | None]:
    """The batch dimension's exported range [min, max] (max None: unbounded)."""
    low, high = symbols.get(str(meta.inputs[0].shape[0]), (None, None))
    return (int(low) if low is not None else 0, int(high) if high is not None else None)


class Group:
    """Requests joined into one call: their inputs concatenated, and the rows each one owns."""

    __slots__ = ("members", "rows")

    def __init__(self) -> None:
        self.members: list[int] = []  # indices into the batch
        self.rows: list[int] = []

    @property
    def total(self) -> int:
        return sum(self.rows)

    def inputs(self, batch: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        if len(self.members) == 1:
            return list(batch[self.members[0]])
        return [np.concatenate([batch[m][i] for m in self.members]) for i in range(len(batch[self.members[0]]))]


def group_requests(batch: Sequence[Sequence[np.ndarray]], dim_range: tuple[int, int | None]) -> list[Group]:
    """Requests that can share a call: same dtypes and trailing shapes, each alone inside the batch dimension's
    range (a request that would fail alone must fail joined too), at most `max` rows together. A request that
    cannot join anything gets a group of its own, and with it the error it would get alone."""
    low, high = dim_range
    groups: dict[object, Group] = {}
    alone: list[Group] = []
    for index, arrays in enumerate(batch):
        key = _signature(arrays)
        rows = int(arrays[0].shape[0]) if key is not None else 0
        if key is None or rows < low or (high is not None and rows > high):
            group = Group()
            group.members.append(index)
            group.rows.append(rows)
            alone.append(group)
            continue
        group = groups.get(key)
        if group is None or (high is not None and group.total + rows > high):
            if group is not None:
                alone.append(group)  # full: closed, a new one takes this signature from here
            group = groups[key] = Group()
        group.members.append(index)
        group.rows.append(rows)
    return alone + list(groups.values())


def _signature(arrays: Sequence[np.ndarray]) -> object:
    if not arrays or any(not isinstance(a, np.ndarray) or a.ndim == 0 for a in arrays):
        return None
    rows = arrays[0].shape[0]
    if any(a.shape[0] != rows for a in arrays):
        return None
    return tuple((a.dtype.str, a.shape[1:]) for a in arrays)


def split_outputs(outputs: Sequence[np.ndarray], rows: Sequence[int]) -> list[list[np.ndarray]]:
    """Each request's rows of a joined call's outputs, as arrays of their own (a view would keep the whole
    batch's outputs alive while any one answer is)."""
    if len(rows) == 1:
        return [list(outputs)]
    bounds = np.cumsum([0, *rows])
    return [[np.array(o[bounds[k]:bounds[k + 1]]) for o in outputs] for k in range(len(rows))]
