"""IreeBackend: turns a manifest into a delegate running one function of an IREE module."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onecopy.delegate.engine import EngineFunction, LoadedModel, compile_bundle
from onecopy.delegate.manifest import Manifest, parse_manifest
from onecopy.delegate.targets import Target, check_target_runs_here, select_target
from onecopy.errors import DelegateError
from onecopy.program import NamedData
from onecopy.runtime.backend import Backend, DelegateHandle
from onecopy.runtime.init_context import InitContext

__all__ = ["IreeBackend", "IreeDelegate", "specialize"]

log = logging.getLogger("onecopy")


def specialize(source: memoryview, target: Target, where: str) -> bytes:
    """Compile a portable bundle for this machine. The one place an `mlir` bundle becomes code."""
    try:
        return compile_bundle(source, target, for_host=True)
    except DelegateError as e:
        raise DelegateError(f"{where}: {e}") from e


def _named(named_data: NamedData, key: str, what: str, where: str) -> memoryview:
    try:
        return named_data[key]
    except KeyError:
        raise DelegateError(f"{where}: {what} '{key}' is missing from the program's named data. Re-export it.") from None


class IreeDelegate(DelegateHandle):
    def __init__(self, model: LoadedModel, function: EngineFunction, manifest: Manifest):
        self.model: LoadedModel | None = model
        self._function: EngineFunction | None = function
        self.function = manifest.function
        self.manifest = manifest

    def execute(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        return function(inputs, outputs)

    def destroy(self) -> None:
        self._function = None
        self.model = None


class IreeBackend(Backend):
    name = "IreeBackend"
    options = {"compute_units": str}

    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> IreeDelegate:
        where = context.where
        parsed = parse_manifest(manifest, where)
        units = context.backend_options.get("compute_units", parsed.compute_units)
        started = time.perf_counter()
        if parsed.packaging == "vmfb":
            target = select_target(units, where, candidates=tuple(parsed.bundle))
            check_target_runs_here(target, where)
            code: bytes | memoryview = _named(context.named_data, parsed.bundle[target.name], "bundle", where)
            state = "restored"
        else:
            target = select_target(units, where)
            source = _named(context.named_data, parsed.bundle["portable"], "bundle", where)
            code = specialize(source, target, where)
            state = "specialized"
        parameters = {
            name: _named(context.named_data, key, f"parameter '{name}'", where)
            for name, key in parsed.parameters.items()
        }
        model = LoadedModel(code, parameters, target, where)
        function = model.function(parsed.function)
        log.info(
            "kind=%s %s key=%s ms=%.1f %s function=%s target=%s",
            parsed.packaging, state, parsed.export_hash[:12], (time.perf_counter() - started) * 1e3, where,
            parsed.function, target.name,
        )
        return IreeDelegate(model, function, parsed)
