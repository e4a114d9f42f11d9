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

from onecopy.delegate.engine import dense
from onecopy.delegate.manifest import StateEntry
from onecopy.errors import ExecutionError
from onecopy.runtime.copy_stats import CopyStats

if TYPE_CHECKING:
    from onecopy.delegate.engine import EngineFunction, LoadedModel

__all__ = ["EngineState", "state_copied_call"]


def state_copied_call(function: EngineFunction, inputs: Sequence[np.ndarray], outputs: int):
    """`invocation.call_copied` in a State's context, specialized for inputs shaped as `inputs` (as
    `EngineFunction.copied_call` is for the pool's contexts): element types, byte counts and bound methods looked
    up once. Returns `call(state, arrays, stats)`."""
    rt, model = function.rt, function.model
    device = model.device
    allocate = device.allocator.allocate_buffer_copy
    memory_type, usage = function._memory_type, function._usage
    element_types = tuple(function._element_type(array.dtype) for array in inputs)
    bytes_in = sum(int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize for array in inputs)
    vm_function, engine_error = function.vm_function, function.engine_error
    variant_list, view_type = rt.VmVariantList, rt.HalBufferView
    copy_out, indices = function.copy_out, range(outputs)
    count, result_count = len(inputs), max(outputs, 1)

    def call(state: EngineState, arrays: Sequence[np.ndarray], stats: CopyStats) -> list[np.ndarray]:
        context = state.context
        if context is None:
            raise ExecutionError(f"{state.where}: this state was closed with its program; load the program again.")
        args = variant_list(count)
        for array, element_type in zip(arrays, element_types):
            args.push_ref(allocate(memory_type=memory_type, allowed_usage=usage, device=device,
                                   buffer=dense(array), element_type=element_type))
        stats.copied_in += bytes_in
        results = variant_list(result_count)
        try:
            context.invoke(vm_function, args, results)
        except (RuntimeError, ValueError) as e:  # ValueError: IREE refused the call
            raise engine_error(e) from e
        return [copy_out(results.get_as_object(i, view_type), None, stats) for i in indices]

    return call


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
        function, results = self._invoke("onecopy_read_states", results=len(order))
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
        self._invoke("onecopy_write_states", arrays)

    def reset(self) -> None:
        self._invoke("onecopy_reset_states")

    def close(self) -> None:
        self.context = None  # its globals (the state's memory) go with it
