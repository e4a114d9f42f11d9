"""The OpenVINO alternative of each method (`CompileSpec(delegates=("iree", "openvino"))`), over the program's one
weights store.

A method gets one when IREE runs it whole: one delegate call taking the method's inputs and returning its
outputs, no host ops, no state, static shapes. `openvino.convert_model` converts its `torch.export` program; the
IR's constants go into the named data store under the key of the parameter with the same bytes where there is one
(see onecopy.delegate.openvino.ir), and OpenVINO's own constants (folded ones) as blobs of their own, counted in
the manifest's `folded_bytes` and logged. The IR's xml is stored as code (`bundle/….openvino.xml`). The program
converted is the one IREE lowers, batch norms already folded (onecopy.export.batch_norm_folding), so OpenVINO has
no weights of its own to compute.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path

import msgspec
from torch.export import ExportedProgram

from onecopy.delegate.openvino.ir import split_constants
from onecopy.delegate.openvino.manifest import BACKEND, MANIFEST_VERSION, OpenVinoManifest
from onecopy.errors import ExportError
from onecopy.export.compile_spec import CompileSpec
from onecopy.program import DelegateCall, DelegateDef, MethodDef, ProgramFile

__all__ = ["add_openvino_alternatives", "why_not_whole"]

log = logging.getLogger("onecopy")


def why_not_whole(method: MethodDef) -> str | None:
    """Why the OpenVINO delegate cannot run `method` in IREE's place, or None when it can."""
    calls = [ins for ins in method.instructions if isinstance(ins, DelegateCall)]
    if len(method.instructions) != 1 or len(calls) != 1:
        return "it has graph breaks (host ops between engine partitions)"
    if calls[0].inputs != method.inputs or calls[0].outputs != method.outputs:
        return "its engine call does not take exactly the method's inputs and return its outputs"
    if method.states:
        return "it keeps state (the engine holds its buffers between calls)"
    if method.constants:
        return "it reads constants on the host"
    if any(isinstance(d, str) for spec in [*method.input_specs, *method.output_specs] for d in spec.shape):
        return "it has dynamic shapes"
    return None


def _convert(ep: ExportedProgram, name: str) -> tuple[str, bytes]:
    try:
        import openvino as ov
    except ImportError as e:
        raise ExportError("CompileSpec(delegates=(..., 'openvino')) needs the openvino package at export; install "
                          "it with `pip install 'onecopy[openvino]'`.") from e
    try:
        model = ov.convert_model(ep)
        with tempfile.TemporaryDirectory(prefix="onecopy-openvino-") as tmp:
            xml = Path(tmp) / "model.xml"
            ov.save_model(model, xml, compress_to_fp16=False)  # fp32 weights, as torch's: byte-equal where kept
            return xml.read_text(), xml.with_suffix(".bin").read_bytes()
    except Exception as e:
        raise ExportError(f"Method '{name}': OpenVINO cannot convert it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); export without 'openvino' in "
                          "CompileSpec.delegates.") from e


def add_openvino_alternatives(program: ProgramFile, methods: Mapping[str, ExportedProgram],
                              specs: Mapping[str, CompileSpec]) -> ProgramFile:
    """`program` with an OpenVINO delegate added as an alternative of each method whose spec asks for one and that
    IREE runs whole (the others are logged with the reason)."""
    definition, store = program.definition, program.data
    by_content = {blob.sha256: key for key, blob in store.items() if key.startswith("param/")}
    delegates = list(definition.delegates)
    method_defs = []
    for method in definition.methods:
        if "openvino" not in specs[method.name].delegates:
            method_defs.append(method)
            continue
        reason = why_not_whole(method)
        if reason is not None:
            log.warning("method %s: no OpenVINO delegate: %s; IREE runs it alone.", method.name, reason)
            method_defs.append(method)
            continue
        ep = methods[method.name]
        xml_text, weights = _convert(ep, method.name)
        placed, folded, kept = {}, 0, 0
        for layer, data in split_constants(xml_text, weights).items():
            digest = hashlib.sha256(data).hexdigest()
            key = by_content.get(digest)
            if key is None:
                key = f"openvino/const/{digest[:40]}"
                store.add(key, data, alignment=64)
                folded += len(data)
            else:
                kept += len(data)
            placed[layer] = key
        h = hashlib.sha256(b"openvino:" + xml_text.encode())
        for layer in sorted(placed):
            h.update(f"{layer}:{store.digest(placed[layer])}".encode())
        export_hash = h.hexdigest()
        model_key = f"bundle/{export_hash[:40]}.openvino.xml"
        store.add(model_key, xml_text.encode())
        signature = ep.graph_signature
        manifest = OpenVinoManifest(
            version=MANIFEST_VERSION, export_hash=export_hash, model=model_key, weights=placed,
            input_names=[str(getattr(s.arg, "name", i)) for i, s in enumerate(signature.input_specs)
                         if s.kind.name == "USER_INPUT"],
            output_names=[str(getattr(s.arg, "name", i)) for i, s in enumerate(signature.output_specs)
                          if s.kind.name == "USER_OUTPUT"],
            folded_bytes=folded,
        )
        log.info("method %s: OpenVINO delegate: %d constants, %d B shared with IREE's parameters, %d B of its own "
                 "(folded at conversion)", method.name, len(placed), kept, folded)
        method_defs.append(msgspec.structs.replace(method, alternatives=[len(delegates)]))
        delegates.append(DelegateDef(backend=BACKEND, manifest=manifest.to_dict()))
    return ProgramFile(msgspec.structs.replace(definition, methods=method_defs, delegates=delegates), store)
