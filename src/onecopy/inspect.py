"""What a program holds, read from its header alone (no engine, no torch): for `onecopy inspect` and the demo.
What this machine's specialization cache holds for it (how each bundle was specialized and tuned) is read from
the entries' entry.json, without opening the cache."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onecopy.delegate.cache_entry import META, CacheLayout
from onecopy.delegate.cache_key import default_cache_dir
from onecopy.delegate.manifest import BACKEND, parse_manifest
from onecopy.delegate.openvino.manifest import BACKEND as OPENVINO_BACKEND
from onecopy.delegate.openvino.manifest import parse_manifest as parse_openvino_manifest
from onecopy.program import DelegateCall, HostOp, LoadedProgramFile

__all__ = ["BundleSummary", "AlternativeSummary", "ProgramSummary", "SpecializationSummary", "describe_tuning",
           "specializations", "summarize", "recorded_choices", "describe_choice", "report"]


@dataclass
class BundleSummary:
    export_hash: str
    packaging: str
    code_bytes: dict[str, int]  # bundle key -> bytes
    functions: list[str] = field(default_factory=list)
    encoder_bytes: dict[str, int] = field(default_factory=dict)  # target -> bytes of its parameter encoder (vmfb)
    parameters: dict[str, int] = field(default_factory=dict)  # parameter name -> bytes
    delegates: list[int] = field(default_factory=list)


@dataclass
class AlternativeSummary:
    """A delegate that can run a method whole instead of its instructions (OpenVINO): its IR's size, and its
    constants' bytes shared with IREE's parameters vs its own (computed by OpenVINO, e.g. folded batch norms)."""

    delegate: int
    backend: str
    export_hash: str
    model_bytes: int
    shared_bytes: int
    own_bytes: int


@dataclass
class ProgramSummary:
    file_bytes: int
    code_bytes: int  # unique bundle bytes
    parameter_bytes: int  # unique parameter bytes
    bundles: list[BundleSummary]
    methods: list[dict]
    states: list[str] = field(default_factory=list)  # "name dtype[shape] (zeros | initial value)"


def summarize(loaded: LoadedProgramFile, file_bytes: int) -> ProgramSummary:
    definition = loaded.definition
    sizes = {s.key: s.length for s in definition.segments}
    bundles: dict[str, BundleSummary] = {}
    for index, delegate in enumerate(definition.delegates):
        if delegate.backend != BACKEND:
            continue  # another backend's manifest follows its own schema
        manifest = parse_manifest(delegate.manifest, f"Program '{loaded.source}', delegate {index} ({delegate.backend})")
        bundle = bundles.get(manifest.export_hash)
        if bundle is None:
            bundle = BundleSummary(
                manifest.export_hash,
                manifest.packaging,
                {key: sizes.get(key, 0) for key in manifest.bundle.values()},
                parameters={name: sizes.get(key, 0) for name, key in manifest.parameters.items()},
                encoder_bytes={target: sizes.get(key, 0) for target, key in manifest.encoders.items()},
            )
            bundles[manifest.export_hash] = bundle
        bundle.functions.append(manifest.function)
        bundle.delegates.append(index)
    kinds: dict[str, dict[str, int]] = {}  # kind -> content hash -> bytes: each distinct blob counted once
    for segment in definition.segments:
        kind = "code" if segment.key.startswith("bundle/") else "parameters"
        kinds.setdefault(kind, {})[segment.sha256] = segment.length
    methods = []
    for method in definition.methods:
        methods.append(
            {
                "name": method.name,
                "inputs": [f"{name}: {s.dtype}{list(s.shape)}" if name else f"{s.dtype}{list(s.shape)}"
                           for s, name in zip(method.input_specs, method.input_names or [""] * len(method.input_specs))],
                "outputs": [f"{s.dtype}{list(s.shape)}" for s in method.output_specs],
                "instructions": [
                    f"delegate_call {i.delegate}" if isinstance(i, DelegateCall) else f"host_op {i.op}"
                    for i in method.instructions
                    if isinstance(i, (DelegateCall, HostOp))
                ],
                "states": list(method.states),
                "alternatives": [_alternative(definition, i, sizes, loaded.source) for i in method.alternatives],
                "export_hashes": [str(definition.delegates[i.delegate].manifest.get("export_hash", ""))
                                  for i in method.instructions if isinstance(i, DelegateCall)],
            }
        )
    return ProgramSummary(
        file_bytes=file_bytes,
        code_bytes=sum(kinds.get("code", {}).values()),
        parameter_bytes=sum(kinds.get("parameters", {}).values()),
        bundles=list(bundles.values()),
        methods=methods,
        states=[f"{s.name} {s.spec.dtype}{list(s.spec.shape)} ({'zeros' if s.initial is None else 'initial value'})"
                for s in definition.states],
    )


def _alternative(definition, index: int, sizes: dict[str, int], source: str) -> AlternativeSummary:
    delegate = definition.delegates[index]
    if delegate.backend != OPENVINO_BACKEND:
        return AlternativeSummary(index, delegate.backend, "", 0, 0, 0)
    manifest = parse_openvino_manifest(delegate.manifest, f"Program '{source}', delegate {index} ({delegate.backend})")
    keys = set(manifest.weights.values())
    shared = sum(sizes.get(k, 0) for k in keys if k.startswith("param/"))
    return AlternativeSummary(index, delegate.backend, manifest.export_hash, sizes.get(manifest.model, 0), shared,
                              sum(sizes.get(k, 0) for k in keys) - shared)


def recorded_choices(cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The choices `load_program(prefer="latency")` recorded in `cache_dir` (None: the default), as written
    (onecopy.runtime.selection); an unreadable record is left out."""
    directory = (default_cache_dir() if cache_dir is None else Path(cache_dir)) / "choices"
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("latency_ms"), dict):
            found.append(record)
    return found


def describe_choice(record: dict[str, Any]) -> str:
    """One line: the backend prefer="latency" runs, each candidate's latency and what its load added to memory."""
    timings = ", ".join(f"{backend} {ms:.3f} ms" for backend, ms in record["latency_ms"].items())
    memory = "; ".join(f"{backend} +{m.get('rss', 0):.1f} MiB RSS, +{m.get('pss', 0):.1f} MiB PSS"
                       for backend, m in (record.get("memory_mb") or {}).items())
    note = f"; {record['note']}" if record.get("note") else ""
    return f"{record.get('backend')} ({timings}; a load added {memory}{note})"


@dataclass
class SpecializationSummary:
    """A cache entry made for a bundle on this machine: its key, target, what tuning chose (None: not tuned) and
    each function's latency on both CPU executors (None: not timed, a vmfb program's entry or a GPU's)."""

    key: str
    target: str
    tuning: dict[str, Any] | None
    precision: str = "fp32"  # entries written before precision was recorded are fp32: there was no other
    executors: dict[str, Any] | None = None
    packaging: str = "mlir"  # vmfb: its code was compiled at export; the entry holds the weights packed here


def specializations(export_hashes: Collection[str], cache_dir: str | os.PathLike[str] | None = None
                    ) -> dict[str, list[SpecializationSummary]]:
    """The cache entries of each bundle (by export hash) in `cache_dir` (None: the default cache directory).
    Reads entry.json files only; an unreadable one is left out (`onecopy cache verify` reports it)."""
    entries = CacheLayout(default_cache_dir() if cache_dir is None else Path(cache_dir)).entries
    found: dict[str, list[SpecializationSummary]] = {}
    if not entries.is_dir():
        return found
    for path in sorted(entries.iterdir()):
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("export_hash") in export_hashes:
            tuning = meta.get("tuning") if isinstance(meta.get("tuning"), dict) else None
            executors = meta.get("executors") if isinstance(meta.get("executors"), dict) else None
            found.setdefault(meta["export_hash"], []).append(SpecializationSummary(
                path.name, str(meta.get("target")), tuning, str(meta.get("precision", "fp32")), executors,
                str(meta.get("packaging", "mlir"))))
    return found


def describe_tuning(tuning: dict[str, Any] | None, packaging: str = "mlir") -> str:
    """One line: the configuration chosen and each candidate's latency (or why it was not kept). A `vmfb`
    entry's code was compiled at export: tuned, it chose between the program's precisions of it."""
    if tuning is None:
        if packaging == "vmfb":
            return "code compiled at export, weights packed here (nothing to choose between)"
        return "not tuned (backend option tune=False): the default configuration"
    if len(tuning.get("candidates", [])) <= 1:
        return f"the default configuration ({tuning.get('note') or 'one candidate'})"
    trials = []
    for trial in tuning["candidates"]:
        shown = f"{trial['latency_ms']:.3f} ms" if trial.get("latency_ms") is not None else ""
        if trial.get("ratio_to_kept") is not None:  # what decided: timed side by side with the one kept then
            shown += f" ({trial['ratio_to_kept']:.2f}x the kept one's time)"
        if trial.get("error"):
            shown = f"{shown}, {trial['error']}" if shown else trial["error"]
        trials.append(f"{trial['name']} {shown}")
    budget = f" of a {tuning['budget_s']:.1f} s budget" if tuning.get("budget_s") is not None else ""
    note = "".join(f"; {tuning[key]}" for key in ("note", "order") if tuning.get(key))
    if tuning.get("chosen_precision", tuning.get("precision")) != tuning.get("precision"):
        note += (f"; {tuning['precision']} allowed, {tuning['chosen_precision']} measured faster here: runs in "
                 f"{tuning['chosen_precision']}")
    return (f"tuned: chose {tuning['chosen']} in {tuning.get('elapsed_s', 0):.1f} s{budget} "
            f"({'; '.join(trials)}){note}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(loaded: LoadedProgramFile, path: str | os.PathLike[str],
           cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """`onecopy inspect`'s lines: the program's methods, states and bundles, and what this machine's cache made
    of each bundle (tuning, executor timings) and chose for methods with alternatives."""
    from onecopy.delegate.executors import describe as describe_executors

    lines = []
    summary = summarize(loaded, os.path.getsize(path))
    lines.append(f"program {path}: {_mib(summary.file_bytes)}")
    lines.append(f"  code {_mib(summary.code_bytes)}, parameters {_mib(summary.parameter_bytes)} (each stored once)")
    for method in summary.methods:
        lines.append(f"method {method['name']}: ({', '.join(method['inputs'])}) -> ({', '.join(method['outputs'])})")
        lines.extend(f"    {ins}" for ins in method["instructions"])
        if method.get("states"):
            lines.append(f"    state: {', '.join(method['states'])}")
        for alt in method["alternatives"]:  # another engine that can run the method whole (prefer="latency")
            lines.append(f"    alternative: delegate {alt.delegate} {alt.backend}: IR {_mib(alt.model_bytes)}, "
                         f"constants {_mib(alt.shared_bytes)} shared with IREE's parameters + {_mib(alt.own_bytes)} "
                         "of its own")
        if method["alternatives"]:
            hashes = {*method["export_hashes"], *(a.export_hash for a in method["alternatives"])}
            chosen = [r for r in recorded_choices(cache_dir)
                      if r.get("method") == method["name"] and set(r.get("export_hashes", [])) <= hashes]
            lines.extend(f"    prefer=latency here: {describe_choice(record)}" for record in chosen)
            if not chosen:
                lines.append("    prefer=latency here: not measured yet (the first such load times the delegates)")
    lines.extend(f"state {state}" for state in summary.states)  # kept by the engine between calls, in place
    specialized = specializations([b.export_hash for b in summary.bundles], cache_dir)
    for bundle in summary.bundles:
        code = ", ".join(f"{key.rsplit('/', 1)[-1]} {_mib(n)}" for key, n in bundle.code_bytes.items())
        lines.append(f"bundle {bundle.export_hash[:12]} ({bundle.packaging}): {code}")
        lines.append(f"    functions: {', '.join(bundle.functions)} "
                     f"(delegates {', '.join(map(str, bundle.delegates))})")
        lines.append(f"    parameters: {len(bundle.parameters)} shared by its functions, "
                     f"{_mib(sum(bundle.parameters.values()))}")
        if bundle.encoder_bytes:  # vmfb: the weights each CPU target's code reads packed, made once per machine
            encoders = ", ".join(f"{target} {_mib(n)}" for target, n in bundle.encoder_bytes.items())
            lines.append(f"    parameter encoders (pack the weights once per machine): {encoders}")
        for entry in specialized.get(bundle.export_hash, []):  # what this machine's cache made of it
            lines.append(f"    specialized here for {entry.target}, {entry.precision} (cache entry {entry.key[:12]}): "
                         f"{describe_tuning(entry.tuning, entry.packaging)}")
            if entry.executors is not None:  # executor="auto" picks from these
                lines.append(f"    executors (mean latency, the faster): {describe_executors(entry.executors)}")
    return lines
