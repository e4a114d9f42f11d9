"""The runtime: load programs, run methods. Never imports `onecopy.export` (a device needs no torch)."""

from onecopy.runtime.backend import Backend, DelegateHandle, Plan, get_backend, register_backend
from onecopy.runtime.backend_options import parse_backend_options
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.host_kernels import get_host_kernel, has_host_kernel, register_host_kernel
from onecopy.runtime.init_context import InitContext
from onecopy.runtime.method import Method
from onecopy.runtime.method_meta import DelegateMeta, MethodMeta, TensorMeta
from onecopy.runtime.program import Program, Runtime, verify_program
from onecopy.runtime.state import State

__all__ = [
    "Runtime",
    "Program",
    "verify_program",
    "Method",
    "State",
    "CopyStats",
    "MethodMeta",
    "TensorMeta",
    "DelegateMeta",
    "InitContext",
    "Backend",
    "DelegateHandle",
    "Plan",
    "get_backend",
    "register_backend",
    "parse_backend_options",
    "register_host_kernel",
    "get_host_kernel",
    "has_host_kernel",
]
