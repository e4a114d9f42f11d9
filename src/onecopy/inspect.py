"""What a program holds, read from its header alone (no engine, no torch): for `onecopy inspect` and the demo."""

from __future__ import annotations

from dataclasses import dataclass, field

from onecopy.delegate.manifest import BACKEND, parse_manifest
from onecopy.program import DelegateCall, HostOp, LoadedProgramFile

__all__ = ["BundleSummary", "ProgramSummary", "summarize"]


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
                "inputs": [f"{s.dtype}{list(s.shape)}" for s in method.input_specs],
                "outputs": [f"{s.dtype}{list(s.shape)}" for s in method.output_specs],
                "instructions": [
                    f"delegate_call {i.delegate}" if isinstance(i, DelegateCall) else f"host_op {i.op}"
                    for i in method.instructions
                    if isinstance(i, (DelegateCall, HostOp))
                ],
                "states": list(method.states),
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
