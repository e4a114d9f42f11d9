"""onecopy's own engine ops (onecopy.export.engine_ops): each equals the torch computation it stands for, in
eager and through IREE, and the MLIR bindings compatibility it needs only adds what is missing."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.export import CompileSpec, export_program
from onecopy.export.engine_ops import _bindings_compat, depthwise_nhwc


def reference(x_nhwc, w_hwc, stride):
    """The depthwise convolution as torch computes it, in NCHW, back to NHWC."""
    y = torch.nn.functional.conv2d(x_nhwc.permute(0, 3, 1, 2), w_hwc.permute(2, 0, 1).unsqueeze(1), stride=stride,
                                   groups=x_nhwc.shape[-1])
    return y.permute(0, 2, 3, 1)


class Depthwise(torch.nn.Module):
    def __init__(self, w: torch.Tensor, stride: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w)
        self.stride = stride

    def forward(self, x):
        return depthwise_nhwc()(x, self.w, self.stride)


@pytest.mark.parametrize("kernel, stride", [((3, 3), 1), ((3, 3), 2), ((5, 5), 1), ((3, 5), 2)])
def test_depthwise_nhwc_equals_torchs_depthwise_convolution_eagerly_and_through_iree(kernel, stride, tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 13, 16, 24)
    w = torch.randn(*kernel, 24)
    want = reference(x, w, stride)
    torch.testing.assert_close(depthwise_nhwc()(x, w, stride), want, rtol=1e-5, atol=1e-5)
    model = Depthwise(w, stride).eval()
    program = export_program({"forward": torch.export.export(model, (x,))}, compile_spec=CompileSpec(rewrites=()))
    with Runtime(cache_dir=tmp_path).load_program(program.to_bytes()) as loaded:
        (got,) = loaded.load_method("forward").execute([x.numpy()])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_the_bindings_compatibility_only_adds_what_is_missing():
    from iree.compiler import ir

    before = {name: getattr(getattr(ir, name), "isinstance", None) for name in dir(ir)
              if isinstance(getattr(ir, name), type)}
    _bindings_compat()
    _bindings_compat()  # again: nothing changes
    for name, method in before.items():
        if method is not None:
            assert getattr(ir, name).isinstance is method
    with ir.Context():
        i32 = ir.IntegerType.get_signless(32)
        assert ir.IntegerType.isinstance(i32) and not ir.F32Type.isinstance(i32)
