"""What a delegate's `init` sees: its method, the program's named data, its backend options, the method meta."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from onecopy.program import NamedData

if TYPE_CHECKING:
    from onecopy.runtime.method_meta import MethodMeta

__all__ = ["InitContext", "OptionValue"]

# The value of a typed backend option (backend_options.py checks each against its backend's declared type).
OptionValue = bool | int | str


@dataclass(frozen=True)
class InitContext:
    method_name: str
    delegate_index: int
    named_data: NamedData
    backend_options: Mapping[str, OptionValue]
    program_path: Path | None
    cache_dir: Path | None
    _method_meta: Callable[[], "MethodMeta"]
    precision: str = "fp32"  # what `load_program(..., precision=)` asked of every delegate (checked there)

    def method_meta(self) -> "MethodMeta":
        return self._method_meta()

    @property
    def where(self) -> str:
        """How errors name this delegate."""
        return f"Method '{self.method_name}', delegate {self.delegate_index}"
