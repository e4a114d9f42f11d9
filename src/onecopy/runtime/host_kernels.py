"""Host kernels: numpy implementations of the ops a partitioner leaves on the host (graph breaks).

Register your own by op name, as `str(node.target)` prints it in a `torch.export` graph:

    from onecopy.runtime import register_host_kernel

    @register_host_kernel("mylib.scale.default")
    def scale(x, factor):
        return x * np.float32(factor)

A kernel takes the op's arguments (numpy arrays for tensors, Python values for the rest) and returns an array,
or a tuple of arrays for an op with several outputs. Register the kernel before exporting (export checks that
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


def _same_dtype(fn: Callable[..., np.ndarray]) -> HostKernel:
    # numpy promotes some results (e.g. float16 through ufuncs with Python floats); keep the input's dtype as
    # torch does.
    def kernel(x: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.asarray(fn(x, *args, **kwargs)).astype(x.dtype, copy=False)

    return kernel


def _add(a, b, *, alpha=1):
    return np.add(a, b * alpha if alpha != 1 else b)


def _sub(a, b, *, alpha=1):
    return np.subtract(a, b * alpha if alpha != 1 else b)


def _softmax(x: np.ndarray, dim: int, half_to_float: bool = False) -> np.ndarray:
    shifted = x - x.max(axis=dim, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=dim, keepdims=True)


def _gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))


def _clamp(x, min=None, max=None):
    return np.clip(x, min, max)


for _op, _fn in {
    "aten.relu.default": lambda x: np.maximum(x, 0),
    "aten.sigmoid.default": lambda x: 1 / (1 + np.exp(-x)),
    "aten.tanh.default": np.tanh,
    "aten.exp.default": np.exp,
    "aten.neg.default": np.negative,
    "aten.abs.default": np.abs,
    "aten.sqrt.default": np.sqrt,
    "aten.rsqrt.default": lambda x: 1 / np.sqrt(x),
    "aten.gelu.default": _gelu,
    "aten.clamp.default": _clamp,
    "aten._softmax.default": _softmax,
    "aten.clone.default": lambda x, memory_format=None: np.array(x, copy=True),
    "aten.view.default": lambda x, shape: np.reshape(x, shape),
    "aten.permute.default": lambda x, dims: np.ascontiguousarray(np.transpose(x, dims)),
}.items():
    register_host_kernel(_op, _same_dtype(_fn))

for _op, _fn in {
    "aten.add.Tensor": _add,
    "aten.sub.Tensor": _sub,
    "aten.mul.Tensor": np.multiply,
    "aten.div.Tensor": np.divide,
    "aten.mm.default": np.matmul,
    "aten.bmm.default": np.matmul,
}.items():
    register_host_kernel(_op, _fn)
