"""The space_to_depth rewrite, registered and applied by onecopy.export.rewrites.

`space_to_depth` (on by default): a strided convolution over few channels (an image's stem: ResNet's 7x7 stride 2
over RGB) as a stride-1 convolution over the image's s x s blocks stacked on channels (space-to-depth, as in
TResNet's and EfficientNet-TPU's stems), its kernel zero-padded to a multiple of s. Why: conv data tiling (the
configuration tuning keeps for ResNet-18) pads a convolution's input channels to the micro kernel's 16, so over 3
channels 13 of every 16 multiply-adds are padding; after space-to-depth the convolution reads 12 channels through
a 4x4 kernel: 3.1x fewer multiply-adds run (1.3x more are real: the kernel's padding row and column). Measured on
a Xeon (AVX-512, AMX), ResNet-18 3x224x224, 2 threads: channels-last + conv data tiling B=1 29.7 -> 25.3 ms (the stem
5.55 -> 1.92 ms, plus 0.36 ms for the block transpose), B=8 202 -> 172 ms; the default configuration 97 -> 87 ms;
channels-last alone 42.7 -> 43.3 ms (it does not pad channels). Only where the s x s blocks still fit the micro kernel's
channel block (channels * s * s <= 16) and the kernel, padded to whole blocks, grows by at most half.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from onecopy.export.graph_edit import GraphEdit

__all__ = ["rewrite_space_to_depth"]

aten = torch.ops.aten


# The channel block conv data tiling pads a convolution's input channels to (the f32 micro kernel's width): a strided
# convolution whose s x s blocks of channels fit in it reads no more padded channels after space-to-depth.
_CHANNEL_BLOCK = 16
# ... and whose kernel, padded to whole blocks, grows by at most this much: ResNet's 7x7 becomes 8x8 (1.31x);
# MobileNetV3's 3x3 stride 2 would become 4x4 (1.78x), and measured 10% slower there (tuning keeps channels-last
# for it, which pads no channels).
_KERNEL_GROWTH = 1.5


def _space_to_depth(r: GraphEdit, node: fx.Node) -> fx.Node | None:
    """A strided convolution over few channels as a stride-1 convolution over the input's s x s blocks stacked on
    channels (channel c * s * s + p * s + q of block (A, B) is pixel (A * s + p, B * s + q) of channel c), with the
    kernel zero-padded to k2 * s (k2 = ceil(k / s)) and regrouped the same way. The batch may be dynamic."""
    if node.target is not aten.convolution.default:
        return None
    x, w, b, stride, padding, dilation, transposed, _, groups = node.args
    x_val, w_val, y_val = x.meta.get("val"), w.meta.get("val"), node.meta.get("val")
    if (transposed or groups != 1 or len(stride) != 2 or stride[0] != stride[1] or stride[0] < 2
            or any(d != 1 for d in dilation) or not all(isinstance(v, torch.Tensor) and v.dim() == 4
                                                        for v in (x_val, w_val, y_val))
            or not all(isinstance(d, int) for d in (*x_val.shape[1:], *w_val.shape, *y_val.shape[1:]))):
        return None
    s = stride[0]
    out_channels, channels, kh, kw = w_val.shape
    _, _, h, wd = x_val.shape
    _, _, ho, wo = y_val.shape
    rows, cols = _Extent.of(h, kh, padding[0], ho, s), _Extent.of(wd, kw, padding[1], wo, s)
    if (channels * s * s > _CHANNEL_BLOCK or kh < s or kw < s or rows is None or cols is None
            or (rows.taps * s) * (cols.taps * s) > _KERNEL_GROWTH * kh * kw):
        return None
    # The image to whole blocks (padded at its start where the grid is not the image's own, cut or padded at its end).
    xp, pads = x, [cols.front, max(0, cols.back), rows.front, max(0, rows.back)]
    if any(pads):  # (a crop alone pads nothing)
        xp = r.emit(node, aten.constant_pad_nd.default, xp, pads, 0.0)
    if cols.back < 0:
        xp = r.emit(node, aten.slice.Tensor, xp, 3, 0, s * cols.blocks)
    if rows.back < 0:
        xp = r.emit(node, aten.slice.Tensor, xp, 2, 0, s * rows.blocks)
    # The kernel padded to whole blocks; `shift` zero taps in front move its grid onto the image's.
    wp = w if (rows.shift, rows.taps * s, cols.shift, cols.taps * s) == (0, kh, 0, kw) else r.emit(
        node, aten.constant_pad_nd.default, w,
        [cols.shift, cols.taps * s - kw - cols.shift, rows.shift, rows.taps * s - kh - rows.shift], 0.0)
    # The input and the kernel regrouped the same way, so that block channel (c, p, q) meets kernel tap (c, p, q).
    xs = _blocks(r, node, r.contiguous(node, xp), -1, channels, s, rows.blocks, cols.blocks)
    if (rows.before, rows.after, cols.before, cols.after) != (0, 0, 0, 0):
        # The convolution's padding, in whole blocks, on the small blocked tensor (not on the image).
        xs = r.emit(node, aten.constant_pad_nd.default, xs, [cols.before, cols.after, rows.before, rows.after], 0.0)
    ws = _blocks(r, node, wp, out_channels, channels, s, rows.taps, cols.taps)
    return r.emit(node, aten.convolution.default, xs, ws, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


@dataclass(frozen=True)
class _Extent:
    """One spatial dimension of the rewrite: a convolution with kernel k, padding p and stride s over n pixels, giving
    o outputs, as a stride-1 convolution with `taps` taps over blocks of s pixels.

    The block grid is put on the image's own (block A holds pixels A * s ... A * s + s - 1) by `shift` zero taps in
    front of the kernel, where that costs no extra block of taps: then the padding is whole blocks, added to the
    small blocked tensor (`before`, `after`), and the image goes into the block transpose as it is. ResNet's 224 x
    224 stem at B=8 (Xeon, IREE's per-dispatch profile): the padded copy of the image (0.5-0.9 ms) is gone and the
    transpose IREE had split into 105,800 workgroups of one pixel each (3.8 ms: the padding channels' fill set its
    grid) takes 0.95 ms, plus 0.39 for padding the blocks; through onecopy, interleaved, B=8 140.9 -> 138.9 ms, B=1
    20.96 -> 20.83 ms.
    Elsewhere `front` pixels of padding stay on the image. `blocks`: the image's blocks read (after `front`;
    `back` > 0 pixels padded at its end, < 0 cut)."""

    shift: int
    taps: int
    front: int
    back: int
    blocks: int
    before: int
    after: int

    @staticmethod
    def of(n: int, k: int, p: int, o: int, s: int) -> _Extent | None:
        taps = -(-k // s)
        shift = -p % s
        if -(-(k + shift) // s) != taps:  # the shift would cost a block of taps: keep the padded grid
            shift = 0
        front, before = (p + shift) % s, (p + shift) // s
        read = o + taps - 1  # blocks the output reads, padding included
        image = min(s * (read - before), n + front)  # pixels of the (front-padded) image read
        if image <= 0:
            return None
        blocks = -(-image // s)
        return _Extent(shift, taps, front, s * blocks - n - front, blocks, before, read - before - blocks)


def _blocks(r: GraphEdit, node: fx.Node, value: fx.Node, lead: int, channels: int, s: int, height: int,
            width: int) -> fx.Node:
    """`value` [lead, channels, height * s, width * s] as [lead, channels * s * s, height, width]: each s x s block
    of a channel stacked on channels, channel c * s * s + p * s + q holding the block's pixel (p, q)."""
    split = r.emit(node, aten.view.default, value, [lead, channels, height, s, width, s])
    return r.emit(node, aten.view.default,
                  r.contiguous(node, r.emit(node, aten.permute.default, split, [0, 1, 3, 5, 2, 4])),
                  [lead, channels * s * s, height, width])


def rewrite_space_to_depth(gm: fx.GraphModule) -> bool:
    """Strided convolutions over few channels (image stems) as stride-1 convolutions over space-to-depth blocks.
    Edits `gm` in place; returns whether it changed anything."""
    return GraphEdit(gm).replace_each(_space_to_depth)
