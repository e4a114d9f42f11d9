"""export_program: `torch.export` programs of several methods -> one program file.

    decompose (core ATen) -> partition (engine vs host) -> plan values and instructions
    -> lower the delegate partitions (one module each, or one for all with multifunction) -> deliver into the
       named data store with a manifest per delegate
"""

from __future__ import annotations

import hashlib
import operator
import re
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
from onecopy.errors import ExportError, InvalidArgument
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.lowering import LoweredBundle, StagedFunction, lower
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.export.partitioner import Partition, Partitioner, op_name
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
    so the engine function keeps the method's dynamic dimensions. A dimension that is an expression reaches a
    partition across a graph break (a host op's result of size 2*T): a linear one becomes a derived Dim (2*T),
    any other a Dim of its own. Exporting it static instead would make a function that runs only at the example
    size. None when every shape is static."""
    dims: dict[str, Any] = {}
    specs = []
    for node in nodes:
        spec = {}
        for axis, d in enumerate(node.meta["val"].shape):
            if isinstance(d, int):
                continue
            spec[axis] = _dim_for(d.node.expr, dims, ranges)
        specs.append(spec or None)
    return tuple(specs) if dims else None


def _dim_for(expr: sympy.Expr, dims: dict[str, Any], ranges: dict[str, tuple[int, int | None]]) -> Any:
    def root(symbol: sympy.Symbol, min_: int = 0) -> Any:
        name = str(symbol)
        if name not in dims:
            low, high = ranges.get(name, (0, None))
            low = max(low, min_, 0)
            dims[name] = torch.export.Dim(name, min=low, max=high) if high is not None else torch.export.Dim(name, min=low)
        return dims[name]

    if isinstance(expr, sympy.Symbol):
        return root(expr)
    free = list(expr.free_symbols)
    if len(free) == 1:
        (symbol,) = free
        a, b = expr.coeff(symbol), expr.subs(symbol, 0)
        if isinstance(a, sympy.Integer) and isinstance(b, sympy.Integer) and a > 0 and sympy.expand(a * symbol + b - expr) == 0:
            # torch wants the root's minimum to keep the derived size >= 0
            return root(symbol, -(int(b) // int(a))) * int(a) + int(b)
    name = f"d{len(dims)}_" + re.sub(r"\W", "_", str(expr))
    dims[name] = torch.export.Dim(name, min=0)
    return dims[name]


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

    def staged(self, function: str) -> StagedFunction:
        return StagedFunction(function, self.graph_module, self.parameters, self.example_args,
                              self.example_results, f"method '{self.method}', partition {self.index}",
                              self.dynamic_args, self.dynamic_results, self.outputs_in_place)


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
    memory_planned_outputs: bool,
) -> MethodDef:
    # Lower from core ATen, as ExecuTorch's to_edge does: raw exports hold ops IREE cannot legalize.
    ep = ep.run_decompositions()
    signature = ep.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate:
        mutated = list(signature.buffers_to_mutate.values()) + list(signature.user_inputs_to_mutate.values())
        raise ExportError(
            f"Method '{name}' mutates {', '.join(mutated)}; onecopy methods are pure functions. Export the model in "
            "eval mode, or return the new state as an output."
        )
    graph = ep.graph_module.graph
    plan = _MethodPlan(name, table, _symbol_ranges(ep), _symbol_names(ep), memory_planned_outputs)
    inputs: list[int] = []
    input_specs: list[TensorSpec] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind in _WEIGHT_KINDS:
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

    delegate_index = 0
    for partition in partitioner.partition(graph, name):
        if partition.on_host:
            _plan_host_op(plan, partition.nodes[0])
            continue
        staged = _plan_delegate_partition(plan, partition, delegate_index, len(delegates))
        if staged is not None:
            delegates.append(staged)
            delegate_index += 1

    output_node = next(n for n in graph.nodes if n.op == "output")
    outputs: list[int] = []
    output_specs: list[TensorSpec] = []
    for value, spec in zip(output_node.args[0], signature.output_specs):
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
    activations: list[fx.Node] = []
    for node in nodes:
        for source in node.all_input_nodes:
            if source in members:
                continue
            bucket = weights if source in plan.weights else activations
            if source not in bucket:
                bucket.append(source)
    results = [
        n for n in partition.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and any(u not in members for u in n.users)
    ]
    if not results:
        return None  # dead code: nothing outside uses it
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for source in weights + activations:
        env[source] = graph.placeholder(source.name)
        env[source].meta = dict(source.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in results))
    graph_module = fx.GraphModule(torch.nn.Module(), graph)

    inputs = [plan.value(a) for a in activations]
    outputs = []
    for node in results:
        plan.ids[node] = plan.new_id()
        outputs.append(plan.ids[node])
    plan.instructions.append(DelegateCall(delegate=delegate, inputs=inputs, outputs=outputs))
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
            not plan.memory_planned_outputs
            and all(u.op == "output" for r in results for u in r.users if u not in members)
        ),
        input_names=[a.name for a in activations],
        output_names=[r.name for r in results],
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
    method_defs = [
        _plan_method(name, ep, partitioners[name], table, partitions, memory_planned_outputs)
        for name, ep in methods.items()
    ]

    store = NamedDataStore()
    for constant in (c for m in method_defs for c in m.constants):
        name = next(n for n, d in table.digests.items() if parameter_key(d) == constant.key)
        store.add(constant.key, ParameterTable.host_bytes(table.tensors[name]))

    manifests: list[dict[str, Any]] = [{} for _ in partitions]
    if multifunction:
        groups = [[(p, f"{p.method}_{p.index}") for p in partitions]] if partitions else []
    else:
        groups = [[(p, "main")] for p in partitions]
    for group in groups:
        compile_spec = specs[group[0][0].method]  # one spec per group: checked equal for multifunction
        bundle = lower([p.staged(function) for p, function in group], table.tensors, compile_spec)
        used = list(dict.fromkeys(name for p, _ in group for name in p.parameters))
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
            manifests[p.delegate] = manifest
    definition = ProgramDef(
        methods=method_defs,
        delegates=[DelegateDef(backend=BACKEND, manifest=m) for m in manifests],
        segments=[],
    )
    return ProgramFile(definition, store)
