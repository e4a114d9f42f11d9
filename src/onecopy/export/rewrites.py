"""Graph rewrites of a decomposed method, applied before lowering, for what IREE's CPU code generation does badly.

`depthwise_nhwc`: IREE runs depthwise convolutions 7-15x slower than ONNX Runtime whatever the flags; in
channels-last (NHWC) a static depthwise convolution becomes one `linalg.depthwise_conv_2d_nhwc_hwc`
(onecopy.export.engine_ops), which IREE runs at ONNX Runtime's single-thread speed; one with a dynamic shape,
unequal strides or a dilation becomes k*k shifted multiply-adds vectorized over channels (3-5x slower than the
op: IREE splits the chain into several dispatches, but still faster than the NCHW convolution). A transpose around every such convolution would cost as much as it saves, so
the NHWC layout is carried forward through the ops around it (per-channel batch norm, activations, squeeze-excite
means and scales, residual adds, 1x1 convolutions as matmuls over channels); a value goes back to NCHW only where
an op that needs it reads it. In a MobileNet, that is one transpose into the first depthwise block and one out of
the last, around a network that is channels-last in between.

Every rewrite keeps the method's results (tests/export/test_rewrites.py checks each against torch on random inputs)
and leaves shapes it cannot prove static alone.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from onecopy.export.engine_ops import depthwise_nhwc

__all__ = ["REWRITES", "DEFAULT_REWRITES", "REPLACED_OPS", "apply_rewrites", "rewrite_depthwise_nhwc"]

log = logging.getLogger("onecopy")

aten = torch.ops.aten

TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]

# Ops that act on each element (their other arguments are Python scalars), so they run as well on NHWC values.
_ELEMENTWISE = {
    aten.relu.default, aten.clamp.default, aten.hardtanh.default, aten.sigmoid.default, aten.hardswish.default,
    aten.hardsigmoid.default, aten.gelu.default, aten.silu.default, aten.neg.default, aten.tanh.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
}
_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


class _Rewriter:
    """Builds NHWC twins of a graph's values; the NCHW originals are replaced where they are read at the end."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        placeholders = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode(placeholders)
        self.nhwc: dict[fx.Node, fx.Node] = {}  # NCHW value -> its NHWC twin
        self.replaced: list[fx.Node] = []  # originals that every reader now reads through a twin

    def emit(self, origin: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """A new node computing `target(*args)` before `origin`, with the metadata the exporter reads."""
        with self.graph.inserting_before(origin):
            node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in origin.meta:
                node.meta[key] = origin.meta[key]
        return node

    def contiguous(self, origin: fx.Node, node: fx.Node) -> fx.Node:
        # A transposed view is not contiguous for torch: the partitions are traced again at lowering, where
        # `view` on it fails. To IREE a clone is a value, not a copy.
        if node.meta["val"].is_contiguous():
            return node
        return self.emit(origin, aten.clone.default, node, memory_format=torch.contiguous_format)

    def twin(self, origin: fx.Node, value: fx.Node) -> fx.Node:
        """`value` in NHWC: its twin, or a transpose of it."""
        if value not in self.nhwc:
            self.nhwc[value] = self.contiguous(origin, self.emit(origin, aten.permute.default, value, TO_NHWC))
        return self.nhwc[value]

    def done(self, original: fx.Node, twin: fx.Node) -> None:
        self.nhwc[original] = twin
        self.replaced.append(original)

    def finish(self) -> bool:
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
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
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
    xs = r.twin(node, x)
    if any(padding):
        xs = r.emit(node, aten.constant_pad_nd.default, xs, [0, 0, padding[1], padding[1], padding[0], padding[0]])
    if _static_4d(x) and stride[0] == stride[1] and all(d == 1 for d in dilation):
        # One NHWC depthwise op (onecopy.export.engine_ops): IREE runs it ~3-5x faster than the multiply-adds.
        kernel = r.emit(node, aten.permute.default, r.emit(node, aten.view.default, w, [channels, kh, kw]), [1, 2, 0])
        acc = r.emit(node, depthwise_nhwc(), r.contiguous(node, xs), r.contiguous(node, kernel), stride[0])
        return acc if b is None else r.emit(node, aten.add.Tensor, acc, b)
    taps = r.emit(node, aten.permute.default, r.emit(node, aten.view.default, w, [channels, kh * kw]), [1, 0])
    acc = None
    for i in range(kh):
        rows = r.emit(node, aten.slice.Tensor, xs, 1, i * dilation[0], i * dilation[0] + (ho - 1) * stride[0] + 1, stride[0])
        for j in range(kw):
            window = r.emit(node, aten.slice.Tensor, rows, 2, j * dilation[1], j * dilation[1] + (wo - 1) * stride[1] + 1, stride[1])
            term = r.emit(node, aten.mul.Tensor, window, r.emit(node, aten.select.int, taps, 0, i * kw + j))
            acc = term if acc is None else r.emit(node, aten.add.Tensor, acc, term)
    return acc if b is None else r.emit(node, aten.add.Tensor, acc, b)


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


def rewrite_depthwise_nhwc(gm: fx.GraphModule) -> bool:
    """Depthwise convolutions as shifted multiply-adds in NHWC, with the layout carried through the ops around them.
    Edits `gm` in place; returns whether it changed anything."""
    r = _Rewriter(gm)
    if r.fake_mode is None:
        return False
    for node in list(r.graph.nodes):
        if node.op != "call_function":
            continue
        conv = _conv_args(node)
        twin = None
        if conv is not None:
            twin = _depthwise(r, node, conv) or _pointwise(r, node, conv)
        elif node.target is aten._native_batch_norm_legit_no_training.default:
            twin = _batch_norm(r, node)
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


REWRITES: Mapping[str, Callable[[fx.GraphModule], bool]] = {"depthwise_nhwc": rewrite_depthwise_nhwc}
DEFAULT_REWRITES: tuple[str, ...] = ("depthwise_nhwc",)
# The ops each rewrite replaces by others. A method whose Partitioner leaves one of them on the host (`skip_ops`)
# is not rewritten: the user asked for that op, and after the rewrite it would no longer be there to skip.
REPLACED_OPS: Mapping[str, frozenset[str]] = {
    "depthwise_nhwc": frozenset({"aten.convolution.default", "aten._native_batch_norm_legit_no_training.default"}),
}


def apply_rewrites(methods: Mapping[str, Any], rewrites: Mapping[str, Sequence[str]],
                   skip_ops: Mapping[str, Collection[str]] | None = None) -> None:
    """Apply each method's rewrites (method name -> rewrite names, in order) to its decomposed program, in place,
    except those that replace an op the method's `skip_ops` (method name -> op names) leaves on the host."""
    for name, ep in methods.items():
        skipped = set((skip_ops or {}).get(name, ()))
        for rewrite in rewrites.get(name, ()):
            kept = skipped & REPLACED_OPS.get(rewrite, frozenset())
            if kept:
                log.info("method '%s': rewrite %s not applied: skip_ops leaves %s on the host", name, rewrite,
                         ", ".join(sorted(kept)))
                continue
            REWRITES[rewrite](ep.graph_module)
