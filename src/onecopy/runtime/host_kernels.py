"""Host kernels: numpy implementations of the ops a partitioner leaves on the host (graph breaks).

Register your own by op name, as `str(node.target)` prints it in a `torch.export` graph:

    from onecopy.runtime import register_host_kernel

    @register_host_kernel("mylib.scale.default")
    def scale(x, factor):
        return x * np.float32(factor)

A kernel takes the op's arguments (numpy arrays for tensors, Python values for the rest) and returns an array,
or a tuple of arrays for an op with several outputs. It returns the dtype torch computes for the op (torch's type
promotion, not numpy's: an int32 array plus 0.5 is float32 in torch, float64 in numpy): a later engine partition
takes the dtype torch.export recorded, and a method output that comes back in another dtype, one that cannot be
cast to the recorded one safely, is an ExecutionError. Register the kernel before exporting (export checks that
every host op has one) and before running.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from onecopy.errors import InvalidArgument

__all__ = ["HostKernel", "register_host_kernel", "get_host_kernel", "has_host_kernel", "host_kernel_names"]

HostKernel = Callable[..., Any]

_kernels: dict[str, HostKernel] = {}
_lock = threading.Lock()


def register_host_kernel(op: str, kernel: HostKernel | None = None, *, replace: bool = False):
    """Register `kernel` for `op`; usable as a decorator. Re-registering an op needs `replace=True`."""
    if not isinstance(op, str) or op.count(".") < 1:
        raise InvalidArgument(f"A host kernel is registered under an op name like 'aten.relu.default', got {op!r}.")

    def register(fn: HostKernel) -> HostKernel:
        if not callable(fn):
            raise InvalidArgument(f"The host kernel for '{op}' must be callable, got {type(fn).__name__}.")
        with _lock:
            if op in _kernels and not replace:
                raise InvalidArgument(f"A host kernel for '{op}' is already registered; pass replace=True to override.")
            _kernels[op] = fn
        return fn

    return register if kernel is None else register(kernel)


def get_host_kernel(op: str) -> HostKernel | None:
    return _kernels.get(op)


def has_host_kernel(op: str) -> bool:
    return op in _kernels


def host_kernel_names() -> list[str]:
    return sorted(_kernels)


# torch's type promotion, in numpy (the runtime does not import torch). A built-in kernel returns the dtype
# torch computes for the op, which is the dtype torch.export recorded for its output: numpy's own promotion differs
# (an int32 array plus 0.5 is float64 there, float32 in torch; int / int is float64 there; a 0-d float32 array
# promotes a float16 one there, not in torch), and a float op of integers must not be cast back to integers.

_DEFAULT_FLOAT = np.dtype(np.float32)  # torch.get_default_dtype(): what integers become in a float op
_DEFAULT_COMPLEX = np.dtype(np.complex64)
_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}  # bool < integer < floating < complex


def _promote_types(a: np.dtype, b: np.dtype) -> np.dtype:
    """torch.promote_types: within a category as numpy; across categories the higher category's type (an
    int32 with a float16 is float16, where numpy says float64), a complex one widened to a wider float's
    precision."""
    ca, cb = _CATEGORY[a.kind], _CATEGORY[b.kind]
    if ca == cb:
        return np.promote_types(a, b)
    higher, lower = (a, b) if ca > cb else (b, a)
    return np.promote_types(higher, lower) if higher.kind == "c" and lower.kind == "f" else higher


def _combine(higher: np.dtype | None, lower: np.dtype | None) -> np.dtype | None:
    """ATen's combine_categories: a lower priority participant (0-d tensor, then Python scalar) changes the
    result only when its category is higher (or the higher one is bool)."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.kind == "c":
        return higher
    if lower.kind == "c":
        # a float tensor keeps its precision: float32 with a complex128 0-d tensor is complex64
        return np.promote_types(higher, _DEFAULT_COMPLEX) if higher.kind == "f" else lower
    if higher.kind == "f":
        return higher
    if higher.kind == "b" or lower.kind == "f":
        return _promote_types(higher, lower)
    return higher


def _result_type(*operands: Any) -> np.dtype:
    """torch.result_type over tensors (numpy arrays; 0-d ones rank below the others) and Python scalars (which
    rank last, as int64, the default float or the default complex type); None is skipped."""
    results: list[np.dtype | None] = [None, None, None]  # dimensioned tensors, 0-d tensors, Python scalars
    for x in operands:
        if x is None:
            continue
        if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):  # a "wrapped number"
            rank = 2
            dtype = (np.dtype(np.bool_) if isinstance(x, bool) else np.dtype(np.int64) if isinstance(x, int)
                     else _DEFAULT_FLOAT if isinstance(x, float) else _DEFAULT_COMPLEX)
        else:
            x = np.asarray(x)
            rank, dtype = (0 if x.ndim else 1), x.dtype
        if dtype.kind not in _CATEGORY:
            raise TypeError(f"a host kernel takes numeric tensors, got dtype {dtype}")
        results[rank] = dtype if results[rank] is None else _promote_types(results[rank], dtype)
    result = _combine(results[0], _combine(results[1], results[2]))
    if result is None:
        raise TypeError("no tensor or scalar operands")
    return result


def _float_type(dtype: np.dtype) -> np.dtype:
    """The dtype of a float op's result (sqrt, sigmoid, true division): integers and bools give the default float."""
    return dtype if dtype.kind in "fc" else _DEFAULT_FLOAT


def _opmath(dtype: np.dtype) -> np.dtype:
    """The dtype torch computes a float16 op in (float32), rounding the result once."""
    return _DEFAULT_FLOAT if dtype == np.float16 else dtype


def _as(x: Any, dtype: np.dtype) -> np.ndarray:
    return np.asarray(x).astype(dtype, copy=False)


def _same_dtype(fn: Callable[..., np.ndarray]) -> HostKernel:
    """An op whose result has its input's dtype (relu, neg, a view)."""

    def kernel(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        x = np.asarray(x)
        return np.asarray(fn(x, *args, **kwargs)).astype(x.dtype, copy=False)

    return kernel


def _float_op(fn: Callable[..., np.ndarray]) -> HostKernel:
    """A float op (sqrt, sigmoid, ...): integer and bool inputs are computed in the default float dtype, float16
    in float32; the result has the float dtype torch gives (never the integer input's)."""

    def kernel(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        x = np.asarray(x)
        out = _float_type(x.dtype)
        with np.errstate(all="ignore"):  # sqrt(-1) is nan, as in torch, without a warning
            result = fn(_as(x, _opmath(out)), *args, **kwargs)
        return np.asarray(result).astype(out, copy=False)

    return kernel


def _binary(fn: Callable[..., np.ndarray], *, true_division: bool = False) -> HostKernel:
    """An elementwise op of two operands (tensors or Python scalars) computed in torch's result type."""

    def kernel(a: Any, b: Any, **kwargs: Any) -> np.ndarray:
        out = _result_type(a, b)
        if true_division:
            out = _float_type(out)
        math_type = _opmath(out)
        with np.errstate(all="ignore"):  # x / 0 is inf or nan, as in torch
            result = fn(_as(a, math_type), _as(b, math_type), math_type, **kwargs)
        return np.asarray(result).astype(out, copy=False)

    return kernel


def _add(a, b, math_type, *, alpha=1):
    return np.add(a, b * _as(alpha, math_type) if alpha != 1 else b)


def _sub(a, b, math_type, *, alpha=1):
    return np.subtract(a, b * _as(alpha, math_type) if alpha != 1 else b)


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    out = _promote_types(a.dtype, b.dtype)  # torch requires equal dtypes, so this is a's
    return np.asarray(np.matmul(_as(a, _opmath(out)), _as(b, _opmath(out)))).astype(out, copy=False)


def _softmax(x: np.ndarray, dim: int, half_to_float: bool = False) -> np.ndarray:
    x = np.asarray(x)
    out = _DEFAULT_FLOAT if half_to_float and x.dtype == np.float16 else _float_type(x.dtype)
    x = _as(x, _opmath(out))
    shifted = x - x.max(axis=dim, keepdims=True)
    e = np.exp(shifted)
    return (e / e.sum(axis=dim, keepdims=True)).astype(out, copy=False)


def _gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))


def _clamp(x, min=None, max=None):
    # Python bounds take part in the promotion: an integer tensor clamped to 0.5 is a float32 result.
    out = _result_type(x, min, max)
    x = _as(x, out)
    if min is None and max is None:
        return x.copy()
    return np.asarray(np.clip(x, None if min is None else _as(min, out), None if max is None else _as(max, out)))


for _op, _fn in {
    "aten.relu.default": lambda x: np.maximum(x, 0),
    "aten.neg.default": np.negative,
    "aten.abs.default": np.abs,
    "aten.clone.default": lambda x, memory_format=None: np.array(x, copy=True),
    "aten.view.default": lambda x, shape: np.reshape(x, shape),
    "aten.permute.default": lambda x, dims: np.ascontiguousarray(np.transpose(x, dims)),
}.items():
    register_host_kernel(_op, _same_dtype(_fn))

for _op, _fn in {
    "aten.sigmoid.default": lambda x: 1 / (1 + np.exp(-x)),
    "aten.tanh.default": np.tanh,
    "aten.exp.default": np.exp,
    "aten.sqrt.default": np.sqrt,
    "aten.rsqrt.default": lambda x: 1 / np.sqrt(x),
    "aten.gelu.default": _gelu,
}.items():
    register_host_kernel(_op, _float_op(_fn))

for _op, _fn in {
    "aten.add.Tensor": _binary(_add),
    "aten.sub.Tensor": _binary(_sub),
    "aten.mul.Tensor": _binary(lambda a, b, _: np.multiply(a, b)),
    "aten.div.Tensor": _binary(lambda a, b, _: np.true_divide(a, b), true_division=True),
    "aten.clamp.default": _clamp,
    "aten._softmax.default": _softmax,
    "aten.mm.default": _matmul,
    "aten.bmm.default": _matmul,
}.items():
    register_host_kernel(_op, _fn)
