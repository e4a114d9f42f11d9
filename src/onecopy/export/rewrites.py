"""Graph rewrites of a decomposed method, applied before lowering, for what IREE's CPU code generation does badly:
which there are (`REWRITES`: the NHWC ones in onecopy.export.nhwc, space_to_depth in
onecopy.export.space_to_depth), which run by default, and applying them to a program's methods.

- `space_to_depth` (default on): a strided convolution over few channels (an image's stem) as a stride-1
  convolution over the image's blocks stacked on channels, so conv data tiling pads no channels.
- `depthwise_nhwc` (default on): depthwise convolutions as one channels-last op (or shifted multiply-adds), the
  layout carried through the network around them.
- `max_pool_nhwc` (default on): max pooling as the maximum of shifted channels-last views.
- `stem_nhwc` (asked for by name): an image network's stem as a channels-last matmul, its max pooling
  channels-last; faster at B=1 in fp32 only.
- `split_softmax` (default on): a softmax (attention's safe one too) as max, sum of exponentials and a scale by
  the reciprocal, which IREE compiles 2-3x faster than its own softmax op (onecopy.export.softmax).

Every rewrite keeps the method's results (tests/export/test_rewrites.py checks each against torch on random inputs)
and leaves shapes it cannot prove static alone (space_to_depth: all dimensions but the batch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from onecopy.export.nhwc import rewrite_depthwise_nhwc, rewrite_max_pool_nhwc, rewrite_nhwc, rewrite_stem_nhwc
from onecopy.export.softmax import rewrite_split_softmax
from onecopy.export.space_to_depth import rewrite_space_to_depth

__all__ = ["REWRITES", "DEFAULT_REWRITES", "REPLACED_OPS", "apply_rewrites", "decomposition_table",
           "rewrite_depthwise_nhwc", "rewrite_max_pool_nhwc", "rewrite_nhwc", "rewrite_space_to_depth",
           "rewrite_split_softmax", "rewrite_stem_nhwc"]

log = logging.getLogger("onecopy")

REWRITES: Mapping[str, Callable[[fx.GraphModule], bool]] = {
    "depthwise_nhwc": rewrite_depthwise_nhwc, "stem_nhwc": rewrite_stem_nhwc, "space_to_depth": rewrite_space_to_depth,
    "max_pool_nhwc": rewrite_max_pool_nhwc, "split_softmax": rewrite_split_softmax,
}
DEFAULT_REWRITES: tuple[str, ...] = ("space_to_depth", "depthwise_nhwc", "max_pool_nhwc", "split_softmax")
# The ops each rewrite replaces by others. A method whose Partitioner leaves one of them on the host (`skip_ops`)
# is not rewritten: the user asked for that op, and after the rewrite it would no longer be there to skip.
REPLACED_OPS: Mapping[str, frozenset[str]] = {
    "depthwise_nhwc": frozenset({"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default"}),
    "stem_nhwc": frozenset({"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default",
                            "aten.max_pool2d_with_indices.default"}),
    "space_to_depth": frozenset({"aten.convolution.default"}),
    # The pool, and what the walk carries its NHWC layout into (batch norms, 1x1 convolutions).
    "max_pool_nhwc": frozenset({"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default",
                                "aten.max_pool2d_with_indices.default"}),
    "split_softmax": frozenset({"aten._softmax.default", "aten._safe_softmax.default"}),
}
_NHWC = ("depthwise_nhwc", "stem_nhwc", "max_pool_nhwc")


def _applied(method: str, rewrites: Sequence[str], skipped: Collection[str], say: bool = False) -> list[str]:
    """Which of `rewrites` run on `method`: not those that replace an op its `skip_ops` leaves on the host."""
    applied = []
    for rewrite in rewrites:
        kept = set(skipped) & REPLACED_OPS.get(rewrite, frozenset())
        if kept:
            if say:
                log.info("method '%s': rewrite %s not applied: skip_ops leaves %s on the host", method, rewrite,
                         ", ".join(sorted(kept)))
            continue
        applied.append(rewrite)
    return applied


def decomposition_table(method: str, rewrites: Sequence[str], skip_ops: Collection[str] = ()) -> Any:
    """The table to decompose `method` to core ATen with, before `rewrites` run: torch's default, but for the ops a
    rewrite that will run takes whole (split_softmax: attention's `_safe_softmax`, which torch would decompose into
    a softmax and a four-op masking). None: torch's default as it is."""
    if "split_softmax" not in _applied(method, rewrites, skip_ops):
        return None
    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten._safe_softmax.default, None)
    return table


def apply_rewrites(methods: Mapping[str, Any], rewrites: Mapping[str, Sequence[str]],
                   skip_ops: Mapping[str, Collection[str]] | None = None) -> None:
    """Apply each method's rewrites (method name -> rewrite names) to its decomposed program, in place, except
    those that replace an op the method's `skip_ops` (method name -> op names) leaves on the host.
    space_to_depth runs first (what it makes is still a convolution, which the others may then take); the NHWC
    rewrites run as one walk; split_softmax last."""
    for name, ep in methods.items():
        applied = _applied(name, rewrites.get(name, ()), (skip_ops or {}).get(name, ()), say=True)
        if "space_to_depth" in applied:
            rewrite_space_to_depth(ep.graph_module)
        nhwc = [rewrite for rewrite in applied if rewrite in _NHWC]
        if nhwc:
            rewrite_nhwc(ep.graph_module, nhwc)
        if "split_softmax" in applied:
            rewrite_split_softmax(ep.graph_module)
