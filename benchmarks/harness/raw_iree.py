"""The same specialized module onecopy runs, called straight through iree.runtime with no onecopy in between: the
floor onecopy's per-call cost is measured against (`RawIree`; `RawIreeInPlace`: pure engine compute)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ENCODED_SCOPE", "RawIree", "RawIreeInPlace", "engine_device", "engine_driver"]

# The parameter scope of weights that specialization encoded (packed) for this CPU, in onecopy's cache entries.
ENCODED_SCOPE = "encoded"


def engine_driver(method: Any) -> str:
    """The IREE HAL driver a loaded onecopy Method (of one delegate) runs on: its executor's, picked at load
    (`local-task`: IREE's task workers; `local-sync`: the calling thread)."""
    (delegate,) = {id(d): d for d in method._delegates.values()}.values()
    return delegate.model.driver


def engine_device(method: Any) -> Any:
    """The IREE device `method` runs on (`engine_driver`), so that raw calls compared with it run on the same one."""
    from onecopy.delegate.engine import hal_device

    return hal_device(engine_driver(method))


class RawIree:
    """The same specialized module onecopy runs, called straight through iree.runtime: no onecopy in between.

    It loads what onecopy's cache entry holds, the way onecopy's engine does: `module.vmfb` (memory-mapped), the
    program's parameters as in-place buffers of a ParameterIndex (scope `model`) and, when the specialization
    encoded (packed) the weights for this CPU, `encoded.bin` as a second provider (scope `encoded`; either layout
    of entry.json: a byte range per parameter, or page-deduplicated runs). It calls
    `function` with a VmVariantList and VmContext.invoke: the input copied into a device buffer, the output mapped
    and copied into a new numpy array (the same work per call as onecopy's engine). It has its own VmInstance
    and local-task device unless `device` is given.

    `caller_wait`: its calls wait for IREE's workers the way onecopy's do (onecopy.delegate.caller_wait: the
    calling thread as SCHED_BATCH while a call runs on a `local-task` device), so that onecopy ÷ this measures
    onecopy's own cost per call alone; without it, the raw call waits as iree.runtime's users' calls do.
    """

    name = "raw IREE"

    def __init__(self, entry_dir: Path, program_path: Path, function: str, *, device: Any = None,
                 caller_wait: bool = False):
        import iree.runtime as rt
        import numpy as np

        # the file format reader only: to find the parameter bytes
        from onecopy.program import read_program

        self._rt, self._np = rt, np
        self._program = read_program(program_path)
        manifest = next(d.manifest for d in self._program.definition.delegates if d.manifest["function"] == function)
        self.instance = rt.VmInstance()
        self.device = device if device is not None else rt.get_driver("local-task").create_default_device()
        index = rt.ParameterIndex()
        for name, key in manifest["parameters"].items():
            index.add_buffer(name, self._program.named_data[key])
        providers = [index.create_provider(scope="model")]
        meta = json.loads((entry_dir / "entry.json").read_text())
        self.encoded_parameters = len(meta.get("encoded") or [])
        self._maps = []
        if meta.get("encoded"):
            encoded = rt.ParameterIndex()
            for e in meta["encoded"]:
                encoded.add_buffer(e["name"], self._encoded_view(entry_dir / "encoded.bin", e))
            providers.append(encoded.create_provider(scope=ENCODED_SCOPE))
        self.module = rt.VmModule.mmap(self.instance, str(entry_dir / "module.vmfb"))
        self.context = rt.VmContext(self.instance, modules=[
            rt.create_hal_module(self.instance, self.device),
            rt.create_io_parameters_module(self.instance, *providers),
            self.module,
        ])
        if caller_wait:
            from onecopy.delegate.caller_wait import BatchWaitContext

            self.context = BatchWaitContext(self.context)
        self.function = self.module.lookup_function(function)
        if self.function is None:
            raise RuntimeError(f"{entry_dir} has no function {function}: {self.module.function_names}")
        self._memory_type = rt.MemoryType.DEVICE_LOCAL
        self._usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING
        self._f32 = rt.HalElementType.FLOAT_32

    def _encoded_view(self, path: Path, e: Mapping[str, Any]) -> Any:
        """One encoded parameter of the cache entry, laid out as its entry.json describes: a byte range
        (`offset`, `size`) of encoded.bin, or (the page-deduplicated layout) `runs` of (virtual page, file page,
        count), rebuilt in one address range with onecopy's own page mapper (the same pages the engine maps)."""
        import mmap

        if "offset" in e:
            if not self._maps:
                with open(path, "rb") as f:
                    self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            return memoryview(self._maps[0])[e["offset"]: e["offset"] + e["size"]]
        if "runs" in e:
            # onecopy's page mapper, at load only: nothing of onecopy runs per call
            from onecopy.delegate.page_map import map_pages

            fd = os.open(path, os.O_RDONLY)
            try:
                view = map_pages(fd, e, owner=self)  # unmapped when this peer is collected
            finally:
                os.close(fd)
            self._maps.append(view)
            return view
        raise RuntimeError(f"{path}: unknown layout of encoded parameter {e.get('name')!r}: {sorted(e)}")

    def __call__(self, x):
        rt, np = self._rt, self._np
        device = self.device
        args = rt.VmVariantList(1)
        args.push_ref(device.allocator.allocate_buffer_copy(
            memory_type=self._memory_type, allowed_usage=self._usage, device=device, buffer=x,
            element_type=self._f32))
        results = rt.VmVariantList(1)
        self.context.invoke(self.function, args, results)
        view = results.get_as_object(0, rt.HalBufferView)
        return np.array(view.map().asarray(tuple(view.shape), np.dtype(np.float32)), copy=True)


class RawIreeInPlace(RawIree):
    """Pure engine compute of a destination-passing function (manifest `outputs_in_place`: the outputs are
    trailing arguments, written in place; the function returns a 0-d tensor): the same module as onecopy's cache
    entry, its arguments imported ONCE from the caller's arrays (`import_host_allocation`, no copy) and pushed
    into one argument list, so a call is `VmContext.invoke` and nothing else. `bind(inputs, outputs)` first."""

    name = "pure engine compute"

    def bind(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        rt = self._rt
        memory_type = rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE
        usage = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING
        args = rt.VmVariantList(len(inputs) + len(outputs))
        self._held = [*inputs, *outputs]  # the imported buffers point into these arrays: keep them alive
        for array in self._held:
            if not array.flags.c_contiguous:
                raise ValueError("RawIreeInPlace imports dense arrays only")
            buffer = self.device.allocator.import_host_allocation(array, memory_type=memory_type,
                                                                  allowed_usage=usage)
            # The constructor, not HalBuffer.create_view (which computes a wrong size for fp16).
            args.push_ref(rt.HalBufferView(buffer, list(array.shape),
                                           rt.array_interop.map_dtype_to_element_type(array.dtype)))
        self._args = args

    def __call__(self, *_: Any) -> None:
        rt = self._rt
        self.context.invoke(self.function, self._args, rt.VmVariantList(1))
