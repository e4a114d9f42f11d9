"""Graph rewrites (onecopy.export.rewrites; the NHWC ones of onecopy.export.nhwc here, space_to_depth in
test_space_to_depth.py): each keeps the method's results, checked against torch on random
inputs, and carries the NHWC layout instead of transposing around every op."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, export_program
from onecopy.export.engine_ops import depthwise_nhwc
import onecopy.export.rewrites as rewrites_module
from onecopy.export.rewrites import (apply_rewrites, rewrite_depthwise_nhwc, rewrite_max_pool_nhwc, rewrite_nhwc,
                                     rewrite_stem_nhwc)
from onecopy.models.vision import mobilenet_v3_small, resnet18

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


def assert_iree_matches_torch(model, x, spec, tmp_path, tolerance=1e-4):
    """`model` exported with `spec`, loaded through IREE (a cache in `tmp_path`), run on `x`: torch's results."""
    program = export_program({"forward": torch.export.export(model, (x,))}, compile_spec=spec)
    prog = Runtime(cache_dir=tmp_path / "cache").load_program(program.to_bytes())
    try:
        got = prog.load_method("forward").execute([x.numpy()])
    finally:
        prog.close()
    with torch.no_grad():
        want = model(x)
    for g, w in zip(got, want if isinstance(want, tuple) else (want,), strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=tolerance, atol=tolerance)
    return program


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
    assert CompileSpec().rewrites == ("space_to_depth", "depthwise_nhwc", "max_pool_nhwc", "split_softmax")  # stem_nhwc: by name
    assert CompileSpec(rewrites=[]).rewrites == ()
    with pytest.raises(InvalidArgument,
                       match=r"unknown rewrite\(s\) 'nhwc'; known: depthwise_nhwc, stem_nhwc, space_to_depth, max_pool_nhwc"):
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
    monkeypatch.setattr(rewrites_module, "rewrite_nhwc", lambda gm, names: applied.append(rewrite_nhwc(gm, names)))
    torch.manual_seed(0)
    model = DepthwiseBlock().eval()
    x = torch.randn(1, 16, 20, 20)
    program = assert_iree_matches_torch(model, x, CompileSpec(rewrites=rewrites, packaging=packaging), tmp_path, 1e-5)
    if packaging == "mlir":  # the op reached the bundle as the one linalg op it carries
        assert (b"depthwise_conv_2d_nhwc_hwc" in program.to_bytes()) == bool(rewrites)
    assert applied == ([True] if rewrites else [])


ALL = ("depthwise_nhwc", "stem_nhwc")


@pytest.mark.parametrize(
    "channels, kernel, stride, padding, dilation, bias",
    [(3, 7, 2, 3, 1, False), (3, 5, 1, 2, 1, True), (8, 3, 2, 1, 1, True), (5, (5, 3), (1, 2), 0, 1, False),
     (3, 5, 1, 4, 2, True)],
)
def test_a_stem_conv_becomes_one_matmul_over_its_nhwc_patches_with_the_same_result(
        channels, kernel, stride, padding, dilation, bias):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, 16, kernel, stride, padding, dilation, bias=bias).eval()
    x = torch.randn(2, channels, 19, 22)
    ep = torch.export.export(conv, (x,)).run_decompositions()
    assert rewrite_stem_nhwc(ep.graph_module)
    assert aten.convolution.default not in targets(ep)
    assert targets(ep).count(aten.mm.default) + targets(ep).count(aten.addmm.default) == 1
    assert_same(conv, ep, x)


@pytest.mark.parametrize("channels, kernel", [(3, 3), (16, 3), (3, 1)])
def test_a_conv_with_a_small_patch_or_many_channels_is_not_a_stem(channels, kernel):
    """MobileNet's 3x3 stem over RGB (27 values a patch) ran slower as a matmul than as tuning's convolution."""
    conv = torch.nn.Conv2d(channels, 16, kernel, padding=kernel // 2).eval()
    ep = torch.export.export(conv, (torch.randn(1, channels, 12, 12),)).run_decompositions()
    assert not rewrite_stem_nhwc(ep.graph_module)
    assert aten.convolution.default in targets(ep)


class Stem(torch.nn.Module):
    """ResNet's stem: 7x7 conv over RGB, batch norm, ReLU, 3x3 max pool; then a dense conv that reads NCHW."""

    def __init__(self, ceil_mode: bool = False) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 7, 2, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(16).eval()
        self.pool = torch.nn.MaxPool2d(3, 2, 1, ceil_mode=ceil_mode)
        self.dense = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.dense(y), y


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_a_stem_and_its_max_pool_stay_nhwc_until_a_reader_needs_nchw(ceil_mode):
    torch.manual_seed(0)
    model = Stem(ceil_mode).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = -torch.rand(1, 3, 29, 31) * 4  # all negative: ReLU's zeros meet the pool's padding, which must not win
    ep = torch.export.export(model, (x,)).run_decompositions()
    assert rewrite_stem_nhwc(ep.graph_module)
    pooled = aten.max_pool2d_with_indices.default in targets(ep)
    assert pooled == ceil_mode  # a ceil-mode pool reads a window past the edge: left as it is, read in NCHW
    assert targets(ep).count(aten.convolution.default) == 1  # the dense conv
    # The image in, the pooled (or activated) value out, and the weight read as [kh, kw, C, O] (a parameter's
    # transpose: IREE computes it once, at load).
    assert len(image_transposes(ep)) == 3
    assert_same(model, ep, x)


def test_resnet18_loses_its_stem_conv_and_max_pool_and_keeps_its_results():
    model = resnet18()
    x = torch.randn(1, 3, 224, 224)
    ep = torch.export.export(model, (x,)).run_decompositions()
    convs = targets(ep).count(aten.convolution.default)
    apply_rewrites({"forward": ep}, {"forward": ALL})
    assert targets(ep).count(aten.convolution.default) == convs - 1
    assert aten.max_pool2d_with_indices.default not in targets(ep)
    assert_same(model, ep, x)


def test_both_rewrites_share_one_walk_and_leave_mobilenets_stem_a_convolution():
    model = mobilenet_v3_small()
    x = torch.randn(1, 3, 224, 224)
    ep = torch.export.export(model, (x,)).run_decompositions()
    apply_rewrites({"forward": ep}, {"forward": ALL})
    assert targets(ep).count(aten.convolution.default) == 1 and len(image_transposes(ep)) == 2
    assert_same(model, ep, x)


def test_a_method_that_leaves_max_pool_on_the_host_keeps_its_stem():
    torch.manual_seed(0)
    model = Stem().eval()
    x = torch.randn(1, 3, 29, 31)
    methods = {name: torch.export.export(model, (x,)).run_decompositions() for name in ("kept", "rewritten")}
    apply_rewrites(methods, {name: ("stem_nhwc",) for name in methods},
                   {"kept": ("aten.max_pool2d_with_indices.default",)})
    assert aten.max_pool2d_with_indices.default in targets(methods["kept"])
    assert targets(methods["kept"]).count(aten.convolution.default) == 2
    assert targets(methods["rewritten"]).count(aten.convolution.default) == 1


@pytest.mark.parametrize("packaging", ["mlir", "vmfb"])
def test_a_stem_through_iree_matches_torch(packaging, tmp_path):
    torch.manual_seed(0)
    assert_iree_matches_torch(Stem().eval(), torch.randn(1, 3, 32, 32), CompileSpec(packaging=packaging, rewrites=ALL),
                              tmp_path)


@pytest.mark.parametrize("kernel, stride, padding, dilation", [(3, 2, 1, 1), (2, 2, 0, 1), (3, 1, 1, 1), (3, 2, 1, 2),
                                                                ((3, 2), (2, 1), (1, 0), 1)])
def test_max_pooling_becomes_the_maximum_of_shifted_nhwc_views_with_the_same_result(kernel, stride, padding, dilation):
    torch.manual_seed(0)
    pool = torch.nn.MaxPool2d(kernel, stride, padding, dilation).eval()
    x = -torch.rand(2, 8, 17, 20) * 4  # all negative: the padding (-inf) must never win
    ep = torch.export.export(pool, (x,)).run_decompositions()
    assert rewrite_max_pool_nhwc(ep.graph_module)
    assert aten.max_pool2d_with_indices.default not in targets(ep) and aten.maximum.default in targets(ep)
    assert len(image_transposes(ep)) == 2  # in and out
    assert_same(pool, ep, x)


class PoolIndices(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)


@pytest.mark.parametrize("model", [torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True), PoolIndices()],
                         ids=["ceil-mode", "indices-read"])
def test_a_ceil_mode_pool_or_one_whose_indices_are_read_is_left_as_it_is(model):
    ep = torch.export.export(model.eval(), (torch.randn(1, 8, 15, 15),)).run_decompositions()
    assert not rewrite_max_pool_nhwc(ep.graph_module)
    assert aten.max_pool2d_with_indices.default in targets(ep) and not image_transposes(ep)


def test_resnet18_by_default_pools_in_nhwc_between_one_transpose_in_and_one_out():
    """The pooled value feeds layer1's first convolution and its residual add: both read it in NCHW, through the
    same transpose back; the stem's convolution stays a convolution (space_to_depth's)."""
    model = resnet18()
    x = torch.randn(1, 3, 224, 224)
    ep = torch.export.export(model, (x,)).run_decompositions()
    apply_rewrites({"forward": ep}, {"forward": CompileSpec().rewrites})
    assert aten.max_pool2d_with_indices.default not in targets(ep)
    assert len(image_transposes(ep)) == 2
    assert_same(model, ep, x)


def test_a_method_that_leaves_max_pool_on_the_host_keeps_it():
    model = torch.nn.MaxPool2d(3, 2, 1).eval()
    x = torch.randn(1, 8, 16, 16)
    methods = {name: torch.export.export(model, (x,)).run_decompositions() for name in ("kept", "rewritten")}
    apply_rewrites(methods, {name: ("max_pool_nhwc",) for name in methods},
                   {"kept": ("aten.max_pool2d_with_indices.default",)})
    assert aten.max_pool2d_with_indices.default in targets(methods["kept"])
    assert aten.max_pool2d_with_indices.default not in targets(methods["rewritten"])
