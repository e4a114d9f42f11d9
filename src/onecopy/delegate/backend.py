"""IreeBackend: turns a manifest into a delegate running one function of an IREE module."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onecopy.delegate.cache import CacheEntry, cache_disabled, cache_key, open_cache
from onecopy.delegate.engine import EngineFunction, LoadedModel, compile_bundle, compiler_version
from onecopy.delegate.manifest import Manifest, parse_manifest
from onecopy.delegate.targets import Target, check_target_runs_here, compiler_flags, host_features, select_target
from onecopy.errors import DelegateError
from onecopy.program import NamedData
from onecopy.runtime.backend import Backend, DelegateHandle
from onecopy.runtime.init_context import InitContext

__all__ = ["IreeBackend", "IreeDelegate", "specialize"]

log = logging.getLogger("onecopy")


ENV_FORBID_SPECIALIZE = "ONECOPY_FORBID_SPECIALIZE"


def specialize(source: memoryview, target: Target, where: str) -> bytes:
    """Compile a portable bundle for this machine. The one place an `mlir` bundle becomes code.

    `ONECOPY_FORBID_SPECIALIZE=1` turns any compile into an error: tests (and users who expect a warm cache)
    use it to prove a load was restored.
    """
    if os.environ.get(ENV_FORBID_SPECIALIZE, "") not in ("", "0"):
        raise DelegateError(f"{where}: specialization is forbidden ({ENV_FORBID_SPECIALIZE} is set) but the cache has no entry.")
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
    def __init__(self, model: LoadedModel, function: EngineFunction, manifest: Manifest, entry: CacheEntry | None):
        self.model: LoadedModel | None = model
        self._function: EngineFunction | None = function
        self._entry = entry  # Hold the cache entry open (mapped, safe from eviction) while the model runs.
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
        entry, self._entry = self._entry, None
        if entry is not None:
            entry.close()


class IreeBackend(Backend):
    name = "IreeBackend"
    options = {"compute_units": str, "cache_dir": str, "max_cache_bytes": int}

    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> IreeDelegate:
        where = context.where
        parsed = parse_manifest(manifest, where)
        units = context.backend_options.get("compute_units", parsed.compute_units)
        started = time.perf_counter()
        entry = None
        key = parsed.export_hash  # vmfb code runs from the program file itself: no cache entry
        if parsed.packaging == "vmfb":
            target = select_target(units, where, candidates=tuple(parsed.bundle))
            check_target_runs_here(target, where)
            code: bytes | memoryview = _named(context.named_data, parsed.bundle[target.name], "bundle", where)
            state = "restored"
        else:
            target = select_target(units, where)
            source = _named(context.named_data, parsed.bundle["portable"], "bundle", where)
            code, state, entry = self._specialized(context, parsed, units, target, source)
            if entry is not None:
                key = entry.key
        parameters = {
            name: _named(context.named_data, key, f"parameter '{name}'", where)
            for name, key in parsed.parameters.items()
        }
        model = LoadedModel(code, parameters, target, where)
        function = model.function(parsed.function)
        log.info(
            "kind=%s %s key=%s ms=%.1f %s function=%s target=%s",
            parsed.packaging, state, key[:12], (time.perf_counter() - started) * 1e3, where,
            parsed.function, target.name,
        )
        return IreeDelegate(model, function, parsed, entry)

    @staticmethod
    def _specialized(
        context: InitContext, manifest: Manifest, units: str, target: Target, source: memoryview
    ) -> tuple[bytes | memoryview, str, CacheEntry | None]:
        """The code of a portable bundle for this machine: restored from the cache, or specialized into it."""
        where = context.where
        if cache_disabled():
            return specialize(source, target, where), "specialized", None
        options = context.backend_options
        directory = options.get("cache_dir", context.cache_dir)
        cache = open_cache(directory, max_bytes=options.get("max_cache_bytes"))
        key = cache_key(
            export_hash=manifest.export_hash,
            packaging=manifest.packaging,
            compute_units=str(units),
            target=target.name,
            features=host_features(target) + "|" + " ".join(compiler_flags(target, for_host=True)),
            compiler=compiler_version(),
        )
        entry, state = cache.get_or_specialize(
            key,
            lambda: specialize(source, target, where),
            program=str(context.program_path or "<bytes>"),
            packaging=manifest.packaging,
            compute_units=str(units),
            target=target.name,
        )
        return entry.module(), state, entry
