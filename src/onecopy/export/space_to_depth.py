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

import torch
import torch.fx as fx

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
    k2h, k2w = -(-kh // s), -(-kw // s)
    if channels * s * s > _CHANNEL_BLOCK or kh < s or kw < s or (k2h * s) * (k2w * s) > _KERNEL_GROWTH * kh * kw:
        return None
    # The rows and columns the output reads, from the top-left of the padded input: whole blocks.
    rows, cols = s * (ho + k2h - 1), s * (wo + k2w - 1)
    ph, pw = padding
    bottom, right = rows - h - ph, cols - wd - pw  # < 0: the input reaches past the last block read, crop it
    xp = r.emit(node, aten.constant_pad_nd.default, x, [pw, max(0, right), ph, max(0, bottom)], 0.0)
    if right < 0:
        xp = r.emit(node, aten.slice.Tensor, xp, 3, 0, cols)
    if bottom < 0:
        xp = r.emit(node, aten.slice.Tensor, xp, 2, 0, rows)
    wp = w if (k2h * s, k2w * s) == (kh, kw) else r.emit(
        node, aten.constant_pad_nd.default, w, [0, k2w * s - kw, 0, k2h * s - kh], 0.0)
    # The input and the kernel regrouped the same way, so that block channel (c, p, q) meets kernel tap (c, p, q).
    xs = _blocks(r, node, r.contiguous(node, xp), -1, channels, s, rows // s, cols // s)
    ws = _blocks(r, node, wp, out_channels, channels, s, k2h, k2w)
    return r.emit(node, aten.convolution.default, xs, ws, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


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
    r = GraphEdit(gm)
    if r.fake_mode is None:
        return False
    changed = False
    for node in list(r.graph.nodes):
        if node.op == "call_function":
            y = _space_to_depth(r, node)
            if y is not None:
                y.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                node.replace_all_uses_with(y)
                r.graph.erase_node(node)
                changed = True
    if changed:
        r.finish()
    return changed
