"""IreeBackend: turns a manifest into a delegate running one function of an IREE module."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onecopy.delegate.cache import CacheEntry, SpecializationCache, cache_disabled, cache_key, open_cache
from onecopy.delegate.engine import EngineFunction, LoadedModel, compiler_version
from onecopy.delegate.specialize import specialize
from onecopy.delegate.manifest import Manifest, parse_manifest
from onecopy.delegate.targets import Target, check_target_runs_here, compiler_flags, host_features, select_target
from onecopy.delegate.shared_models import shared_models
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.program import NamedData
from onecopy.runtime.backend import Backend, DelegateHandle
from onecopy.runtime.init_context import InitContext

__all__ = ["IreeBackend", "IreeDelegate", "specialize"]

log = logging.getLogger("onecopy")


def _named(named_data: NamedData, key: str, what: str, where: str) -> memoryview:
    try:
        return named_data[key]
    except KeyError:
        raise DelegateError(f"{where}: {what} '{key}' is missing from the program's named data. Re-export it.") from None


class IreeDelegate(DelegateHandle):
    """Runs one function of a loaded model. Thread-safe: each call runs in a VM context of its own."""

    def __init__(self, model: LoadedModel, function: EngineFunction, manifest: Manifest,
                 release: Callable[[], None], shared: bool):
        self.model: LoadedModel | None = model
        self._function: EngineFunction | None = function
        self._release: Callable[[], None] | None = release
        self.function = manifest.function
        self.manifest = manifest
        self.shared = shared

    def execute(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        return function(inputs, outputs)

    def destroy(self) -> None:
        release, self._release = self._release, None
        self._function = None
        self.model = None
        if release is not None:
            release()


@dataclass(frozen=True)
class _Resolved:
    """Where and from what a delegate's model loads, decided before loading (and before the shared table)."""

    manifest: Manifest
    units: str
    target: Target
    cache: SpecializationCache | None
    cache_key: str | None

    @property
    def key_prefix(self) -> str:
        return (self.cache_key or self.manifest.export_hash)[:12]

    def table_key(self) -> Hashable:
        """Key of the shared-model table: (cache directory identity, cache key). A vmfb bundle runs from the
        program file itself, so its model is identified by export hash, target and compute units instead."""
        if self.cache is not None:
            return (self.cache.identity, self.cache_key)
        return (None, self.manifest.packaging, self.manifest.export_hash, self.target.name, self.units)


class IreeBackend(Backend):
    name = "IreeBackend"
    options = {
        "compute_units": str,
        "cache_dir": str,
        "max_cache_bytes": int,
        "share_multifunction_model": bool,
    }

    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> IreeDelegate:
        where = context.where
        parsed = parse_manifest(manifest, where)
        options = context.backend_options
        share = options.get("share_multifunction_model", False)
        if share and not parsed.multifunction:
            raise InvalidArgument(
                f"{where}: backend 'IreeBackend' option share_multifunction_model=True needs a program exported "
                "with Partitioner(multifunction=True): this delegate has a module of its own, so there is no model "
                "to share. Re-export with multifunction=True, or drop the option."
            )
        resolved = self._resolve(context, parsed)
        started = time.perf_counter()
        if share:
            table_key = resolved.table_key()
            model, loaded_here = shared_models.acquire(table_key, lambda: self._load(context, resolved))
            state = model.load_state if loaded_here else "restored"
            release: Callable[[], None] = lambda: shared_models.release(table_key)
        else:
            model = self._load(context, resolved)
            state = model.load_state
            release = model.close
        try:
            function = model.function(parsed.function)
        except BaseException:
            release()
            raise
        log.info(
            "kind=%s %s key=%s ms=%.1f %s function=%s target=%s%s",
            parsed.packaging, state, resolved.key_prefix, (time.perf_counter() - started) * 1e3, where,
            parsed.function, resolved.target.name, " shared" if share else "",
        )
        return IreeDelegate(model, function, parsed, release, share)

    @staticmethod
    def _resolve(context: InitContext, manifest: Manifest) -> _Resolved:
        where = context.where
        units = context.backend_options.get("compute_units", manifest.compute_units)
        if manifest.packaging == "vmfb":
            target = select_target(units, where, candidates=tuple(manifest.bundle))
            check_target_runs_here(target, where)
            return _Resolved(manifest, units, target, None, None)
        target = select_target(units, where)
        if cache_disabled():
            return _Resolved(manifest, units, target, None, None)
        options = context.backend_options
        cache = open_cache(options.get("cache_dir", context.cache_dir), max_bytes=options.get("max_cache_bytes"))
        key = cache_key(
            export_hash=manifest.export_hash,
            packaging=manifest.packaging,
            compute_units=units,
            target=target.name,
            features=host_features(target) + "|" + " ".join(compiler_flags(target, for_host=True)),
            compiler=compiler_version(),
        )
        return _Resolved(manifest, units, target, cache, key)

    @staticmethod
    def _load(context: InitContext, resolved: _Resolved) -> LoadedModel:
        """Build the model: vmfb code in place from the program file; mlir code restored from the cache entry
        (or specialized into it). Parameters always come from the program's mapping, never copied."""
        where, manifest, target = context.where, resolved.manifest, resolved.target
        entry: CacheEntry | None = None
        encoded: dict[str, memoryview] = {}
        parameters = {
            name: _named(context.named_data, key, f"parameter '{name}'", where)
            for name, key in manifest.parameters.items()
        }
        if manifest.packaging == "vmfb":
            code: bytes | memoryview = _named(context.named_data, manifest.bundle[target.name], "bundle", where)
            state = "restored"
        else:
            source = _named(context.named_data, manifest.bundle["portable"], "bundle", where)
            if resolved.cache is None:
                result = specialize(source, parameters, target, where)
                code, state = result.module, "specialized"
                encoded = {name: memoryview(array) for name, array in result.encoded.items()}
            else:
                entry, state = resolved.cache.get_or_specialize(
                    resolved.cache_key,  # type: ignore[arg-type]
                    lambda: specialize(source, parameters, target, where),
                    program=str(context.program_path or "<bytes>"),
                    packaging=manifest.packaging,
                    compute_units=resolved.units,
                    target=target.name,
                )
                code, encoded = entry.module(), entry.encoded()
        try:
            model = LoadedModel(code, parameters, target, where, encoded=encoded, keepalive=entry)
        except BaseException:
            if entry is not None:
                entry.close()
            raise
        model.load_state = state
        return model
