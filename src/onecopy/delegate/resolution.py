"""Resolution: where and from what a delegate's model loads, decided from its manifest and options before anything
is loaded (and before the shared-model table is consulted): the target, the executor and its task workers, the
precision, and the specialization cache entry's key (what decides the compiled code: export hash, packaging,
compute units, target, this CPU's features and flags, the compiler's version).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from onecopy.delegate.cache import SpecializationCache, cache_disabled, cache_key, open_cache
from onecopy.delegate.engine import compiler_version, runtime_version
from onecopy.delegate.manifest import PORTABLE, Manifest, bundle_key, split_bundle_key
from onecopy.delegate.precision import aot_precision, check_precision_runs_here, precision_flags
from onecopy.delegate.targets import (
    Target, check_target_runs_here, compiler_flags, cpu_flags, host_features, runtime_driver, select_target,
)
from onecopy.errors import InvalidArgument
from onecopy.runtime.backend_options import DEFAULT_PRECISION
from onecopy.runtime.init_context import InitContext

__all__ = ["Resolved", "resolve", "tunes"]


def _driver(context: InitContext, target: Target) -> str:
    options = context.backend_options
    driver = runtime_driver(target, options.get("executor"), context.where, threads=options.get("threads"))
    if options.get("recalibrate") and driver:
        named = ", ".join(f"{k}={options[k]!r}" for k in ("executor", "threads") if options.get(k) is not None)
        raise InvalidArgument(
            f"{context.where}: backend option recalibrate=True measures which CPU executor to use, but this load "
            + (f"names one ({named})" if named else f"runs on {target.name}, which has no CPU executors")
            + ". Drop recalibrate, or load with executor='auto' on the CPU.")
    return driver


def tunes(context: InitContext, manifest: Manifest) -> bool:
    """Whether specialization tries several configurations (onecopy.delegate.tuning). Not for a module holding
    state (an LLM): one executor serves all its functions (onecopy.delegate.executors), chosen over prefill and
    decode alike, and a configuration that makes prefill faster on IREE's workers moved the tiny Llama's decode
    there too: 27% slower a token in a decode loop (2048-token cache) though tuning had timed that configuration
    faster. Until the executor choice weighs the functions as a generation calls them, such modules keep the
    default configuration."""
    return bool(context.backend_options.get("tune", True)) and not manifest.states


@dataclass(frozen=True)
class Resolved:
    """Where and from what a delegate's model loads, decided before loading (and before the shared table)."""

    manifest: Manifest
    units: str
    target: Target
    cache: SpecializationCache | None
    cache_key: str | None
    precision: str = "fp32"
    driver: str = ""  # the HAL driver the model runs on; "" on a CPU: the executor measured faster (executors.py)
    workers: int | None = None  # IREE task workers (backend option threads); None: one per physical core
    bundle: str = PORTABLE  # the manifest's `bundle` (and `encoders`) key of the code loaded
    # vmfb in bf16: the same target's fp32 code, which the load that encodes the weights times against the bf16
    # code, running whichever measured faster (bf16 is allowed, not forced: tuning.with_fp32). None: no choice.
    fp32_bundle: str | None = None
    tuned: bool = False  # mlir: specialized tuned (`tunes`): in the cache key's features and the uncached table key

    @property
    def key_prefix(self) -> str:
        return (self.cache_key or self.manifest.export_hash)[:12]

    def table_key(self) -> Hashable:
        """Key of the shared-model table: (cache directory identity, cache key). A vmfb bundle without a cache entry
        (no parameter encoder for its target, or the cache disabled) runs from the program file alone, so its model
        is identified by export hash, target and compute units instead."""
        if self.cache is not None:
            return (self.cache.identity, self.cache_key, self.driver, self.workers)
        # Whether its code was chosen by timing (tuned; a vmfb's precision) decides the code, as the key would.
        return (None, self.manifest.packaging, self.manifest.export_hash, self.target.name, self.units, self.precision,
                self.tuned, self.fp32_bundle, self.driver, self.workers)


def resolve(context: InitContext, manifest: Manifest) -> Resolved:
    where = context.where
    units = context.backend_options.get("compute_units", manifest.compute_units)
    precision, threads = context.precision, context.backend_options.get("threads")
    if manifest.packaging == "vmfb":
        target = select_target(units, where, candidates=tuple(manifest.bundle))  # fp32 keys: the targets' names
        check_target_runs_here(target, where)
        bundle = _vmfb_bundle(manifest, target, precision, where)
        driver = _driver(context, target)
        fp32 = bundle_key(target.name)
        fp32_bundle = fp32 if (bundle != fp32 and bundle in manifest.encoders and fp32 in manifest.encoders
                               and tunes(context, manifest)) else None
        # The code runs from the program file; only the weights its encoder packs are cached, when it has one.
        if bundle not in manifest.encoders or cache_disabled():
            return Resolved(manifest, units, target, None, None, precision, driver, threads, bundle, fp32_bundle)
        # The encoder is code in the program (its hash is in the export hash) run by the IREE runtime: no
        # compiler is involved, nor needed, on a device loading a vmfb program. Its precision is in the key
        # (fp32 keys stay those of entries made before vmfb programs had precisions), and whether its entry
        # chose between it and fp32 ("|tuned": entries made before always ran the bf16 code).
        features, engine = host_features(target), f"runtime {runtime_version()}"
        features += f"|{precision}" if precision != DEFAULT_PRECISION else ""
        features += "|tuned" if fp32_bundle else ""
    else:
        target = select_target(units, where)
        driver = _driver(context, target)
        check_precision_runs_here(precision, compute_unit=target.compute_unit, cpu_flags=cpu_flags(), where=where)
        tuned = tunes(context, manifest)
        if cache_disabled():
            return Resolved(manifest, units, target, None, None, precision, driver, threads, tuned=tuned)
        flags = [*compiler_flags(target, for_host=True), *precision_flags(precision)]
        features = host_features(target) + "|" + " ".join(flags)
        features += "|tuned" if tuned else ""
        engine = compiler_version()
    features += "|executors" if target.compute_unit == "cpu" else ""  # entries made since they are timed
    options = context.backend_options
    cache = open_cache(options.get("cache_dir", context.cache_dir), max_bytes=options.get("max_cache_bytes"))
    key = cache_key(
        export_hash=manifest.export_hash,
        packaging=manifest.packaging,
        compute_units=units,
        target=target.name,
        features=features,
        compiler=engine,
    )
    if manifest.packaging == "vmfb":
        return Resolved(manifest, units, target, cache, key, precision, driver, threads, bundle, fp32_bundle)
    return Resolved(manifest, units, target, cache, key, precision, driver, threads, tuned=tuned)


def _vmfb_bundle(manifest: Manifest, target: Target, precision: str, where: str) -> str:
    """The `bundle` key of the vmfb code this load runs: `target`'s in `precision`, checked to be in the program
    and to run on this CPU."""
    key = bundle_key(target.name, precision)
    if precision == DEFAULT_PRECISION:
        return key
    if key not in manifest.bundle:
        held = sorted({split_bundle_key(k)[1] for k in manifest.bundle if split_bundle_key(k)[0] == target.name})
        raise InvalidArgument(
            f"{where}: precision='{precision}' but this vmfb program holds {target.name} code in {', '.join(held)} "
            f"only. Re-export with CompileSpec(packaging='vmfb', precisions=('fp32', '{precision}')) or "
            f"packaging='mlir', or load with precision='{DEFAULT_PRECISION}'.")
    aot = aot_precision(target.name, precision)
    check_precision_runs_here(precision, compute_unit=target.compute_unit, cpu_flags=cpu_flags(), where=where,
                              needs=aot.cpu_flags if aot else ())
    return key
