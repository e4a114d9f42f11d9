"""The space_to_depth rewrite (onecopy.export.space_to_depth): a strided convolution over few channels becomes a
stride-1 convolution over the input's blocks, with the same results as torch on random inputs; what it would not
help is left alone."""

import pytest
import torch

from onecopy.export import CompileSpec
from onecopy.export.rewrites import apply_rewrites, rewrite_space_to_depth
from onecopy.models.vision import mobilenet_v3_small, resnet18
from tests.export.test_rewrites import Stem, assert_iree_matches_torch, assert_same

aten = torch.ops.aten


def convolutions(ep):
    return [n for n in ep.graph.nodes if n.target is aten.convolution.default]


@pytest.mark.parametrize(
    "channels, kernel, stride, padding, bias, size",
    [(3, 7, 2, 3, False, (224, 224)),  # ResNet's stem
     (3, 7, 2, 3, True, (19, 22)),  # odd sizes: the last block is padded
     (4, 5, 2, 0, False, (21, 18)),  # RGBA, no padding: the padded input is cropped to the blocks read
     (1, 4, 4, 0, True, (16, 16)),  # a patchify stem: the kernel is one block, a 1x1 convolution remains
     (1, 8, 4, 2, False, (30, 29)),
     (3, 2, 2, 0, True, (10, 11)),
     (3, 5, 2, 1, True, (17, 20)),  # the grid shifted onto the image's: one block of padding before
     (2, 4, 2, 1, False, (15, 16))],  # shifting would cost a block of taps: the image padded by a pixel instead
)
def test_a_strided_conv_over_few_channels_becomes_a_stride_one_conv_over_blocks_with_the_same_result(
        channels, kernel, stride, padding, bias, size):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, 8, kernel, stride, padding, bias=bias).eval()
    x = torch.randn(2, channels, *size)
    ep = torch.export.export(conv, (x,)).run_decompositions()
    assert rewrite_space_to_depth(ep.graph_module)
    (new,) = convolutions(ep)
    blocks = -(-kernel // stride)
    assert list(new.args[3]) == [1, 1] and list(new.args[4]) == [0, 0]
    assert tuple(new.args[1].meta["val"].shape) == (8, channels * stride * stride, blocks, blocks)
    assert_same(conv, ep, x)


def test_resnets_stem_reads_the_image_as_it_is_and_pads_the_blocks():
    """7x7 stride 2 padding 3: one zero tap in front of the kernel puts the block grid on the image's own, so the
    image goes into the block transpose unpadded (IREE then distributes that transpose well) and the padding, 2
    blocks before and 1 after, is added to the 12-channel blocks."""
    conv = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False).eval()
    x = torch.randn(1, 3, 224, 224)
    ep = torch.export.export(conv, (x,)).run_decompositions()
    assert rewrite_space_to_depth(ep.graph_module)
    pads = {tuple(n.args[0].meta["val"].shape): list(n.args[1]) for n in ep.graph.nodes
            if n.target is aten.constant_pad_nd.default}
    assert pads == {(64, 3, 7, 7): [1, 0, 1, 0], (1, 12, 112, 112): [2, 1, 2, 1]}
    assert_same(conv, ep, x)


@pytest.mark.parametrize(
    "channels, kernel, stride, dilation, groups",
    [(3, 3, 2, 1, 1),  # MobileNet's stem: the 3x3 kernel would grow to 4x4 (1.78x), measured slower
     (8, 3, 2, 1, 1),  # 8 * 2 * 2 channels: more than the micro kernel's block
     (3, 7, 1, 1, 1),  # not strided
     (4, 5, 2, 2, 1),  # dilated
     (4, 5, 2, 1, 2)],  # grouped
)
def test_a_conv_that_space_to_depth_would_not_help_is_left_as_it_is(channels, kernel, stride, dilation, groups):
    conv = torch.nn.Conv2d(channels, 8, kernel, stride, 1, dilation, groups=groups).eval()
    ep = torch.export.export(conv, (torch.randn(1, channels, 24, 24),)).run_decompositions()
    assert not rewrite_space_to_depth(ep.graph_module)
    (same,) = convolutions(ep)
    assert list(same.args[3]) == [stride, stride]


def test_space_to_depth_keeps_a_dynamic_batch():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 7, 2, 3).eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(conv, (torch.randn(2, 3, 32, 32),), dynamic_shapes=({0: batch},)).run_decompositions()
    assert rewrite_space_to_depth(ep.graph_module)
    for n in (1, 5):
        assert_same(conv, ep, torch.randn(n, 3, 32, 32))


def test_resnet18s_stem_reads_twelve_channels_through_a_4x4_kernel_and_mobilenets_is_left():
    for model, stem in ((resnet18(), (64, 12, 4, 4)), (mobilenet_v3_small(), (16, 3, 3, 3))):
        x = torch.randn(1, 3, 224, 224)
        ep = torch.export.export(model, (x,)).run_decompositions()
        apply_rewrites({"forward": ep}, {"forward": CompileSpec().rewrites})
        assert tuple(convolutions(ep)[0].args[1].meta["val"].shape) == stem
        assert_same(model, ep, x)


def test_a_method_that_leaves_convolutions_on_the_host_keeps_its_strided_stem():
    model = torch.nn.Conv2d(3, 8, 7, 2, 3).eval()
    x = torch.randn(1, 3, 32, 32)
    methods = {name: torch.export.export(model, (x,)).run_decompositions() for name in ("kept", "rewritten")}
    apply_rewrites(methods, {name: ("space_to_depth",) for name in methods}, {"kept": ("aten.convolution.default",)})
    assert list(convolutions(methods["kept"])[0].args[3]) == [2, 2]
    assert list(convolutions(methods["rewritten"])[0].args[3]) == [1, 1]


@pytest.mark.parametrize("rewrites", [("space_to_depth",), ("space_to_depth", "depthwise_nhwc", "max_pool_nhwc"),
                                      ("space_to_depth", "depthwise_nhwc", "stem_nhwc")])
def test_a_space_to_depth_stem_through_iree_matches_torch(rewrites, tmp_path):
    """Alone, with the default rewrites, and with stem_nhwc after it (which then takes the stride-1 conv over blocks
    as its matmul)."""
    torch.manual_seed(0)
    assert_iree_matches_torch(Stem().eval(), torch.randn(2, 3, 32, 30), CompileSpec(rewrites=rewrites), tmp_path)
