"""export_program: `torch.export` programs of several methods -> one program file.

    decompose (core ATen) -> partition (engine vs host) -> plan values and instructions
    -> lower the delegate partitions (one module each, or one for all with multifunction) -> deliver into the
       named data store with a manifest per delegate
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from onecopy.delegate.manifest import MANIFEST_VERSION, PORTABLE
from onecopy.errors import ExportError, InvalidArgument
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.lowering import LoweredBundle, StagedFunction, lower
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.export.partitioner import Partition, Partitioner, op_name
from onecopy.export.state import ProgramStates, StateBinding, collect_states, guard_index_writes, state_groups
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

BACKEND = "IreeBackend"
_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _tensor_spec(node: fx.Node, where: str) -> TensorSpec:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ExportError(f"{where}: '{node.name}' is not a tensor ({type(val).__name__}); only tensors cross a method's boundary.")
    shape = [int(d) if isinstance(d, int) or not hasattr(d, "node") else str(d) for d in val.shape]
    return TensorSpec(shape=shape, dtype=str(val.dtype).removeprefix("torch."))


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_symbolic(node: fx.Node) -> bool:
    """A shape computation (sym_size, arithmetic on sizes): recomputed inside each partition that needs it."""
    return isinstance(node.meta.get("val"), _SYMBOLIC)


def _dim_value(d: Any) -> int:
    return int(d) if isinstance(d, int) else int(d.node.hint)


def _example(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return torch.zeros([_dim_value(d) for d in val.shape], dtype=val.dtype)


def _dynamic_shapes(nodes: list[fx.Node], ranges: dict[str, tuple[int, int | None]]) -> tuple | None:
    """torch.export dynamic_shapes for re-exporting a partition: one `Dim` per symbol, shared across arguments
    so the engine function keeps the method's dynamic dimensions. None when every shape is static, and
    `False` when a dimension is an expression (e.g. 2*s0) a `Dim` cannot name."""
    dims: dict[str, Any] = {}
    specs = []
    for node in nodes:
        spec = {}
        for axis, d in enumerate(node.meta["val"].shape):
            if isinstance(d, int):
                continue
            name = str(d)
            if name not in ranges:
                return False  # type: ignore[return-value]
            if name not in dims:
                low, high = ranges[name]
                dims[name] = torch.export.Dim(name, min=max(low, 0), max=high) if high is not None else torch.export.Dim(name, min=max(low, 0))
            spec[axis] = dims[name]
        specs.append(spec or None)
    return tuple(specs) if dims else None


def _symbol_ranges(ep: ExportedProgram) -> dict[str, tuple[int, int | None]]:
    ranges = {}
    for symbol, vr in ep.range_constraints.items():
        upper = vr.upper
        ranges[str(symbol)] = (int(vr.lower), int(upper) if upper.is_finite else None)
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
    dynamic_results: tuple | None | bool
    outputs_in_place: bool
    input_names: list[str]
    output_names: list[str]
    # Program state: the globals read (in placeholder order, after the parameters), the results stored into them
    # and the results returned (None: all). See onecopy.export.state.
    states: list[StateBinding] = field(default_factory=list)  # every state the function reads or stores
    state_reads: list[str] = field(default_factory=list)  # globals passed to the graph, after the parameters
    updates: list[tuple[int, str]] = field(default_factory=list)
    returned: list[int] | None = None

    def staged(self, function: str) -> StagedFunction:
        return StagedFunction(function, self.graph_module, self.parameters, self.example_args,
                              self.example_results, f"method '{self.method}', partition {self.index}",
                              self.dynamic_args, self.dynamic_results or None, self.outputs_in_place,
                              self.state_reads, self.updates, self.returned)


@dataclass
class _MethodPlan:
    """Values and instructions of one method, built while walking its graph."""

    name: str
    table: ParameterTable
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
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
                ConstantDef(id=vid, key=parameter_key(self.table.digests[name]), spec=_tensor_spec(node, self.name))
            )
        return self.ids[node]

    def encode(self, arg: Any, node: fx.Node) -> ValueArg | ConstArg:
        if isinstance(arg, fx.Node) and _is_symbolic(arg) or (
            isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg)
        ):
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
    memory_planned_outputs: bool, states: ProgramStates,
) -> MethodDef:
    # `ep` is decomposed to core ATen (export_program), as ExecuTorch's to_edge does: raw exports hold ops IREE
    # cannot legalize.
    signature = ep.graph_signature
    uses = states.of_method(name)  # buffer fqn -> state name
    graph = ep.graph_module.graph
    plan = _MethodPlan(name, table, _symbol_ranges(ep), memory_planned_outputs)
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
            input_specs.append(_tensor_spec(node, f"Method '{name}', input '{node.name}'"))
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
    partitions = partitioner.partition(graph, name)
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
            if value not in plan.ids:
                raise ExportError(
                    f"Method '{name}' sets state '{uses[spec.target]}' to a value the engine does not compute "
                    f"('{getattr(value, 'name', value)}'); update the buffer with an op (e.g. copy_, index_copy_)."
                )
            continue
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(value, fx.Node):
            raise ExportError(f"Method '{name}': output {spec.arg} is not a tensor the method computes; return tensors only.")
        outputs.append(plan.value(value))
        spec_ = _tensor_spec(value, f"Method '{name}', output '{value.name}'")
        output_specs.append(msgspec.structs.replace(spec_, memory_planned=memory_planned_outputs))
    used = {d for spec in input_specs + output_specs for d in spec.shape if isinstance(d, str)}
    return MethodDef(
        symbols={sym: [low, high] for sym, (low, high) in plan.ranges.items() if sym in used},
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
    # Shape computations the partition reads are recomputed inside it, ahead of its own nodes.
    symbolic: list[fx.Node] = []

    def pull(node: fx.Node) -> None:
        for source in node.all_input_nodes:
            if _is_symbolic(source) and source not in symbolic:
                pull(source)
                symbolic.append(source)

    for node in partition.nodes:
        pull(node)
    nodes = symbolic + partition.nodes
    members = set(nodes)
    weights: list[fx.Node] = []
    state_reads: list[fx.Node] = []
    activations: list[fx.Node] = []
    for node in nodes:
        for source in node.all_input_nodes:
            if source in members:
                continue
            bucket = weights if source in plan.weights else state_reads if plan.global_of(source) else activations
            if source not in bucket:
                bucket.append(source)
    results = [
        n for n in partition.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in members for u in n.users)
    ]
    if not results:
        return None  # dead code: nothing outside uses it
    # A state's new value is stored by the engine function itself; it is returned only when something else (a
    # user output, a later op) reads it too.
    updates = [(i, plan.updates[r].parameter) for i, r in enumerate(results) if r in plan.updates]
    # A later partition reads a stored value from its global; only a host op or the caller needs it returned.
    returned_nodes = [
        r for r in results
        if r not in plan.updates or r in plan.user_outputs
        or any(u not in members and u in plan.host_nodes for u in r.users)
    ]
    read_globals = [plan.global_of(s) for s in state_reads]  # before this partition's own stores count
    touched = list(read_globals)
    for r in results:
        if r in plan.updates and plan.updates[r] not in touched:
            touched.append(plan.updates[r])
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for source in weights + state_reads + activations:
        env[source] = graph.placeholder(source.name)
        env[source].meta = dict(source.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in results))
    if touched:
        guard_index_writes(graph)
    graph_module = fx.GraphModule(torch.nn.Module(), graph)

    inputs = [plan.value(a) for a in activations]
    outputs = []
    for node in results:
        plan.ids[node] = plan.new_id()
        if node in returned_nodes:
            outputs.append(plan.ids[node])
    plan.instructions.append(DelegateCall(delegate=delegate, inputs=inputs, outputs=outputs))
    stateful = bool(touched)
    plan.stored.update(parameter for _, parameter in updates)
    dynamic_results = _dynamic_shapes(activations + results, plan.ranges)
    return _DelegatePartition(
        method=plan.name,
        index=index,
        delegate=delegate,
        graph_module=graph_module,
        parameters=[plan.weights[w] for w in weights],
        example_args=tuple(_example(a) for a in activations),
        example_results=tuple(_example(r) for r in results),
        dynamic_args=_dynamic_shapes(activations, plan.ranges),
        dynamic_results=dynamic_results,
        # Caller-provided outputs (not memory planned) are written in place when the partition produces exactly
        # the method's outputs: the function takes their storage as arguments.
        outputs_in_place=(
            not stateful and not plan.memory_planned_outputs
            and dynamic_results is not False
            and all(u.op == "output" for r in results for u in r.users if u not in members)
        ),
        input_names=[a.name for a in activations],
        output_names=[r.name for r in returned_nodes],
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
        UnsupportedOperator: an op that neither IREE nor a host kernel can run.
        ExportError: the model cannot be lowered (the message names method and partition).
    """
    _check_methods(methods)
    partitioners = _per_method(methods, partitioner, Partitioner, "partitioner")
    specs = _per_method(methods, compile_spec, CompileSpec, "compile_spec")
    multifunction = _check_multifunction(partitioners, specs)
    if type(memory_planned_outputs) is not bool:
        raise InvalidArgument(f"memory_planned_outputs expects bool, got {type(memory_planned_outputs).__name__}.")

    table = ParameterTable()
    partitions: list[_DelegatePartition] = []
    # Lower from core ATen, as ExecuTorch's to_edge does: raw exports hold ops IREE cannot legalize.
    decomposed = {name: ep.run_decompositions() for name, ep in methods.items()}
    states = collect_states(decomposed, {m: p.share_state for m, p in partitioners.items()}, table)
    method_defs = [
        _plan_method(name, ep, partitioners[name], table, partitions, memory_planned_outputs, states)
        for name, ep in decomposed.items()
    ]

    store = NamedDataStore()
    for constant in (c for m in method_defs for c in m.constants):
        name = next(n for n, d in table.digests.items() if parameter_key(d) == constant.key)
        store.add(constant.key, ParameterTable.host_bytes(table.tensors[name]))

    manifests: list[dict[str, Any]] = [{} for _ in partitions]
    if multifunction:
        groups = [[(p, f"{p.method}_{p.index}") for p in partitions]] if partitions else []
    else:
        groups = state_groups(partitions, specs)
    for group in groups:
        compile_spec = specs[group[0][0].method]  # one spec per group: checked equal for multifunction
        held = list({s.parameter: s for p, _ in group for s in p.states}.values())
        bundle = lower([p.staged(function) for p, function in group], table.tensors, compile_spec, held)
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
