"""Program state at export: buffers a method updates in place (torch.export's `BUFFER_MUTATION` outputs, e.g.
transformers' `StaticCache`) become named, typed, shaped entries of the program, kept by the engine.

In the engine a state is a mutable module global (`util.global private mutable`): every function of one module
reads and stores the same global, and each VM context holds its own copy, so a runtime `State` is one VM context
over the one loaded module. What is measured and relied on here (see DESIGN.md, "State in IREE"):
- the global is externalized as the parameter `onecopy_state_<k>` (scope `model`) and served as a zero splat at
  load: the program carries no bytes for a zero cache. It must never be served from a buffer (IREE 3.13 then
  writes the mutable global into that very buffer, shared by every context). A non-zero initial value is stored
  once in the named data as the immutable parameter of `initial`, and `onecopy_reset_states` copies it in.
- a method stores its new value with `global.copy_(new)`; the update itself (`index_copy_`, `index_put`) then
  runs in place on the global, at a cost independent of the cache's size.
- reads and writes from the host go through exported functions `onecopy_read_states` (`clone()`),
  `onecopy_write_states` (`copy_(new.clone())`: without the clone IREE silently stores nothing) and
  `onecopy_reset_states`; a VM context gives no other access to its globals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from onecopy.delegate.manifest import READ_STATES, RESET_STATES, WRITE_STATES, StateEntry
from onecopy.errors import ExportError
from onecopy.export.parameters import ParameterTable, parameter_key
from onecopy.program import StateDef, TensorSpec
from onecopy.export.symbols import spec_dtype

__all__ = ["StateBinding", "ProgramStates", "collect_states", "held_states", "register_states", "stage_helpers", "state_groups"]

STATE_PREFIX = "onecopy_state_"


@dataclass
class StateBinding:
    """One state as a module sees it: the global's parameter name, its shape and dtype, and the table name of its
    initial value (None: zeros)."""

    name: str  # program state name
    parameter: str  # engine global (parameter name in scope `model`)
    shape: tuple[int, ...]
    dtype: torch.dtype
    initial: str | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def manifest(self) -> StateEntry:
        """The state as its delegate's manifest names it."""
        return StateEntry(name=self.name, parameter=self.parameter, shape=list(self.shape),
                          dtype=str(self.dtype).removeprefix("torch."), nbytes=self.nbytes, initial=self.initial)


@dataclass
class ProgramStates:
    """Every state of a program, and per method: buffer FQN -> state name (those it updates and those it reads)."""

    bindings: dict[str, StateBinding] = field(default_factory=dict)  # state name -> binding
    by_method: dict[str, dict[str, str]] = field(default_factory=dict)  # method -> {buffer fqn: state name}
    defs: list[StateDef] = field(default_factory=list)

    def of_method(self, method: str) -> dict[str, str]:
        return self.by_method.get(method, {})


def _buffer_tensor(ep: ExportedProgram, target: str) -> torch.Tensor:
    tensor = ep.state_dict.get(target)
    if tensor is None:
        tensor = ep.constants.get(target)
    if not isinstance(tensor, torch.Tensor):
        raise ExportError(f"Buffer '{target}' has no value in its exported program; register it with a tensor.")
    return tensor


def collect_states(methods: Mapping[str, ExportedProgram], share: Mapping[str, bool], table: ParameterTable,
                   ) -> ProgramStates:
    """Find the program's states in decomposed programs. A method with `share[method]` names its states by buffer
    FQN, so methods updating the same FQN share one; otherwise as `<method>.<fqn>`. A method that only reads a
    buffer another (sharing) method updates reads that state. Raises `ExportError` when two methods give one
    state different shapes, dtypes or initial values."""
    states = ProgramStates()
    first: dict[str, tuple[str, torch.Tensor]] = {}  # state name -> (method, initial tensor)
    for method, ep in methods.items():
        signature = ep.graph_signature
        if signature.user_inputs_to_mutate:
            mutated = ", ".join(signature.user_inputs_to_mutate.values())
            raise ExportError(
                f"Method '{method}' updates its input(s) {mutated} in place; onecopy keeps state in buffers the "
                "module owns. Register the tensor with module.register_buffer and update that, or return the new "
                "value as an output."
            )
        for target in signature.buffers_to_mutate.values():
            name = target if share[method] else f"{method}.{target}"
            states.by_method.setdefault(method, {})[target] = name
            tensor = _buffer_tensor(ep, target).detach()
            seen = first.get(name)
            if seen is None:
                first[name] = (method, tensor)
                continue
            other, known = seen
            if tuple(known.shape) != tuple(tensor.shape) or known.dtype != tensor.dtype:
                raise ExportError(
                    f"Methods '{other}' and '{method}' both update buffer '{target}' (shared state '{name}') but "
                    f"with different shapes or dtypes ({list(known.shape)} {known.dtype} vs {list(tensor.shape)} "
                    f"{tensor.dtype}). Export both from one module with one cache size, or give one method "
                    "Partitioner(share_state=False)."
                )
            if not torch.equal(known, tensor):
                raise ExportError(
                    f"Methods '{other}' and '{method}' both update buffer '{target}' (shared state '{name}') but "
                    "start it from different values. Export both from one module instance."
                )
    for method, ep in methods.items():  # methods reading a shared state without updating it
        if not share[method]:
            continue
        uses = states.by_method.setdefault(method, {})
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.BUFFER and spec.target in first and spec.target not in uses:
                # A buffer of that name in another module (two models in one program, both with a `scale`)
                # would silently read the other's state instead of its own value: the reader must hold the
                # state's own buffer, as two methods updating one must (compared as those are, above).
                other, known = first[spec.target]
                tensor = _buffer_tensor(ep, spec.target).detach()
                if tuple(known.shape) != tuple(tensor.shape) or known.dtype != tensor.dtype:
                    differs = (f"{list(tensor.shape)} {tensor.dtype}, the state {list(known.shape)} "
                               f"{known.dtype}")
                elif not torch.equal(known, tensor):
                    differs = "other values than the state starts from"
                else:
                    differs = None
                if differs is not None:
                    raise ExportError(
                        f"Method '{method}' reads buffer '{spec.target}', which method '{other}' updates (shared "
                        f"state '{spec.target}'), but its buffer is not that state's ({differs}): it would read "
                        f"the state instead of its own value. Export both from one module instance to share it, "
                        f"or give '{method}' Partitioner(share_state=False) to keep its own buffer."
                    )
                uses[spec.target] = spec.target
        if not uses:
            del states.by_method[method]
    for k, (name, (_, tensor)) in enumerate(first.items()):
        if tensor.dtype == torch.bool:  # iree-turbine cannot store to a bool global (an unmapped-global error)
            raise ExportError(f"State '{name}' is bool, which the engine cannot keep between calls. Keep it as an "
                              f"integer buffer in the model (e.g. int32: register_buffer(..., torch.zeros(..., "
                              "dtype=torch.int32)), compared with > 0 where a flag is read).")
        initial = None
        key = None
        if bool(tensor.any()):
            initial = table.add(f"{STATE_PREFIX}init_{k}", tensor)
            key = parameter_key(table.digests[initial])
        states.bindings[name] = StateBinding(name, f"{STATE_PREFIX}{k}", tuple(tensor.shape), tensor.dtype, initial)
        states.defs.append(StateDef(
            name=name, spec=TensorSpec(shape=list(tensor.shape), dtype=spec_dtype(tensor.dtype, f"State '{name}'")),
            initial=key))
    return states


def register_states(root: torch.nn.Module, states: list[StateBinding]) -> None:
    """The states' globals on the module turbine stages: zeros here (and a zero splat at load)."""
    for state in states:
        if hasattr(root, state.parameter):
            continue
        root.register_buffer(state.parameter, torch.zeros(state.shape, dtype=state.dtype))


def stage_helpers(fxb, states: list[StateBinding]) -> None:
    """Export the module's state functions: `onecopy_read_states` (every state, cloned, in `states` order),
    `onecopy_write_states(*values)` and `onecopy_reset_states`. Three functions whatever the number of states:
    each staged function is a torch.export of its own, the slowest step of an export, and an LLM has a state
    per layer (or two)."""

    def read(module):
        return tuple(getattr(module, state.parameter).clone() for state in states)

    def write(module, *values):
        for state, value in zip(states, values):
            getattr(module, state.parameter).copy_(value.clone())  # without clone() IREE stores nothing
        return torch.zeros(())

    def reset(module):
        for state in states:
            g = getattr(module, state.parameter)
            if state.initial is None:
                g.zero_()
            else:
                g.copy_(getattr(module, state.initial).clone())
        return torch.zeros(())

    fxb.export_program(name=READ_STATES, args=(), strict=False)(read)
    fxb.export_program(name=WRITE_STATES,
                       args=tuple(torch.zeros(state.shape, dtype=state.dtype) for state in states), strict=False)(write)
    fxb.export_program(name=RESET_STATES, args=(), strict=False)(reset)


def state_groups(partitions: list[Any], specs: Mapping[str, Any]) -> list[list[tuple[Any, str]]]:
    """Bundles without multifunction: one per partition (function `main`), except that the partitions sharing a
    state are staged together as `<method>_<i>` of one module: a state is a global of ONE module, which every
    function updating it must be part of. `partitions` are the exporter's delegate partitions (`method`, `index`,
    `delegate`, `states`)."""
    groups: list[list[Any]] = []
    owner: dict[str, int] = {}  # state parameter -> group index
    for p in partitions:
        joined = sorted({owner[s.parameter] for s in p.states if s.parameter in owner})
        if not joined:
            groups.append([p])
            index = len(groups) - 1
        else:
            index = joined[0]
            for other in joined[1:]:  # p links groups that were apart: merge them
                groups[index].extend(groups[other])
                groups[other] = []
                for name, g in owner.items():
                    if g == other:
                        owner[name] = index
            groups[index].append(p)
        for s in p.states:
            owner[s.parameter] = index
    result = []
    for group in (g for g in groups if g):
        methods = sorted({p.method for p in group})
        first = specs[methods[0]]
        for m in methods[1:]:
            if specs[m] != first:
                raise ExportError(
                    f"Methods '{methods[0]}' and '{m}' share state, so they are compiled as one module, but their "
                    "compile specs differ. Give them the same CompileSpec."
                )
        if len(group) == 1 and not group[0].states:
            result.append([(group[0], "main")])
        else:
            result.append([(p, f"{p.method}_{p.index}") for p in sorted(group, key=lambda p: p.delegate)])
    return result


def held_states(group: list[tuple[Any, str]]) -> list[StateBinding]:
    """The states a module holds as globals: every one a function of its `group` ((delegate partition,
    function) pairs) reads or stores, once."""
    return list({s.parameter: s for p, _ in group for s in p.states}.values())
