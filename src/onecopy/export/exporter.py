"""export_program: `torch.export` programs of several methods -> one program file.

    decompose (core ATen) -> partition (engine vs host) -> plan values and instructions
    -> lower the delegate partitions (one module each, or one for all with multifunction) and compile them as
       their first load will (an op IREE cannot compile goes to a host kernel, and the method is planned again,
       or fails the export naming it) -> deliver into the named data store with a manifest per delegate
"""

from __future__ import annotations

import hashlib
import logging
import operator
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import sympy
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from onecopy.delegate.manifest import MANIFEST_VERSION, PORTABLE
from onecopy.delegate.targets import select_target
from onecopy.errors import DelegateError, ExportError, InvalidArgument, UnsupportedOperator
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.culprits import find_culprits, reason, source_line
from onecopy.export.lowering import CompileFailed, LoweredBundle, StagedFunction, check_compiles, lower
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.export.partitioner import Partition, Partitioner, op_name
from onecopy.export.rewrites import apply_rewrites
from onecopy.runtime.host_kernels import has_host_kernel
from onecopy.export.state import ProgramStates, StateBinding, collect_states, guard_index_writes, state_groups
from onecopy.export.subgraph import cut, dynamic_shapes, example, is_symbolic
from onecopy.program import (
    ConstantDef,
    ConstArg,
    DelegateCall,
    DelegateDef,
    HostOp,
    Instruction,
    MethodDef,
    NamedDataStore,
    ProgramDef,
    ProgramFile,
    TensorSpec,
    ValueArg,
)

__all__ = ["export_program"]

log = logging.getLogger("onecopy")

BACKEND = "IreeBackend"
_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _tensor_spec(node: fx.Node, where: str, names: Mapping[str, str] | None = None) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ExportError(f"{where}: '{node.name}' is not a tensor ({type(val).__name__}); only tensors cross a method's boundary.")
    shape = [int(d) if isinstance(d, int) or not hasattr(d, "node") else _rename(str(d), names or {}) for d in val.shape]
    return TensorSpec(shape=shape, dtype=str(val.dtype).removeprefix("torch."))


_TORCH_SYMBOL = re.compile(r"\b[su]\d+\b")  # torch's names for sizes: s31 (from inputs), u0 (data-dependent)


def _rename(text: str, names: Mapping[str, str]) -> str:
    """`text` with torch's symbols (s31) replaced by the names the user knows them by (T)."""
    return _TORCH_SYMBOL.sub(lambda m: names.get(m.group(), m.group()), text) if names else text


def _symbol_names(ep: ExportedProgram) -> dict[str, str]:
    """torch symbol -> the name of the user's `torch.export.Dim` for it (s31 -> T), or `x.shape[1]` for a dynamic
    dimension the user did not name (Dim.AUTO). torch keeps the Dim names only in the shape environment of the
    example values (which source, e.g. L['x'].size()[0], got which Dim name): read where present, else the input
    and axis where the symbol first appears."""
    names: dict[str, str] = {}
    user_inputs = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for axis, d in enumerate(node.meta["val"].shape):
            expr = getattr(getattr(d, "node", None), "expr", None)
            if not isinstance(expr, sympy.Symbol) or str(expr) in names:
                continue
            names[str(expr)] = _dim_name(d, expr) or f"{node.name}.shape[{axis}]"
    return names


def _dim_name(d: Any, symbol: sympy.Symbol) -> str | None:
    try:
        shape_env = d.node.shape_env
        debug_names = shape_env.source_name_to_debug_name
        for source in shape_env.var_to_sources.get(symbol, ()):
            source_name = source.name() if callable(source.name) else source.name
            if source_name in debug_names:
                return str(debug_names[source_name])
    except AttributeError:  # torch internals moved: fall back to the input and axis
        return None
    return None


def _symbol_ranges(ep: ExportedProgram) -> dict[str, tuple[int, int | None]]:
    ranges = {}
    for symbol, vr in ep.range_constraints.items():
        # torch's unbounded upper end is `int_oo`, which claims `is_finite` and cannot be converted by int().
        upper = vr.upper
        ranges[str(symbol)] = (int(vr.lower), int(upper) if isinstance(upper, sympy.Integer) else None)
    return ranges


@dataclass
class _DelegatePartition:
    method: str
    index: int  # partition index within the method
    delegate: int  # delegate index within the program
    graph_module: fx.GraphModule
    parameters: list[str]
    example_args: tuple[torch.Tensor, ...]
    example_results: tuple[torch.Tensor, ...]
    dynamic_args: tuple | None
    dynamic_results: tuple | None
    outputs_in_place: bool
    input_names: list[str]
    output_names: list[str]
    # what the compile check needs to try the partition's ops alone
    nodes: list[fx.Node] = field(default_factory=list)
    weights: dict[fx.Node, str] = field(default_factory=dict)
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    # Program state: the globals read (in placeholder order, after the parameters), the results stored into them
    # and the results returned (None: all). See onecopy.export.state.
    states: list[StateBinding] = field(default_factory=list)  # every state the function reads or stores
    state_reads: list[str] = field(default_factory=list)  # globals passed to the graph, after the parameters
    updates: list[tuple[int, str]] = field(default_factory=list)
    returned: list[int] | None = None

    def staged(self, function: str) -> StagedFunction:
        return StagedFunction(function, self.graph_module, self.parameters, self.example_args,
                              self.example_results, f"method '{self.method}', partition {self.index}",
                              self.dynamic_args, self.dynamic_results, self.outputs_in_place,
                              self.state_reads, self.updates, self.returned)


@dataclass
class _MethodPlan:
    """Values and instructions of one method, built while walking its graph."""

    name: str
    table: ParameterTable
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # torch symbol -> the user's name for it
    memory_planned_outputs: bool = True
    ids: dict[fx.Node, int] = field(default_factory=dict)
    num_values: int = 0
    weights: dict[fx.Node, str] = field(default_factory=dict)  # weight placeholder -> table name
    constants: list[ConstantDef] = field(default_factory=list)
    instructions: list[Instruction] = field(default_factory=list)
    states: dict[fx.Node, StateBinding] = field(default_factory=dict)  # state placeholder -> its state
    updates: dict[fx.Node, StateBinding] = field(default_factory=dict)  # node holding a state's new value
    user_outputs: set[fx.Node] = field(default_factory=set)
    host_nodes: set[fx.Node] = field(default_factory=set)
    stored: set[str] = field(default_factory=set)  # globals an earlier partition of the method has stored
    in_globals: set[fx.Node] = field(default_factory=set)  # results stored into a global and not returned

    def global_of(self, node: fx.Node) -> StateBinding | None:
        """The state whose global holds `node`'s value when a partition runs: a state read before any partition
        stored it, or a state's new value once its partition stored it."""
        binding = self.states.get(node)
        if binding is not None:
            if binding.parameter in self.stored:
                raise ExportError(
                    f"Method '{self.name}' reads state '{binding.name}' as it was before the call after a partition "
                    "stored its new value (a graph break between the update and the read); move the host op, or "
                    "read the state before updating it in the same partition."
                )
            return binding
        binding = self.updates.get(node)
        return binding if binding is not None and binding.parameter in self.stored else None

    def new_id(self) -> int:
        self.num_values += 1
        return self.num_values - 1

    def value(self, node: fx.Node) -> int:
        """Value id of `node`; a weight read outside the engine becomes a constant from the named data."""
        if node not in self.ids:
            name = self.weights.get(node)
            if name is None:
                raise ExportError(f"Method '{self.name}': node '{node.name}' is used before it is computed.")
            vid = self.new_id()
            self.ids[node] = vid
            self.constants.append(
                ConstantDef(id=vid, key=parameter_key(self.table.digests[name]), spec=_tensor_spec(node, self.name, self.names))
            )
        return self.ids[node]

    def encode(self, arg: Any, node: fx.Node) -> ValueArg | ConstArg:
        if not _host_can_take(arg):
            raise ExportError(
                f"Method '{self.name}': host op '{op_name(node)}' (node '{node.name}') takes a dynamic size or a "
                "list of values, which host kernels cannot take yet; let the engine take this op or export the "
                "method with static shapes."
            )
        if isinstance(arg, fx.Node):
            return ValueArg(id=self.value(arg))
        if arg is None or isinstance(arg, (bool, int, float, str)):
            return ConstArg(value=arg)
        if isinstance(arg, (list, tuple)) and all(a is None or isinstance(a, (bool, int, float, str)) for a in arg):
            return ConstArg(value=list(arg))
        if isinstance(arg, (torch.dtype, torch.memory_format, torch.device, torch.layout)):
            return ConstArg(value=str(arg))
        raise ExportError(
            f"Method '{self.name}': host op '{op_name(node)}' (node '{node.name}') takes an argument of type "
            f"{type(arg).__name__}, which cannot run on the host; let the engine take this op."
        )


def _host_can_take(arg: Any) -> bool:
    """Whether a host kernel can take `arg`: not a size computed at run time, nor a list of values."""
    if isinstance(arg, fx.Node):
        return not is_symbolic(arg)
    return not (isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg))


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


def _plan_method(
    name: str, ep: ExportedProgram, partitioner: Partitioner, table: ParameterTable, delegates: list[_DelegatePartition],
    memory_planned_outputs: bool, states: ProgramStates, on_host: frozenset[str] = frozenset(),
) -> MethodDef:
    """Plan a decomposed method; `states`: the program's states (buffers it updates are read and stored by the
    engine, not inputs); `on_host`: nodes the compile check moved to the host."""
    signature = ep.graph_signature
    uses = states.of_method(name)  # buffer fqn -> state name
    graph = ep.graph_module.graph
    plan = _MethodPlan(name, table, _symbol_ranges(ep), _symbol_names(ep), memory_planned_outputs)
    inputs: list[int] = []
    input_specs: list[TensorSpec] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind == InputKind.BUFFER and spec.target in uses:
            plan.states[node] = states.bindings[uses[spec.target]]
        elif spec.kind in _WEIGHT_KINDS:
            tensor = ep.state_dict.get(spec.target)
            if tensor is None:
                tensor = ep.constants[spec.target]
            plan.weights[node] = table.add(spec.target, tensor)
        elif spec.kind == InputKind.USER_INPUT:
            input_specs.append(_tensor_spec(node, f"Method '{name}', input '{node.name}'", plan.names))
            plan.ids[node] = plan.new_id()
            inputs.append(plan.ids[node])
        else:
            raise ExportError(f"Method '{name}': input '{node.name}' of kind {spec.kind.name} is not supported.")

    output_node = next(n for n in graph.nodes if n.op == "output")
    for value, spec in zip(output_node.args[0], signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in uses and isinstance(value, fx.Node):
            plan.updates[value] = states.bindings[uses[spec.target]]
        elif spec.kind == OutputKind.USER_OUTPUT and isinstance(value, fx.Node):
            plan.user_outputs.add(value)
    partitions = partitioner.partition(graph, name, on_host)
    plan.host_nodes = {p.nodes[0] for p in partitions if p.on_host}
    for node in plan.host_nodes:
        read = next((a for a in node.all_input_nodes if a in plan.states), None)
        if read is not None:
            raise ExportError(
                f"Method '{name}': host op '{op_name(node)}' (node '{node.name}') reads state "
                f"'{plan.states[read].name}', which only the engine holds. Let the engine take this op (remove it "
                "from skip_ops)."
            )
    delegate_index = 0
    for partition in partitions:
        if partition.on_host:
            _plan_host_op(plan, partition.nodes[0])
            continue
        staged = _plan_delegate_partition(plan, partition, delegate_index, len(delegates))
        if staged is not None:
            delegates.append(staged)
            delegate_index += 1

    outputs: list[int] = []
    output_specs: list[TensorSpec] = []
    for value, spec in zip(output_node.args[0], signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in uses:
            if value not in plan.ids and value not in plan.in_globals:
                raise ExportError(
                    f"Method '{name}' sets state '{uses[spec.target]}' to a value the engine does not compute "
                    f"('{getattr(value, 'name', value)}'); update the buffer with an op (e.g. copy_, index_copy_)."
                )
            continue
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(value, fx.Node):
            raise ExportError(f"Method '{name}': output {spec.arg} is not a tensor the method computes; return tensors only.")
        outputs.append(plan.value(value))
        spec_ = _tensor_spec(value, f"Method '{name}', output '{value.name}'", plan.names)
        output_specs.append(msgspec.structs.replace(spec_, memory_planned=memory_planned_outputs))
    used = {d for spec in input_specs + output_specs for d in spec.shape if isinstance(d, str)}
    return MethodDef(
        symbols={plan.names.get(s, s): [low, high] for s, (low, high) in plan.ranges.items() if plan.names.get(s, s) in used},
        name=name,
        num_values=plan.num_values,
        inputs=inputs,
        outputs=outputs,
        input_specs=input_specs,
        output_specs=output_specs,
        instructions=plan.instructions,
        constants=plan.constants,
        states=sorted({s.name for s in plan.states.values()}),
    )


def _plan_host_op(plan: _MethodPlan, node: fx.Node) -> None:
    args = [plan.encode(a, node) for a in node.args]
    kwargs = {k: plan.encode(v, node) for k, v in node.kwargs.items()}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        outputs = [plan.new_id() for _ in val]
        for user in node.users:
            if user.target is operator.getitem:
                plan.ids[user] = outputs[user.args[1]]
    else:
        outputs = [plan.new_id()]
        plan.ids[node] = outputs[0]
    plan.instructions.append(HostOp(op=op_name(node), args=args, kwargs=kwargs, outputs=outputs))


def _plan_delegate_partition(
    plan: _MethodPlan, partition: Partition, index: int, delegate: int
) -> _DelegatePartition | None:
    piece = cut(partition.nodes, plan.weights, plan.global_of)
    if piece is None:
        return None  # dead code: nothing outside uses it
    activations, results = piece.activations, piece.results
    members = set(partition.nodes)
    # A state's new value is stored by the engine function itself; it is returned only when something else (a
    # user output, a host op) reads it too: a later partition reads a stored value from its global.
    updates = [(i, plan.updates[r].parameter) for i, r in enumerate(results) if r in plan.updates]
    returned_nodes = [
        r for r in results
        if r not in plan.updates or r in plan.user_outputs
        or any(u not in members and u in plan.host_nodes for u in r.users)
    ]
    read_globals = [plan.global_of(s) for s in piece.state_reads]  # before this partition's own stores count
    touched = list(read_globals)
    for r in results:
        if r in plan.updates and plan.updates[r] not in touched:
            touched.append(plan.updates[r])
    stateful = bool(touched)
    if stateful:
        guard_index_writes(piece.graph_module.graph)
        piece.graph_module.recompile()
    inputs = [plan.value(a) for a in activations]
    outputs = []
    for node in results:
        if node in returned_nodes:
            plan.ids[node] = plan.new_id()
            outputs.append(plan.ids[node])
        else:  # no value of the method: the engine keeps it in the state's global
            plan.in_globals.add(node)
    plan.instructions.append(DelegateCall(delegate=delegate, inputs=inputs, outputs=outputs))
    plan.stored.update(parameter for _, parameter in updates)
    return _DelegatePartition(
        method=plan.name,
        index=index,
        delegate=delegate,
        graph_module=piece.graph_module,
        parameters=[plan.weights[w] for w in piece.weights],
        example_args=tuple(example(a) for a in activations),
        example_results=tuple(example(r) for r in results),
        dynamic_args=dynamic_shapes(activations, plan.ranges),
        dynamic_results=dynamic_shapes(activations + results, plan.ranges),
        # Caller-provided outputs (not memory planned) are written in place when the partition produces exactly
        # the method's outputs: the function takes their storage as arguments.
        outputs_in_place=(
            not stateful and not plan.memory_planned_outputs
            and all(u.op == "output" for r in results for u in r.users if u not in members)
        ),
        input_names=[a.name for a in activations],
        output_names=[r.name for r in returned_nodes],
        nodes=list(partition.nodes),
        weights=plan.weights,
        ranges=plan.ranges,
        names=plan.names,
        states=touched,
        state_reads=[g.parameter for g in read_globals],
        updates=updates,
        returned=[results.index(r) for r in returned_nodes] if stateful else None,
    )


def _deliver(
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


def _held_states(group: list[tuple[_DelegatePartition, str]]) -> list[StateBinding]:
    """The states a module holds as globals: every one a function of it reads or stores, once."""
    return list({s.parameter: s for p, _ in group for s in p.states}.values())


def _lower_group(group: list[tuple[_DelegatePartition, str]], table: ParameterTable, spec: CompileSpec) -> LoweredBundle:
    """Lower one module and, for a portable bundle, compile it as its first load here will: an export that passes
    is a program that loads. Raises `CompileFailed` for the caller to find the op to blame."""
    where = "; ".join(p.staged(function).where for p, function in group)
    names = {k: v for p, _ in group for k, v in p.names.items()}
    try:
        held = _held_states(group)
        bundle = lower([p.staged(function) for p, function in group], table.tensors, spec, held)
    except CompileFailed:
        raise
    except ExportError as e:
        renamed = _rename(str(e), names)  # turbine's messages speak of torch's s31, the user wrote T
        if renamed != str(e):
            raise ExportError(renamed) from e
        raise
    if spec.packaging == "mlir" and spec.check_compiles:
        try:
            target = select_target(spec.compute_units, where)
        except DelegateError as e:  # e.g. compute_units="gpu" exported on a machine without one
            log.info("%s: not checked at export, no target for compute units '%s' here: %s", where, spec.compute_units, e)
            return bundle
        started = time.perf_counter()
        check_compiles(bundle, any(p.parameters for p, _ in group) or any(s.initial for s in held), target, where)
        log.debug("%s: compiles for %s (checked in %.0f ms)", where, target.name, (time.perf_counter() - started) * 1e3)
    return bundle


def _move_to_host(
    failure: CompileFailed, partitions: list[_DelegatePartition], table: ParameterTable, on_host: dict[str, set[str]]
) -> None:
    """Find the ops IREE cannot compile in the module that failed; those with a host kernel go to the host (a
    graph break, as `skip_ops` makes), any other fails the export naming op, node, method and source line."""
    # IREE bounds some buffers by a dimension's largest size: an unbounded one can be what fails.
    unbounded = sorted({p.names[s] for p in partitions for s, (_, high) in p.ranges.items() if high is None and s in p.names})
    hint = (f" Dimension(s) {', '.join(unbounded)} have no upper bound: torch.export.Dim(..., max=...) may let IREE "
            "compile it." if unbounded else "")
    culprits = find_culprits(partitions, failure, table.tensors)
    if not culprits:
        raise ExportError(
            f"{_rename(str(failure), {k: v for p in partitions for k, v in p.names.items()})} No single operator was "
            "found to blame: the failure comes from ops together. Leave some on the host with "
            f"Partitioner(skip_ops=(...)) and a registered host kernel, or change the model.{hint}"
        ) from failure
    for culprit in culprits:
        name, node = op_name(culprit.node), culprit.node
        at = source_line(node)
        where = f"Method '{culprit.method}': IREE cannot compile operator '{name}' (node '{node.name}'" + (
            f" at {at})" if at else ")") + f" for {failure.target.name}: {reason(culprit.error)}."
        if not has_host_kernel(name) or node.name in on_host[culprit.method]:
            raise UnsupportedOperator(
                f"{where} Register a host kernel with onecopy.runtime.register_host_kernel('{name}', fn) (the export "
                f"then leaves this op on the host: a graph break, as Partitioner(skip_ops=('{name}',)) does for "
                f"every node of the op), or change the model to avoid it.{hint}"
            ) from failure
        if not all(_host_can_take(a) for a in (*node.args, *node.kwargs.values())):
            raise UnsupportedOperator(
                f"{where} Its host kernel cannot run it either: it takes a size computed at run time or a list of "
                f"values. Export the method with static shapes, or change the model to avoid it.{hint}"
            ) from failure
        log.warning("%s It runs on the host kernel registered for it (a graph break).", where)
        on_host[culprit.method].add(node.name)


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

    # Lower from core ATen, as ExecuTorch's to_edge does: raw exports hold ops IREE cannot legalize.
    decomposed = {name: ep.run_decompositions() for name, ep in methods.items()}
    apply_rewrites(decomposed, {name: spec.rewrites for name, spec in specs.items()})
    on_host: dict[str, set[str]] = {name: set() for name in methods}
    # Modules lowered (and checked) so far, by what they are made of: planning again after moving an op to the
    # host lowers only the modules that changed. Parameter names are the same in every round (the same adds).
    lowered: dict[tuple, LoweredBundle] = {}
    while True:
        table = ParameterTable()
        states = collect_states(decomposed, {m: p.share_state for m, p in partitioners.items()}, table)
        partitions: list[_DelegatePartition] = []
        method_defs = [
            _plan_method(name, ep, partitioners[name], table, partitions, memory_planned_outputs, states,
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
                    lowered[key] = _lower_group(group, table, specs[group[0][0].method])
                bundles.append(lowered[key])
            except CompileFailed as failure:
                # Leave what IREE cannot compile on the host where a kernel can run it, and plan again.
                _move_to_host(failure, [p for p, _ in group], table, on_host)
                break
        else:
            break

    store = NamedDataStore()
    for constant in (c for m in method_defs for c in m.constants):
        name = next(n for n, d in table.digests.items() if parameter_key(d) == constant.key)
        store.add(constant.key, ParameterTable.host_bytes(table.tensors[name]))

    manifests: list[dict[str, Any]] = [{} for _ in partitions]
    for group, bundle in zip(groups, bundles):
        compile_spec = specs[group[0][0].method]  # one spec per group: checked equal for multifunction
        held = _held_states(group)
        used = list(dict.fromkeys([*(name for p, _ in group for name in p.parameters),
                                   *(s.initial for s in held if s.initial is not None)]))
        export_hash, keys, encoders, bound = _deliver(bundle, table, used, store)
        for p, function in group:
            manifest: dict[str, Any] = {
                "version": MANIFEST_VERSION,
                "packaging": compile_spec.packaging,
                "export_hash": export_hash,
                "bundle": keys,
                "function": function,
                "input_names": p.input_names,
                "output_names": p.output_names,
                "compute_units": compile_spec.compute_units,
                "parameters": bound,
            }
            if p.outputs_in_place:
                manifest["outputs_in_place"] = True
            if encoders:
                manifest["encoders"] = encoders
            if multifunction:
                manifest["multifunction"] = True
            if held:
                manifest["states"] = [s.manifest() for s in held]
            manifests[p.delegate] = manifest
    definition = ProgramDef(
        methods=method_defs,
        delegates=[DelegateDef(backend=BACKEND, manifest=m) for m in manifests],
        segments=[],
        states=states.defs,
    )
    return ProgramFile(definition, store)
