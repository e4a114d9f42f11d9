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


# Type promotion: a host kernel returns what torch computes, values and dtype (torch's promotion, not numpy's).

def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


def assert_same_as_torch(got, want: torch.Tensor, rtol=1e-6):
    want = want.numpy()
    assert isinstance(got, np.ndarray)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6)


_I32 = torch.tensor([1, 2, 9], dtype=torch.int32)
_I64 = torch.tensor([0, 1, -2, 7])
_HALF = torch.tensor([0.5, -1.25, 3.0], dtype=torch.float16)

PROMOTION_CASES = {
    # float ops of integers are computed in the default float dtype, not cast back to the integers
    "int32 sqrt": ("aten.sqrt.default", torch.ops.aten.sqrt.default, (_I32,), {}),
    "int64 sigmoid": ("aten.sigmoid.default", torch.ops.aten.sigmoid.default, (_I64,), {}),
    "int64 tanh": ("aten.tanh.default", torch.ops.aten.tanh.default, (_I64,), {}),
    "int64 exp": ("aten.exp.default", torch.ops.aten.exp.default, (_I64,), {}),
    "int32 rsqrt": ("aten.rsqrt.default", torch.ops.aten.rsqrt.default, (_I32,), {}),
    "bool sqrt": ("aten.sqrt.default", torch.ops.aten.sqrt.default, (torch.tensor([True, False]),), {}),
    # Python bounds take part: an integer tensor clamped to 0.5 is a float32 result, clamped
    "int clamp float min": ("aten.clamp.default", torch.ops.aten.clamp.default, (_I64, 0.5), {}),
    "int clamp float max": ("aten.clamp.default", torch.ops.aten.clamp.default, (_I32, None, 1.5), {}),
    "int32 clamp int": ("aten.clamp.default", torch.ops.aten.clamp.default, (_I32, 2, 5), {}),
    "half clamp": ("aten.clamp.default", torch.ops.aten.clamp.default, (_HALF, -1.0, 1.0), {}),
    # true division of integers is float32 (numpy: float64)
    "int / int": ("aten.div.Tensor", torch.ops.aten.div.Tensor, (_I64, torch.tensor([2, 3, 4, 5])), {}),
    "int32 / int": ("aten.div.Tensor", torch.ops.aten.div.Tensor, (_I32, 4), {}),
    "int / 0": ("aten.div.Tensor", torch.ops.aten.div.Tensor, (_I64, 0), {}),
    # a Python float makes an integer tensor the default float (numpy: float64), a Python int keeps int32
    "int32 + 0.5": ("aten.add.Tensor", torch.ops.aten.add.Tensor, (_I32, 0.5), {}),
    "int32 - 0.5": ("aten.sub.Tensor", torch.ops.aten.sub.Tensor, (_I32, 0.5), {}),
    "int32 * 2": ("aten.mul.Tensor", torch.ops.aten.mul.Tensor, (_I32, 2), {}),
    "int32 + int32, alpha": ("aten.add.Tensor", torch.ops.aten.add.Tensor, (_I32, _I32), {"alpha": 3}),
    "half + 0.1": ("aten.add.Tensor", torch.ops.aten.add.Tensor, (_HALF, 0.1), {}),
    "bool + 1": ("aten.add.Tensor", torch.ops.aten.add.Tensor, (torch.tensor([True, False]), 1), {}),
    # a 0-d tensor of the same category does not promote a dimensioned one (numpy: it does)
    "half * 0-d float32": ("aten.mul.Tensor", torch.ops.aten.mul.Tensor, (_HALF, torch.tensor(1.5)), {}),
    "int32 + 0-d int64": ("aten.add.Tensor", torch.ops.aten.add.Tensor, (_I32, torch.tensor(7)), {}),
    "int32 * 0-d float64": ("aten.mul.Tensor", torch.ops.aten.mul.Tensor,
                            (_I32, torch.tensor(0.25, dtype=torch.float64)), {}),
    "int8 + uint8": ("aten.add.Tensor", torch.ops.aten.add.Tensor,
                     (torch.tensor([-3, 4], dtype=torch.int8), torch.tensor([200, 1], dtype=torch.uint8)), {}),
    "int16 * half": ("aten.mul.Tensor", torch.ops.aten.mul.Tensor,
                     (torch.tensor([3, -4, 5], dtype=torch.int16), _HALF), {}),
    "half softmax": ("aten._softmax.default", torch.ops.aten._softmax.default,
                     (torch.tensor([[0.5, 1.0, -2.0]], dtype=torch.float16), -1, False), {}),
}


@pytest.mark.parametrize("op, torch_fn, args, kwargs", PROMOTION_CASES.values(), ids=PROMOTION_CASES.keys())
def test_builtin_host_kernels_promote_as_torch(op, torch_fn, args, kwargs):
    got = get_host_kernel(op)(*(_np(a) for a in args), **kwargs)
    assert_same_as_torch(got, torch_fn(*args, **kwargs), rtol=1e-3 if torch.float16 in
                         {getattr(a, "dtype", None) for a in args} else 1e-6)


def test_result_type_is_torchs():
    from onecopy.runtime.host_kernels import _result_type

    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.float32, torch.float64, torch.complex64, torch.complex128]
    operands = [torch.ones(2, dtype=d) for d in dtypes] + [torch.ones((), dtype=d) for d in dtypes]
    wrong = []
    for a in operands:
        for b in [*operands, True, 2, 0.5, 1j]:
            kinds = {a.dtype, getattr(b, "dtype", None)}
            if torch.float16 in kinds and (kinds & {torch.complex64, torch.complex128} or isinstance(b, complex)):
                continue  # torch's complex32, which numpy does not have
            want = str(torch.result_type(a, b)).removeprefix("torch.")
            got = str(_result_type(_np(a), _np(b)))
            if got != want:
                wrong.append(f"{a.dtype}{list(a.shape)} with {b if not isinstance(b, torch.Tensor) else b.dtype}"
                             f"{list(getattr(b, 'shape', []))}: {got}, torch {want}")
    assert not wrong


# The same through exported programs: the op on the host (skip_ops), its result as torch.export recorded it.

class _Sqrt(torch.nn.Module):
    def forward(self, a):
        return a.sqrt()


class _Sigmoid(torch.nn.Module):
    def forward(self, a):
        return torch.sigmoid(a)


class _ClampMin(torch.nn.Module):
    def forward(self, a):
        return torch.clamp(a, min=0.5)


class _Div(torch.nn.Module):
    def forward(self, a, b):
        return a / b


class _AddHalf(torch.nn.Module):
    def forward(self, a):
        return a + 0.5


class _Mul(torch.nn.Module):
    def forward(self, a, b):
        return a * b


class _DivThenEngine(torch.nn.Module):  # an engine partition takes the host op's float32 result
    def forward(self, a, b):
        return (a / b) * 2.0 + 1.0


PROGRAM_CASES = {
    "int32 sqrt": (_Sqrt(), (_I32,), "aten.sqrt.default"),
    "int64 sigmoid": (_Sigmoid(), (_I64,), "aten.sigmoid.default"),
    "int clamp min=0.5": (_ClampMin(), (_I64,), "aten.clamp.default"),
    "int / int": (_Div(), (torch.tensor([7, 8, 9]), torch.tensor([2, 3, 4])), "aten.div.Tensor"),
    "int32 + 0.5": (_AddHalf(), (_I32,), "aten.add.Tensor"),
    "half * 0-d float32": (_Mul(), (_HALF, torch.tensor(1.5)), "aten.mul.Tensor"),
    "int / int, then the engine": (_DivThenEngine(), (torch.tensor([7, 8, 9]), torch.tensor([2, 3, 4])),
                                   "aten.div.Tensor"),
}


def _load(module, args, **partitioner):
    from onecopy import Runtime
    from onecopy.export import CompileSpec, Partitioner, export_program

    program = export_program({"forward": torch.export.export(module, args)},
                             partitioner=Partitioner(**partitioner), compile_spec=CompileSpec(packaging="mlir"))
    return program, Runtime().load_program(program.to_bytes()).load_method("forward")


@pytest.mark.parametrize("module, args, op", PROGRAM_CASES.values(), ids=PROGRAM_CASES.keys())
def test_host_ops_of_a_program_give_torchs_values_and_dtypes(module, args, op):
    program, method = _load(module, args, skip_ops=(op,))
    assert op in [getattr(i, "op", None) for i in program.definition.methods[0].instructions]
    want = module(*args)
    assert method.method_meta.outputs[0].dtype == want.numpy().dtype
    (got,) = method.execute([a.numpy() for a in args])
    assert_same_as_torch(got, want, rtol=1e-3 if want.dtype == torch.float16 else 1e-6)


@pytest.fixture(scope="module")
def halve_op():
    lib = torch.library.Library("onecopy_hk_test", "DEF")
    lib.define("halve(Tensor x) -> Tensor")
    lib.impl("halve", lambda x: x // 2 if not x.is_floating_point() else x / 2, "CompositeExplicitAutograd")
    lib.impl("halve", lambda x: torch.empty_like(x), "Meta")
    yield "onecopy_hk_test.halve.default"
    lib._destroy()


class _Halve(torch.nn.Module):
    def forward(self, x):
        return torch.ops.onecopy_hk_test.halve(x)


class _HalveThenScale(torch.nn.Module):
    def forward(self, x):
        return torch.ops.onecopy_hk_test.halve(x) * 3


def test_a_host_kernel_result_of_another_dtype_is_refused_unless_a_safe_cast(halve_op):
    from onecopy.errors import ExecutionError

    # numpy's float64 for a float32 output: refused, naming the op, rather than rounded silently
    register_host_kernel(halve_op, lambda x: x / np.float64(2), replace=True)
    _, method = _load(_Halve(), (torch.zeros(3),))
    with pytest.raises(ExecutionError, match=r"host kernel 'onecopy_hk_test.halve.default' returned float64 for "
                                             r"its result 0, which torch.export recorded as float32"):
        method.execute([np.ones(3, np.float32)])
    # the same feeding an engine partition: refused here, naming the kernel, not by the engine
    _, method = _load(_HalveThenScale(), (torch.zeros(3),))
    with pytest.raises(ExecutionError, match=r"host kernel 'onecopy_hk_test.halve.default' returned float64 for "
                                             r"its result 0, which torch.export recorded as float32"):
        method.execute([np.ones(3, np.float32)])
    # an int32 for an int64 output: cast, as it loses nothing
    register_host_kernel(halve_op, lambda x: (x // 2).astype(np.int32), replace=True)
    _, method = _load(_Halve(), (torch.zeros(3, dtype=torch.int64),))
    (got,) = method.execute([np.array([4, 7, -9])])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [2, 3, -5])
