"""The AOT side: torch.export programs -> one onecopy program (needs torch, iree-turbine and the compiler)."""

from onecopy.export.compile_spec import CompileSpec
from onecopy.export.exporter import export_program
from onecopy.export.partitioner import Partitioner

__all__ = ["export_program", "Partitioner", "CompileSpec"]
