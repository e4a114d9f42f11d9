"""Planning a method: walk its decomposed graph in order and give every value an id, every host op a
`HostOp` and every partition the engine takes a `DelegateCall` plus the `DelegatePartition` that lowering stages
as one engine function."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from onecopy.errors import ExportError
from onecopy.export.lowering import StagedFunction
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.export.partitioner import Partition, Partitioner, op_name
from onecopy.export.index_guard import guard_indices, input_bounds
from onecopy.export.state import ProgramStates, StateBinding
from onecopy.export.subgraph import cut, dynamic_shapes, example, is_symbolic
from onecopy.export.symbols import rename_symbols, spec_dtype, symbol_names, symbol_ranges, tensor_spec
from onecopy.program import ConstantDef, ConstArg, DelegateCall, HostOp, Instruction, MethodDef, TensorSpec, ValueArg

__all__ = ["DelegatePartition", "MethodPlan", "host_can_take", "plan_method"]

_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass
class DelegatePartition:
    """A partition the engine takes, planned: the graph lowering stages as one engine function, and the names its
    delegate's manifest gives the function's arguments and results."""

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
    output_dtypes: list[str]  # per returned result, the dtype torch.export recorded (the engine's lacks a sign)
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
class MethodPlan:
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
                ConstantDef(id=vid, key=parameter_key(self.table.digests[name]), spec=tensor_spec(node, self.name, self.names))
            )
        return self.ids[node]

    def encode(self, arg: Any, node: fx.Node) -> ValueArg | ConstArg:
        if not host_can_take(arg):
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


def host_can_take(arg: Any) -> bool:
    """Whether a host kernel can take `arg`: not a size computed at run time, nor a list of values."""
    if isinstance(arg, fx.Node):
        return not is_symbolic(arg)
    return not (isinstance(arg, (list, tuple)) and any(isinstance(a, fx.Node) for a in arg))


def _refuse_data_dependent_sizes(name: str, graph: fx.Graph) -> None:
    """A tensor whose size its data decides (torch.nonzero, masked_select, unique: torch's unbacked symbols u0)
    cannot be a function of the engine's, whose shapes its inputs determine, nor be planned at export."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            target = getattr(node.target, "__name__", str(node.target))
            raise ExportError(
                f"Method '{name}': '{node.name}' ({target}) has a size that depends on the data "
                f"({list(val.shape)}), which onecopy cannot export: every size must follow from the inputs' shapes. "
                "Compute it outside the method, or keep the size fixed (e.g. torch.where(mask, x, 0) instead of "
                "x[mask] or torch.nonzero)."
            )


def plan_method(
    name: str, ep: ExportedProgram, partitioner: Partitioner, table: ParameterTable, delegates: list[DelegatePartition],
    memory_planned_outputs: bool, states: ProgramStates, on_host: frozenset[str] = frozenset(),
) -> MethodDef:
    """Plan a decomposed method; `states`: the program's states (buffers it updates are read and stored by the
    engine, not inputs); `on_host`: nodes the compile check moved to the host."""
    signature = ep.graph_signature
    uses = states.of_method(name)  # buffer fqn -> state name
    graph = ep.graph_module.graph
    _refuse_data_dependent_sizes(name, graph)
    plan = MethodPlan(name, table, symbol_ranges(ep), symbol_names(ep), memory_planned_outputs)
    inputs: list[int] = []
    input_nodes: list[fx.Node] = []
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
            input_specs.append(tensor_spec(node, f"Method '{name}', input '{node.name}'", plan.names))
            plan.ids[node] = plan.new_id()
            inputs.append(plan.ids[node])
            input_nodes.append(node)
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
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(value, fx.Node) or is_symbolic(value):
            # What it is, in the user's terms: a constant (None, 3) or a number (x.shape[0], t.item(): a SymInt
            # node), which failed later as "used before it is computed".
            what = (f"{getattr(spec.arg, 'value', value)!r} (a constant)" if not isinstance(value, fx.Node)
                    else f"a {spec.kind.name.lower()} ('{value.name}')" if spec.kind != OutputKind.USER_OUTPUT
                    else f"a number ({rename_symbols(str(value.meta['val']), plan.names)})")
            raise ExportError(
                f"Method '{name}': output {len(outputs)} is {what}, not a tensor; a method returns tensors only. "
                "Return it as a tensor (e.g. torch.tensor(...) or x.new_tensor(...)), or leave it out."
            )
        outputs.append(plan.value(value))
        spec_ = tensor_spec(value, f"Method '{name}', output '{value.name}'", plan.names)
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
        # Inputs that index a table, checked before each call: a token id past the vocabulary is refused.
        input_bounds=input_bounds(graph, input_nodes),
        # torch.export orders keyword inputs as the kwargs dict was given, not as the signature: names say which.
        input_names=[node.name for node in input_nodes],
    )


def _plan_host_op(plan: MethodPlan, node: fx.Node) -> None:
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
    vals = val if isinstance(val, (tuple, list)) else [val]
    dtypes = ([spec_dtype(v.dtype, f"Method '{plan.name}': host op '{node.name}' result") for v in vals]
              if all(isinstance(v, torch.Tensor) for v in vals) else [])
    plan.instructions.append(HostOp(op=op_name(node), args=args, kwargs=kwargs, outputs=outputs,
                                    output_dtypes=dtypes))


def _plan_delegate_partition(
    plan: MethodPlan, partition: Partition, index: int, delegate: int
) -> DelegatePartition | None:
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
    if guard_indices(piece.graph_module.graph):  # IREE checks no index: see onecopy.export.index_guard
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
    return DelegatePartition(
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
        output_dtypes=[spec_dtype(r.meta["val"].dtype, f"Method '{plan.name}': '{r.name}'") for r in returned_nodes],
        nodes=list(partition.nodes),
        weights=plan.weights,
        ranges=plan.ranges,
        names=plan.names,
        states=touched,
        state_reads=[g.parameter for g in read_globals],
        updates=updates,
        returned=[results.index(r) for r in returned_nodes] if stateful else None,
    )
