"""onecopy: PyTorch models with many entry points, one copy of the weights on disk and in memory, run by IREE.

    from onecopy import Runtime
    prog = Runtime().load_program("model.onecopy")
    (y,) = prog.load_method("forward").execute([x])
"""

import logging

from onecopy.errors import (
    DelegateError,
    ExecutionError,
    ExportError,
    InvalidArgument,
    OnecopyError,
    ProgramFormatError,
    UnsupportedOperator,
)
from onecopy.runtime import Method, MethodMeta, Program, Runtime, State
from onecopy.surface import Surface

__version__ = "0.1.0"

# A library logs; the application decides where it goes.
logging.getLogger("onecopy").addHandler(logging.NullHandler())

__all__ = [
    "Runtime",
    "Program",
    "Method",
    "State",
    "MethodMeta",
    "Surface",
    "OnecopyError",
    "InvalidArgument",
    "ProgramFormatError",
    "ExportError",
    "UnsupportedOperator",
    "DelegateError",
    "ExecutionError",
]
