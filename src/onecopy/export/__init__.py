"""The AOT side: torch.export programs -> one onecopy program (needs torch, iree-turbine and the compiler)."""

import warnings

# torch.export (2.13) warns about its own internal use of a deprecated pytree class on every export; the user
# can do nothing about it, so it is kept out of their console.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

from onecopy.export.compile_spec import CompileSpec  # noqa: E402
from onecopy.export.exporter import export_program  # noqa: E402
from onecopy.export.partitioner import Partitioner  # noqa: E402

__all__ = ["export_program", "Partitioner", "CompileSpec"]
