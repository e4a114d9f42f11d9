"""Delivery: the lowered bundles, their parameters and one typed manifest per delegate into the program file."""

from __future__ import annotations

import hashlib

from onecopy.delegate.manifest import BACKEND, MANIFEST_VERSION, PORTABLE, Manifest
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.lowering import LoweredBundle
from onecopy.export.method_plan import DelegatePartition
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.export.state import ProgramStates, held_states
from onecopy.program import DelegateDef, MethodDef, NamedDataStore, ProgramDef, ProgramFile

__all__ = ["deliver", "assemble"]


def deliver(
    bundle: LoweredBundle, table: ParameterTable, parameters: list[str], store: NamedDataStore
) -> tuple[str, dict[str, str], dict[str, str], dict[str, str]]:
    """Put a bundle, its parameter encoders and its parameters into the named data store. Returns (export hash,
    bundle keys, encoder keys, parameters)."""
    h = hashlib.sha256(bundle.packaging.encode())
    for target in sorted(bundle.code):
        h.update(f"{target}:{hashlib.sha256(bundle.code[target]).hexdigest()}".encode())
    for target in sorted(bundle.encoders):  # what the encoded weights are computed by: part of the identity
        h.update(f"encoder {target}:{hashlib.sha256(bundle.encoders[target]).hexdigest()}".encode())
    for name in sorted(parameters):
        h.update(f"{name}:{table.digests[name]}".encode())
    export_hash = h.hexdigest()
    suffix = {"mlir": "mlirbc", "vmfb": "vmfb"}[bundle.packaging]
    keys = {}
    for target, code in bundle.code.items():
        keys[target] = f"bundle/{export_hash[:40]}.{target}.{suffix}" if target != PORTABLE else f"bundle/{export_hash[:40]}.{suffix}"
        store.add(keys[target], code)
    encoders = {}
    for target, encoder in bundle.encoders.items():
        encoders[target] = f"bundle/{export_hash[:40]}.{target}.encoder.{suffix}"  # code: `bundle/` like the rest
        store.add(encoders[target], encoder)
    bound = {}
    for name in parameters:
        bound[name] = parameter_key(table.digests[name])
        store.add(bound[name], ParameterTable.host_bytes(table.tensors[name]))
    return export_hash, keys, encoders, bound


def assemble(
    method_defs: list[MethodDef], partitions: list[DelegatePartition], groups: list[list[tuple[DelegatePartition, str]]],
    bundles: list[LoweredBundle], specs: dict[str, CompileSpec], table: ParameterTable, states: ProgramStates,
    *, multifunction: bool,
) -> ProgramFile:
    """The program file: the methods, one delegate per partition with its manifest, and the named data (bundles,
    parameters, and the weights host ops read as constants), each blob stored once."""
    store = NamedDataStore()
    for constant in (c for m in method_defs for c in m.constants):
        name = next(n for n, d in table.digests.items() if parameter_key(d) == constant.key)
        store.add(constant.key, ParameterTable.host_bytes(table.tensors[name]))

    manifests: dict[int, Manifest] = {}  # delegate index -> its manifest: every partition is in one group
    for group, bundle in zip(groups, bundles):
        compile_spec = specs[group[0][0].method]  # one spec per group: checked equal for multifunction
        held = held_states(group)
        used = list(dict.fromkeys([*(name for p, _ in group for name in p.parameters),
                                   *(s.initial for s in held if s.initial is not None)]))
        export_hash, keys, encoders, bound = deliver(bundle, table, used, store)
        for p, function in group:
            manifests[p.delegate] = Manifest(
                version=MANIFEST_VERSION,
                packaging=compile_spec.packaging,
                export_hash=export_hash,
                bundle=keys,
                function=function,
                input_names=p.input_names,
                output_names=p.output_names,
                output_dtypes=p.output_dtypes,
                compute_units=compile_spec.compute_units,
                parameters=bound,
                multifunction=multifunction,
                outputs_in_place=p.outputs_in_place,
                encoders=encoders,
                states=[s.manifest() for s in held],
                signatures=bundle.signatures,
            )
    definition = ProgramDef(
        methods=method_defs,
        delegates=[DelegateDef(backend=BACKEND, manifest=manifests[i].to_dict()) for i in range(len(partitions))],
        segments=[],
        states=states.defs,
    )
    return ProgramFile(definition, store)
