import numpy as np
import pytest
import torch

from onecopy.errors import InvalidArgument
from onecopy.runtime import get_host_kernel, register_host_kernel


@pytest.mark.parametrize(
    "op, torch_fn, args",
    [
        ("aten.relu.default", torch.ops.aten.relu.default, ()),
        ("aten.sigmoid.default", torch.ops.aten.sigmoid.default, ()),
        ("aten.tanh.default", torch.ops.aten.tanh.default, ()),
        ("aten.gelu.default", torch.ops.aten.gelu.default, ()),
        ("aten._softmax.default", torch.ops.aten._softmax.default, (-1, False)),
        ("aten.clamp.default", torch.ops.aten.clamp.default, (-0.5, 0.5)),
        ("aten.permute.default", torch.ops.aten.permute.default, ([1, 0, 2],)),
        ("aten.view.default", torch.ops.aten.view.default, ([6, 4],)),
    ],
)
def test_builtin_host_kernels_match_torch(op, torch_fn, args):
    x = np.random.default_rng(0).standard_normal((2, 3, 4), dtype=np.float32)
    got = get_host_kernel(op)(x, *args)
    want = torch_fn(torch.from_numpy(x), *args).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_add_honours_alpha():
    a, b = np.ones(3, np.float32), np.full(3, 2, np.float32)
    np.testing.assert_array_equal(get_host_kernel("aten.add.Tensor")(a, b, alpha=3), np.full(3, 7))


def test_registering_twice_needs_replace():
    register_host_kernel("onecopy_test.twice.default", lambda x: x)
    with pytest.raises(InvalidArgument, match="already registered; pass replace=True"):
        register_host_kernel("onecopy_test.twice.default", lambda x: x)
    register_host_kernel("onecopy_test.twice.default", lambda x: x + 1, replace=True)
    assert get_host_kernel("onecopy_test.twice.default")(1) == 2


def test_register_validates_name_and_kernel():
    with pytest.raises(InvalidArgument, match="op name like 'aten.relu.default'"):
        register_host_kernel("relu", lambda x: x)
    with pytest.raises(InvalidArgument, match="must be callable"):
        register_host_kernel("onecopy_test.nope.default", 3)
