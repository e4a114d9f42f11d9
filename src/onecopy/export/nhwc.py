"""The NHWC rewrites: convolution-heavy parts of an image network in channels-last, the layout carried forward
through the ops around them instead of a transpose around every op. Registered and applied by
onecopy.export.rewrites.

`depthwise_nhwc`: IREE runs depthwise convolutions 7-15x slower than ONNX Runtime whatever the flags; in
channels-last (NHWC) a static depthwise convolution becomes one `linalg.depthwise_conv_2d_nhwc_hwc`
(onecopy.export.engine_ops), which IREE runs at ONNX Runtime's single-thread speed; one with a dynamic shape,
unequal strides or a dilation becomes k*k shifted multiply-adds vectorized over channels (3-5x slower than the
op: IREE splits the chain into several dispatches, but still faster than the NCHW convolution). A transpose around every such convolution would cost as much as it saves, so
the NHWC layout is carried forward through the ops around it (per-channel batch norm, activations, squeeze-excite
means and scales, residual adds, 1x1 convolutions as matmuls over channels); a value goes back to NCHW only where
an op that needs it reads it. In a MobileNet, that is one transpose into the first depthwise block and one out of
the last, around a network that is channels-last in between.

`stem_nhwc` (off by default: asked for by name): an image network's stem, a dense convolution over the few channels
of an image (ResNet's 7x7 over RGB), as one matmul over its NHWC patches (im2col), and max pooling as the maximum
of shifted NHWC views, with the layout carried on as above. Why: the configuration tuning keeps for ResNet-18
(channels-last + convolution data tiling, onecopy.delegate.tuning) pads the stem's 3 input channels to the micro
kernel's 16, and pools in NCHW; together 24% of its single-thread time (perf, Xeon). Measured on a Xeon (AVX-512,
AMX), ResNet-18 in that configuration: B=1 fp32 28.1 -> 25.7 ms (the stem alone 27.0, the pooling alone 27.1),
but B=8 fp32 203 -> 229 ms (8 images' patches are 59 MB, written and read again) and B=1 bf16 49 -> 63 ms. So it
is a B=1 fp32 latency option, not a default: a rewrite runs at export, before the batch and precision a load
picks are known. Only for patches of at least `_STEM_PATCH` values: MobileNetV3's 3x3 stem (27 values) ran 19%
slower as a matmul than as the convolution that tuning keeps for it (channels-last).

`max_pool_nhwc` (on by default): max pooling as the maximum of its shifted NHWC views, over channels, the input
transposed to NHWC where it is not already and the layout carried on. Why: IREE pools NCHW in a dispatch of its
own and, in channels-last + conv data tiling, copies the padded input first in one single-threaded dispatch
(0.6 ms of ResNet-18's 1.8 ms of pooling at B=1). Measured on a Xeon (AVX-512, AMX), ResNet-18 with the
space_to_depth stem: channels-last + conv data tiling B=1 25.5 -> 23.7 ms, B=8 177 -> 161 ms; channels-last alone
45.4 -> 43.4 ms; the default flags unchanged (87.7 ms). A ceil-mode pool (its last window reaches past the edge)
and one whose indices are read are left as they are.

When several are asked for, they run as one walk of the graph (`rewrite_nhwc`), so a layout made NHWC by one is
carried on by the others.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx as fx

from onecopy.export.engine_ops import depthwise_nhwc
from onecopy.export.graph_edit import GraphEdit

__all__ = ["rewrite_depthwise_nhwc", "rewrite_max_pool_nhwc", "rewrite_nhwc", "rewrite_stem_nhwc"]

aten = torch.ops.aten

TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]

# Ops that act on each element (their other arguments are Python scalars), so they run as well on NHWC values.
_ELEMENTWISE = {
    aten.relu.default, aten.clamp.default, aten.hardtanh.default, aten.sigmoid.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.gelu.default, aten.silu.default, aten.neg.default, aten.tanh.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
}
_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


class _Rewriter(GraphEdit):
    """Builds NHWC twins of a graph's values; the NCHW originals are replaced where they are read at the end."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.nhwc: dict[fx.Node, fx.Node] = {}  # NCHW value -> its NHWC twin
        self.replaced: list[fx.Node] = []  # originals that every reader now reads through a twin

    def twin(self, origin: fx.Node, value: fx.Node) -> fx.Node:
        """`value` in NHWC: its twin, or a transpose of it."""
        if value not in self.nhwc:
            self.nhwc[value] = self.contiguous(origin, self.emit(origin, aten.permute.default, value, TO_NHWC))
        return self.nhwc[value]

    def done(self, original: fx.Node, twin: fx.Node) -> None:
        self.nhwc[original] = twin
        self.replaced.append(original)

    def finish(self) -> bool:  # type: ignore[override]
        """Give every reader that needs NCHW a transpose of the twin; drop the originals. Whether anything changed."""
        if not self.replaced:  # a graph with nothing to rewrite is left exactly as it was
            return False
        replaced = set(self.replaced)
        for original in self.replaced:
            readers = [u for u in original.users if u not in replaced]
            if not readers:
                continue
            twin = self.nhwc[original]
            with self.graph.inserting_after(twin):
                back = self.graph.call_function(aten.permute.default, (twin, TO_NCHW))
            with self.fake_mode:
                back.meta["val"] = aten.permute.default(twin.meta["val"], TO_NCHW)
            back.meta.update({k: v for k, v in original.meta.items() if k != "val"})
            out = back
            if not back.meta["val"].is_contiguous():  # see `contiguous`
                with self.graph.inserting_after(back):
                    out = self.graph.call_function(aten.clone.default, (back,), {"memory_format": torch.contiguous_format})
                with self.fake_mode:
                    out.meta["val"] = aten.clone.default(back.meta["val"], memory_format=torch.contiguous_format)
                out.meta.update({k: v for k, v in original.meta.items() if k != "val"})
            for reader in readers:
                reader.replace_input_with(original, out)
        for original in reversed(self.replaced):
            if not original.users:
                self.graph.erase_node(original)
        super().finish()
        return True



def _static_4d(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 4 and all(isinstance(d, int) for d in val.shape)


def _conv_args(node: fx.Node) -> tuple | None:
    """(input, weight, bias, stride, padding, dilation, groups) of a static 2-D convolution, else None."""
    if node.target is not aten.convolution.default or not _static_4d(node) or not _static_4d(node.args[0]):
        return None
    x, w, b, stride, padding, dilation, transposed, _, groups = node.args
    if transposed or not _static_4d(w) or len(stride) != 2:
        return None
    return x, w, b, stride, padding, dilation, groups


def _depthwise(r: _Rewriter, node: fx.Node, conv: tuple) -> fx.Node | None:
    x, w, b, stride, padding, dilation, groups = conv
    channels = x.meta["val"].shape[1]
    out_channels, _, kh, kw = w.meta["val"].shape
    if groups != channels or out_channels != channels or groups == 1:
        return None
    _, _, ho, wo = node.meta["val"].shape
    xs = _padded(r, node, r.twin(node, x), padding)
    if _static_4d(x) and stride[0] == stride[1] and all(d == 1 for d in dilation):
        # One NHWC depthwise op (onecopy.export.engine_ops): IREE runs it ~3-5x faster than the multiply-adds.
        kernel = r.emit(node, aten.permute.default, r.emit(node, aten.view.default, w, [channels, kh, kw]), [1, 2, 0])
        acc = r.emit(node, depthwise_nhwc(), r.contiguous(node, xs), r.contiguous(node, kernel), stride[0])
        return acc if b is None else r.emit(node, aten.add.Tensor, acc, b)
    taps = r.emit(node, aten.permute.default, r.emit(node, aten.view.default, w, [channels, kh * kw]), [1, 0])
    acc = None
    for tap, window in enumerate(_windows(r, node, xs, (kh, kw), (ho, wo), stride, dilation)):
        term = r.emit(node, aten.mul.Tensor, window, r.emit(node, aten.select.int, taps, 0, tap))
        acc = term if acc is None else r.emit(node, aten.add.Tensor, acc, term)
    return acc if b is None else r.emit(node, aten.add.Tensor, acc, b)


def _windows(r: _Rewriter, node: fx.Node, xs: fx.Node, kernel: Sequence[int], out: Sequence[int],
             stride: Sequence[int], dilation: Sequence[int]) -> list[fx.Node]:
    """The kh*kw strided views of a padded NHWC value that a window op's output pixels read, kernel row-major:
    view (i, j) holds, for every output pixel, the input under kernel tap (i, j)."""
    (kh, kw), (ho, wo) = kernel, out
    found = []
    for i in range(kh):
        start = i * dilation[0]
        rows = r.emit(node, aten.slice.Tensor, xs, 1, start, start + (ho - 1) * stride[0] + 1, stride[0])
        for j in range(kw):
            start = j * dilation[1]
            found.append(r.emit(node, aten.slice.Tensor, rows, 2, start, start + (wo - 1) * stride[1] + 1, stride[1]))
    return found


def _padded(r: _Rewriter, node: fx.Node, xs: fx.Node, padding: Sequence[int], value: float = 0.0) -> fx.Node:
    if not any(padding):
        return xs
    return r.emit(node, aten.constant_pad_nd.default, xs, [0, 0, padding[1], padding[1], padding[0], padding[0]], value)


# A stem reads fewer channels than this (an image's 3 or 4) ...
_STEM_CHANNELS = 16
# ... through a patch of at least this many values (kh * kw * channels: ResNet's 147, not MobileNet's 27).
_STEM_PATCH = 64


def _stem(r: _Rewriter, node: fx.Node, conv: tuple) -> fx.Node | None:
    """A dense convolution over few channels as one matmul over its NHWC patches (im2col)."""
    x, w, b, stride, padding, dilation, groups = conv
    out_channels, channels, kh, kw = w.meta["val"].shape
    n, _, ho, wo = node.meta["val"].shape
    patch = kh * kw * channels
    if groups != 1 or channels >= _STEM_CHANNELS or patch < _STEM_PATCH:
        return None
    windows = _windows(r, node, _padded(r, node, r.twin(node, x), padding), (kh, kw), (ho, wo), stride, dilation)
    # Each row: the patch of one output pixel, ordered (i, j, channel) as the weight read as [kh, kw, C, O].
    rows = r.emit(node, aten.view.default, r.emit(node, aten.cat.default, windows, 3), [n * ho * wo, patch])
    weight = r.emit(node, aten.view.default, r.contiguous(node, r.emit(node, aten.permute.default, w, [2, 3, 1, 0])),
                    [patch, out_channels])
    y = r.emit(node, aten.mm.default, rows, weight) if b is None else r.emit(node, aten.addmm.default, b, rows, weight)
    return r.emit(node, aten.view.default, y, [n, ho, wo, out_channels])


# The channel block conv data tiling pads a convolution's input channels to (the f32 micro kernel's width): a strided
# convolution whose s x s blocks of channels fit in it reads no more padded channels after space-to-depth.


def _max_pool(r: _Rewriter, node: fx.Node, *, transpose: bool) -> fx.Node | None:
    """Max pooling (its indices unread) as the maximum of shifted NHWC views, over channels: of an NHWC value, or,
    with `transpose`, of any static 4-D value (transposed to NHWC first)."""
    x, kernel, *rest = node.args
    stride, padding, dilation, ceil_mode = (list(rest) + [None] * 4)[:4]
    if (not (x in r.nhwc or (transpose and _static_4d(x))) or ceil_mode or len(kernel) != 2
            or any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users)):
        return None
    _, _, ho, wo = node.meta["val"][0].shape
    xs = _padded(r, node, r.twin(node, x), padding or [0, 0], float("-inf"))
    windows = _windows(r, node, xs, kernel, (ho, wo), stride or kernel, dilation or [1, 1])
    y = windows[0]
    for window in windows[1:]:
        y = r.emit(node, aten.maximum.default, y, window)
    return y


def _pointwise(r: _Rewriter, node: fx.Node, conv: tuple) -> fx.Node | None:
    """A 1x1 convolution of an NHWC value: a matmul over channels."""
    x, w, b, stride, padding, dilation, groups = conv
    out_channels, channels, kh, kw = w.meta["val"].shape
    if x not in r.nhwc or (kh, kw) != (1, 1) or groups != 1 or any(s != 1 for s in stride) or any(padding):
        return None
    n, _, h, wd = node.meta["val"].shape
    rows = r.emit(node, aten.view.default, r.contiguous(node, r.nhwc[x]), [n * h * wd, channels])
    weight = r.emit(node, aten.permute.default, r.emit(node, aten.view.default, w, [out_channels, channels]), [1, 0])
    y = r.emit(node, aten.mm.default, rows, weight) if b is None else r.emit(node, aten.addmm.default, b, rows, weight)
    return r.emit(node, aten.view.default, y, [n, h, wd, out_channels])


def _batch_norm(r: _Rewriter, node: fx.Node) -> fx.Node | None:
    """Eval-mode batch norm of an NHWC value, whose per-channel vectors broadcast over the last axis."""
    x, weight, bias, mean, var, _, eps = node.args
    if x not in r.nhwc or any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None
    scale = r.emit(node, aten.rsqrt.default, r.emit(node, aten.add.Tensor, var, eps))
    if weight is not None:
        scale = r.emit(node, aten.mul.Tensor, scale, weight)
    y = r.emit(node, aten.mul.Tensor, r.emit(node, aten.sub.Tensor, r.nhwc[x], mean), scale)
    return y if bias is None else r.emit(node, aten.add.Tensor, y, bias)


def _elementwise(r: _Rewriter, node: fx.Node) -> fx.Node | None:
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if not tensors or not any(a in r.nhwc for a in tensors) or not _static_4d(node):
        return None
    if node.target not in _BINARY and tensors != [node.args[0]]:
        return None
    # Another operand is taken along if it is NHWC already or broadcasts over the image (a squeeze-excite scale
    # [N, C, 1, 1]): its transpose is free. A full NCHW image would need a real one: leave the op as it is.
    for a in tensors:
        if a not in r.nhwc and not (_static_4d(a) and tuple(a.meta["val"].shape[2:]) == (1, 1)):
            return None
    args = [r.twin(node, a) if isinstance(a, fx.Node) else a for a in node.args]
    return r.emit(node, node.target, *args, **node.kwargs)


def _mean(r: _Rewriter, node: fx.Node) -> None:
    x, dims, *rest = node.args
    if x not in r.nhwc or {d % 4 for d in dims} != {2, 3} or len(dims) != 2:
        return
    kwargs = dict(node.kwargs)
    keepdim = bool(rest[0]) if rest else bool(kwargs.pop("keepdim", False))
    y = r.emit(node, aten.mean.dim, r.nhwc[x], [1, 2], keepdim, **kwargs)
    if keepdim:
        r.done(node, y)
    else:  # [N, C] in either layout
        node.replace_all_uses_with(y)
        r.graph.erase_node(node)


def rewrite_nhwc(gm: fx.GraphModule, rewrites: Collection[str]) -> bool:
    """The NHWC rewrites named (`depthwise_nhwc`, `max_pool_nhwc`, `stem_nhwc`), in one walk: the layout one makes
    NHWC is carried
    through the ops around it (batch norms, elementwise ops, means, 1x1 convolutions) for all of them. Edits `gm`
    in place; returns whether it changed anything."""
    r = _Rewriter(gm)
    if r.fake_mode is None or not rewrites:
        return False
    depthwise, stem, pool = ("depthwise_nhwc" in rewrites, "stem_nhwc" in rewrites,
                             "max_pool_nhwc" in rewrites)
    for node in list(r.graph.nodes):
        if node.op != "call_function":
            continue
        conv = _conv_args(node)
        twin = None
        if conv is not None:
            twin = ((depthwise and _depthwise(r, node, conv)) or _pointwise(r, node, conv)
                    or (stem and _stem(r, node, conv)) or None)
        elif node.target is aten._native_batch_norm_legit_no_training.default or (
                (stem or pool) and node.target is aten.max_pool2d_with_indices.default):
            # Ops with several results, of which only the first is read: its reader (getitem 0) becomes the twin.
            batch_norm = node.target is aten._native_batch_norm_legit_no_training.default
            twin = _batch_norm(r, node) if batch_norm else _max_pool(r, node, transpose=pool)
            if twin is not None:
                r.replaced.append(node)
                for reader in list(node.users):
                    r.done(reader, twin)
                continue
        elif node.target is aten.mean.dim:
            _mean(r, node)
        elif node.target in _ELEMENTWISE:
            twin = _elementwise(r, node)
        if twin is not None:
            r.done(node, twin)
    return r.finish()


def rewrite_depthwise_nhwc(gm: fx.GraphModule) -> bool:
    """Depthwise convolutions as one NHWC op or shifted multiply-adds, the layout carried through the ops around them."""
    return rewrite_nhwc(gm, ("depthwise_nhwc",))


def rewrite_max_pool_nhwc(gm: fx.GraphModule) -> bool:
    """Max pooling as the maximum of shifted NHWC views, the layout carried on."""
    return rewrite_nhwc(gm, ("max_pool_nhwc",))


def rewrite_stem_nhwc(gm: fx.GraphModule) -> bool:
    """An image network's stem convolution as an NHWC matmul, and max pooling in NHWC, the layout carried on."""
    return rewrite_nhwc(gm, ("stem_nhwc",))
