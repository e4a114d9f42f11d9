"""export_program: `torch.export` programs of several methods -> one program file.

    decompose (core ATen) -> partition (engine vs host) -> plan values and instructions (`method_plan`)
    -> lower the delegate partitions (one module each, or one for all with multifunction) and compile them as
       their first load will (`compile_check`: an op IREE cannot compile goes to a host kernel, and the method is
       planned again, or fails the export naming it) -> deliver into the named data store with a manifest per
       delegate (`delivery`)
    -> with CompileSpec(delegates=("iree", "openvino")), an OpenVINO IR of each method IREE runs whole, over the
       same weights store (`openvino`)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.export import ExportedProgram

from onecopy.errors import ExportError, InvalidArgument
from onecopy.export.batch_norm_folding import fold_batch_norms
from onecopy.export.compile_check import lower_checked, move_to_host
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.delivery import assemble
from onecopy.export.lowering import CompileFailed, LoweredBundle
from onecopy.export.method_plan import DelegatePartition, plan_method
from onecopy.export.openvino import add_openvino_alternatives
from onecopy.export.parameters import ParameterTable
from onecopy.export.partitioner import Partitioner
from onecopy.export.rewrites import apply_rewrites, decomposition_table
from onecopy.export.state import collect_states, state_groups
from onecopy.program import ProgramFile

__all__ = ["export_program"]


def _check_methods(methods: Mapping[str, ExportedProgram]) -> None:
    if not isinstance(methods, Mapping) or not methods:
        raise InvalidArgument("export_program takes a non-empty dict of method name -> torch.export.ExportedProgram.")
    for name, ep in methods.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgument(f"Method name {name!r} must be a Python identifier, e.g. 'forward'.")
        if isinstance(ep, (list, tuple)) and ep and all(isinstance(e, ExportedProgram) for e in ep):
            raise InvalidArgument(
                f"Method '{name}' was given {len(ep)} exported programs (enumerated shapes). A method has one "
                f"signature: export each shape as a method of its own (e.g. '{name}_1', '{name}_16': with "
                "multifunction they share one module and one copy of the weights), or make the dimension dynamic "
                "with torch.export.Dim."
            )
        if not isinstance(ep, ExportedProgram):
            raise InvalidArgument(
                f"Method '{name}' must be a torch.export.ExportedProgram, got {type(ep).__name__}; "
                "wrap the model with torch.export.export(model, example_args)."
            )


def _per_method(methods: Mapping[str, Any], given: Any, kind: type, what: str) -> dict[str, Any]:
    """One `kind` for every method: the same one, or the one a dict gives each method."""
    if given is None:
        given = kind()
    if isinstance(given, kind):
        return {name: given for name in methods}
    if not isinstance(given, Mapping):
        raise InvalidArgument(
            f"{what} must be an onecopy.export.{kind.__name__} or a dict of method name -> {kind.__name__}, "
            f"got {type(given).__name__}."
        )
    missing = [m for m in methods if m not in given]
    extra = [m for m in given if m not in methods]
    if missing or extra:
        raise InvalidArgument(
            f"{what} names methods {sorted(given)}, but the program's methods are {sorted(methods)}; give one "
            f"{kind.__name__} per method."
        )
    for name, value in given.items():
        if not isinstance(value, kind):
            raise InvalidArgument(f"{what}['{name}'] must be an onecopy.export.{kind.__name__}, got {type(value).__name__}.")
    return dict(given)


def _check_multifunction(partitioners: dict[str, Partitioner], specs: dict[str, CompileSpec]) -> bool:
    """Multifunction is all or nothing, and the methods that share one module share one compile spec."""
    on = sorted(m for m, p in partitioners.items() if p.multifunction)
    if not on:
        return False
    off = sorted(m for m, p in partitioners.items() if not p.multifunction)
    if off:
        raise ExportError(
            f"Partitioner(multifunction=True) is set for methods {', '.join(on)} but not for {', '.join(off)}: "
            "all methods of a multifunction program share one module. Set it for every method, or for none."
        )
    first_name, first = next(iter(specs.items()))
    for name, spec in specs.items():
        differing = [f for f in ("packaging", "compute_units", "targets") if getattr(spec, f) != getattr(first, f)]
        if differing:
            raise ExportError(
                f"Methods '{first_name}' and '{name}' have compile specs differing in {', '.join(differing)} "
                f"({', '.join(f'{getattr(first, f)!r} vs {getattr(spec, f)!r}' for f in differing)}), but a "
                "multifunction program compiles all its methods as one module. Give them the same CompileSpec."
            )
    return True


def _folds(spec: CompileSpec, partitioner: Partitioner) -> bool:
    """Whether a method's batch norms are folded: it asks for OpenVINO and keeps no batch norm on the host."""
    return "openvino" in spec.delegates and not any("batch_norm" in op for op in partitioner.skip_ops)


def export_program(
    methods: Mapping[str, ExportedProgram],
    *,
    partitioner: Partitioner | Mapping[str, Partitioner] | None = None,
    compile_spec: CompileSpec | Mapping[str, CompileSpec] | None = None,
    memory_planned_outputs: bool = True,
) -> ProgramFile:
    """Export the methods of a model into one program.

    Args:
        methods: method name -> `torch.export.export(...)` program, e.g. {"forward": ep1, "prefill": ep16}.
        partitioner: which ops the engine takes, and whether all methods share one module (multifunction). One
            for all methods, or a dict method name -> Partitioner.
        compile_spec: packaging (mlir | vmfb), compute units and targets. One for all methods, or a dict method
            name -> CompileSpec (with multifunction, all must be equal: the methods share one module).
        memory_planned_outputs: False makes every method's outputs caller-provided (`execute(..., outputs=...)`),
            as for writing them into bound surfaces; True (default): the runtime allocates them.

    Returns:
        A `ProgramFile`: `.save(path)` writes it atomically, `.to_bytes()` returns it.

    Raises:
        InvalidArgument: bad methods, partitioner or compile spec.
        UnsupportedOperator: an op that neither IREE (importing or compiling it: a portable module is compiled
            here as its first load will, see `CompileSpec.check_compiles`) nor a host kernel can run; the message
            names op, node, method and the model's source line. An op IREE cannot compile that has a registered
            host kernel runs on the host instead (a graph break), with a warning.
        ExportError: the model cannot be lowered (the message names method and partition).
    """
    _check_methods(methods)
    partitioners = _per_method(methods, partitioner, Partitioner, "partitioner")
    specs = _per_method(methods, compile_spec, CompileSpec, "compile_spec")
    multifunction = _check_multifunction(partitioners, specs)
    if type(memory_planned_outputs) is not bool:
        raise InvalidArgument(f"memory_planned_outputs expects bool, got {type(memory_planned_outputs).__name__}.")

    # With an OpenVINO delegate, batch norms are folded into their convolutions first, for both delegates: the
    # weights OpenVINO would fold by itself become the parameters IREE reads too (stored once).
    methods = {name: fold_batch_norms(ep, name) if _folds(specs[name], partitioners[name]) else ep
               for name, ep in methods.items()}
    # Lower from core ATen, as ExecuTorch's to_edge does: raw exports hold ops IREE cannot legalize.
    decomposed = {name: ep.run_decompositions(decomposition_table(name, specs[name].rewrites, partitioners[name].skip_ops))
                  for name, ep in methods.items()}
    apply_rewrites(decomposed, {name: spec.rewrites for name, spec in specs.items()},
                   {name: p.skip_ops for name, p in partitioners.items()})
    on_host: dict[str, set[str]] = {name: set() for name in methods}
    # Modules lowered (and checked) so far, by what they are made of: planning again after moving an op to the
    # host lowers only the modules that changed. Parameter names are the same in every round (the same adds).
    lowered: dict[tuple, LoweredBundle] = {}
    while True:
        table = ParameterTable()
        states = collect_states(decomposed, {m: p.share_state for m, p in partitioners.items()}, table)
        partitions: list[DelegatePartition] = []
        method_defs = [
            plan_method(name, ep, partitioners[name], table, partitions, memory_planned_outputs, states,
                         frozenset(on_host[name]))
            for name, ep in decomposed.items()
        ]
        if multifunction:
            groups = [[(p, f"{p.method}_{p.index}") for p in partitions]] if partitions else []
        else:
            groups = state_groups(partitions, specs)
        bundles: list[LoweredBundle] = []
        for group in groups:
            key = tuple((p.method, function, p.outputs_in_place, tuple(n.name for n in p.nodes)) for p, function in group)
            try:
                if key not in lowered:
                    lowered[key] = lower_checked(group, table, specs[group[0][0].method])
                bundles.append(lowered[key])
            except CompileFailed as failure:
                # Leave what IREE cannot compile on the host where a kernel can run it, and plan again.
                move_to_host(failure, [p for p, _ in group], table, on_host)
                break
        else:
            break

    program = assemble(method_defs, partitions, groups, bundles, specs, table, states, multifunction=multifunction)
    if any("openvino" in spec.delegates for spec in specs.values()):
        program = add_openvino_alternatives(program, methods, specs)
    return program
