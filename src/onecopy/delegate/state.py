"""Program state in the IREE engine: one VM context per `State`, over the model's one module and parameters.

A module that holds state (manifest field `states`) keeps each state as a mutable global, and a VM context holds
its own copy of every global: so a context IS a state's storage, updated in place by each call made in it, and
several contexts over one loaded model are independent states sharing one copy of the weights. The functions of
all methods of the module (prefill, decode) run in the same context, which is how they share the cache. Nothing
of a state crosses into Python per call; reads, writes and resets go through the module's helper functions
(see onecopy.export.state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onecopy.delegate.manifest import READ_STATES, RESET_STATES, WRITE_STATES, StateEntry
from onecopy.errors import ExecutionError
from onecopy.runtime.copy_stats import CopyStats

if TYPE_CHECKING:
    from onecopy.delegate.engine import EngineFunction, LoadedModel

__all__ = ["EngineState"]


class EngineState:
    """The states of one loaded module for one `State`: a VM context of its own (never pooled)."""

    def __init__(self, model: LoadedModel, entries: Sequence[StateEntry], where: str):
        self.model = model
        self.where = where
        self.entries = {e.name: e for e in entries}
        self.context = model.checkout()  # the load-time context when free: it was made for exactly this
        self._functions: dict[str, Any] = {}
        if any(e.initial is not None for e in entries):
            self.reset()  # the globals start as zero splats; the initial values are copied in here

    def _function(self, name: str) -> EngineFunction:
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.model.function(name)
        return function

    def _invoke(self, name: str, arrays: Sequence[np.ndarray] = (), results: int = 1) -> tuple[EngineFunction, Any]:
        function = self._function(name)
        rt = function.rt
        args = rt.VmVariantList(len(arrays))
        for array in arrays:
            args.push_ref(function.copy_in(array))
        out = rt.VmVariantList(results)
        context = self.context
        if context is None:
            raise ExecutionError(f"{self.where}: this state was closed with its program; load the program again.")
        try:
            context.invoke(function.vm_function, args, out)
        except (RuntimeError, ValueError) as e:  # ValueError: IREE refused the call
            raise function.engine_error(e) from e
        return function, out

    def read_all(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the states `names` (None: all). The engine clones every state; only `names` are copied out."""
        order = list(self.entries)
        function, results = self._invoke(READ_STATES, results=len(order))
        view = function.rt.HalBufferView
        return {name: function.copy_out(results.get_as_object(order.index(name), view), None, CopyStats())
                for name in (names if names is not None else order)}

    def read(self, name: str) -> np.ndarray:
        return self.read_all([name])[name]

    def write(self, values: dict[str, np.ndarray]) -> None:
        """Set the states in `values`; the others keep theirs (read and written back)."""
        missing = [name for name in self.entries if name not in values]
        current = self.read_all(missing) if missing else {}
        arrays = [np.require(values[n] if n in values else current[n], requirements="C") for n in self.entries]
        self._invoke(WRITE_STATES, arrays)

    def reset(self) -> None:
        self._invoke(RESET_STATES)

    def close(self) -> None:
        self.context = None  # its globals (the state's memory) go with it
