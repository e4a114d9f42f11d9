"""Graph rewrites (onecopy.export.rewrites): each keeps the method's results, checked against torch on random
inputs, and carries the NHWC layout instead of transposing around every op."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, export_program
from onecopy.export.engine_ops import depthwise_nhwc
from onecopy.export.rewrites import REWRITES, apply_rewrites, rewrite_depthwise_nhwc
from onecopy.models.vision import mobilenet_v3_small

aten = torch.ops.aten


def rewritten(model, *args):
    ep = torch.export.export(model, args).run_decompositions()
    changed = rewrite_depthwise_nhwc(ep.graph_module)
    return ep, changed


def targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def image_transposes(ep):
    return [n for n in ep.graph.nodes if n.target is aten.permute.default and n.meta["val"].dim() == 4]


def assert_same(model, ep, *args):
    with torch.no_grad():
        want = model(*args)
        got = ep.module()(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation, bias",
    [(3, 1, 1, 1, True), (3, 2, 1, 1, False), (5, 1, 2, 1, True), (5, 2, 2, 1, False), (3, 1, 0, 1, True),
     (3, 1, 2, 2, False), ((3, 5), (2, 1), (1, 2), 1, True)],
)
def test_a_depthwise_conv_becomes_one_nhwc_op_or_shifted_multiply_adds_with_the_same_result(
        kernel, stride, padding, dilation, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(24, 24, kernel, stride, padding, dilation, groups=24, bias=bias).eval()
    x = torch.randn(2, 24, 17, 20)
    ep, changed = rewritten(conv, x)
    assert changed and aten.convolution.default not in targets(ep)
    # One op where the strides are equal and there is no dilation; else the multiply-adds.
    one_op = len({stride} if isinstance(stride, int) else set(stride)) == 1 and dilation == 1
    assert (depthwise_nhwc() in targets(ep)) == one_op
    assert (aten.slice.Tensor in targets(ep)) != one_op
    assert_same(conv, ep, x)


def test_mobilenet_v3_small_is_channels_last_between_one_transpose_in_and_one_out():
    model = mobilenet_v3_small()
    x = torch.randn(2, 3, 224, 224)
    ep, changed = rewritten(model, x)
    assert changed
    assert len(image_transposes(ep)) == 2
    # Only the stem (a dense 3x3 conv on the NCHW input) is left a convolution.
    assert targets(ep).count(aten.convolution.default) == 1
    assert_same(model, ep, x)


class MixedLayouts(torch.nn.Module):
    """A depthwise conv whose result also feeds ops the rewrite leaves in NCHW (a dense conv, a max pool, an add
    with a full NCHW image) and a conv with a channel multiplier, which is not depthwise."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn = torch.nn.BatchNorm2d(8).eval()
        self.dense = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.multiplier = torch.nn.Conv2d(8, 16, 3, padding=1, groups=8)

    def forward(self, x):
        y = torch.nn.functional.hardswish(self.bn(self.dw(x)))
        return self.dense(y) + torch.nn.functional.max_pool2d(y, 3, 1, 1) + x, self.multiplier(y), y


def test_values_that_ops_need_in_nchw_are_transposed_back_where_they_are_read():
    torch.manual_seed(0)
    model = MixedLayouts().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 8, 12, 12)
    ep, changed = rewritten(model, x)
    assert changed
    assert targets(ep).count(aten.convolution.default) == 2  # the dense conv and the channel multiplier
    assert len(image_transposes(ep)) == 2  # x into NHWC, y back out for everything that reads it
    assert_same(model, ep, x)


def test_a_network_without_depthwise_convs_is_left_as_it_is():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1)).eval()
    ep, changed = rewritten(model, torch.randn(1, 3, 16, 16))
    assert not changed and not image_transposes(ep)


@pytest.mark.parametrize("skip", ["aten.convolution.default", "aten._native_batch_norm_legit_no_training.default"])
def test_a_method_that_leaves_a_replaced_op_on_the_host_is_not_rewritten(skip):
    """skip_ops asks for those ops on the host: the rewrite would replace them and leave nothing to skip."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.BatchNorm2d(8)).eval()
    x = torch.randn(1, 8, 12, 12)
    methods = {name: torch.export.export(model, (x,)).run_decompositions() for name in ("kept", "rewritten")}
    apply_rewrites(methods, {"kept": ("depthwise_nhwc",), "rewritten": ("depthwise_nhwc",)}, {"kept": (skip,)})
    assert aten.convolution.default in targets(methods["kept"])
    assert aten.convolution.default not in targets(methods["rewritten"])


def test_a_dynamic_batch_is_left_as_it_is():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(conv, (torch.randn(2, 8, 10, 10),), dynamic_shapes=({0: batch},)).run_decompositions()
    assert not rewrite_depthwise_nhwc(ep.graph_module)
    assert aten.convolution.default in targets(ep)


def test_compile_spec_names_the_rewrites_it_knows():
    assert CompileSpec().rewrites == ("depthwise_nhwc",)
    assert CompileSpec(rewrites=[]).rewrites == ()
    with pytest.raises(InvalidArgument, match=r"unknown rewrite\(s\) 'nhwc'; known: depthwise_nhwc"):
        CompileSpec(rewrites=("nhwc",))
    with pytest.raises(InvalidArgument, match=r"write rewrites=\('depthwise_nhwc',\)"):
        CompileSpec(rewrites="depthwise_nhwc")


class DepthwiseBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(16, 16, 5, stride=2, padding=2, groups=16, bias=False)
        self.bn = torch.nn.BatchNorm2d(16).eval()
        self.pw = torch.nn.Conv2d(16, 24, 1)

    def forward(self, x):
        return self.pw(torch.relu(self.bn(self.dw(x))))


@pytest.mark.parametrize("rewrites, packaging", [(("depthwise_nhwc",), "mlir"), ((), "mlir"),
                                                 (("depthwise_nhwc",), "vmfb")])
def test_a_depthwise_block_through_iree_matches_torch_with_and_without_the_rewrite(rewrites, packaging, tmp_path,
                                                                                   monkeypatch):
    applied = []
    monkeypatch.setitem(REWRITES, "depthwise_nhwc", lambda gm: applied.append(rewrite_depthwise_nhwc(gm)))
    torch.manual_seed(0)
    model = DepthwiseBlock().eval()
    x = torch.randn(1, 16, 20, 20)
    program = export_program({"forward": torch.export.export(model, (x,))},
                             compile_spec=CompileSpec(rewrites=rewrites, packaging=packaging))
    if packaging == "mlir":  # the op reached the bundle as the one linalg op it carries
        assert (b"depthwise_conv_2d_nhwc_hwc" in program.to_bytes()) == bool(rewrites)
    prog = Runtime(cache_dir=tmp_path / "cache").load_program(program.to_bytes())
    try:
        (got,) = prog.load_method("forward").execute([x.numpy()])
    finally:
        prog.close()
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-5)
    assert applied == ([True] if rewrites else [])
