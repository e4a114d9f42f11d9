"""The split_softmax rewrite, registered and applied by onecopy.export.rewrites.

`split_softmax` (on by default): a softmax as the three passes IREE compiles well: the maximum of each row, the
sum of its exponentials, and the exponentials scaled by that sum's reciprocal. Why: IREE raises a softmax (torch's
`_softmax`, or the same `exp(x - max) / sum` written out) to its own softmax op, whose CPU code is 2-3x slower than
the three passes; scaling by the reciprocal keeps the pattern from being raised. The safe softmax of attention
(`_safe_softmax`, what scaled_dot_product_attention decomposes to: rows that are all -inf give 0, not NaN) costs
IREE a fourth pass besides, a boolean reduction over the scores; here those rows are told by their maximum alone.
Measured on a Xeon (AVX-512), 2 threads, iree-benchmark-module, [16, 4, 128, 128] fp32: IREE's softmax 2.73 ms,
safe softmax 3.05, split 1.02; [1, 4, 128, 128]: 0.35 / 0.30 / 0.21 (calling thread alone: 0.17 / 0.21 / 0.08);
a decode step's [1, 4, 1, 256]: 0.10 / 0.09 / 0.11 (one more dispatch where there is nothing to split).

The results are torch's but for rounding (a multiply by the reciprocal instead of a division: 1 ulp): half and
bfloat16 inputs are computed in float32, as torch's own decomposition does.
"""

from __future__ import annotations

import torch
from torch import fx

from onecopy.export.graph_edit import GraphEdit

__all__ = ["SOFTMAX_OPS", "rewrite_split_softmax"]

aten = torch.ops.aten

# What the rewrite replaces. `_safe_softmax` reaches it only when the method's decomposition keeps it
# (onecopy.export.rewrites.decomposition_table): by default torch decomposes it into a softmax and a masking.
SOFTMAX_OPS = (aten._softmax.default, aten._safe_softmax.default)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _split(r: GraphEdit, node: fx.Node) -> fx.Node | None:
    """`node` (a softmax) as max, sum of exponentials, and the exponentials times the sum's reciprocal."""
    if node.target not in SOFTMAX_OPS:
        return None
    x, dim = node.args[0], node.args[1]
    x_val, y_val = x.meta.get("val"), node.meta.get("val")
    if not isinstance(x_val, torch.Tensor) or not isinstance(y_val, torch.Tensor) or x_val.dim() == 0:
        return None
    if not x_val.dtype.is_floating_point or any(isinstance(d, int) and d == 0 for d in x_val.shape):
        return None  # an empty softmax, or one torch computes otherwise: left as it is
    safe = node.target is aten._safe_softmax.default
    compute = torch.float32 if x_val.dtype in _LOW_PRECISION else x_val.dtype
    if safe and (dtype := node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")) is not None:
        compute = torch.float32 if dtype in _LOW_PRECISION else dtype
    dim = dim % x_val.dim()

    def emit(target, *args, **kwargs):
        return r.emit(node, target, *args, **kwargs)

    if x_val.dtype != compute:
        x = emit(aten._to_copy.default, x, dtype=compute)
    top = emit(aten.amax.default, x, [dim], True)
    if safe:  # a row of -inf only has -inf for its maximum: shifted by 0 instead, its exponentials are all 0
        zero = emit(aten.scalar_tensor.default, 0.0, dtype=compute)
        top = emit(aten.where.self, emit(aten.eq.Scalar, top, float("-inf")), zero, top)
    e = emit(aten.exp.default, emit(aten.sub.Tensor, x, top))
    total = emit(aten.sum.dim_IntList, e, [dim], True)
    scale = emit(aten.reciprocal.default, total)
    if safe:  # ... and their sum 0 (any other row sums to at least 1, its maximum's exp(0)): scaled by 0, not inf
        scale = emit(aten.where.self, emit(aten.eq.Scalar, total, 0.0), zero, scale)
    y = emit(aten.mul.Tensor, e, scale)
    if y_val.dtype != compute:
        y = emit(aten._to_copy.default, y, dtype=y_val.dtype)
    return y


def rewrite_split_softmax(gm: fx.GraphModule) -> bool:
    """Every softmax of `gm` (torch's `_softmax` and `_safe_softmax`) as three passes. Edits `gm` in place;
    returns whether it changed anything."""
    return GraphEdit(gm).replace_each(_split)
