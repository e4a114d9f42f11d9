"""A loaded method: runs its instructions (delegate calls and host ops) over a table of values."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from logging import DEBUG
from typing import Any

import numpy as np

from onecopy.errors import ExecutionError, InvalidArgument
from onecopy.program import ConstArg, DelegateCall, HostOp, MethodDef, NamedData, ValueArg
from onecopy.runtime._layout import repeat_kept, same_shapes
from onecopy.runtime.arguments import STATE_ADVICE, as_array, check_bounds, check_inputs, output_storage
from onecopy.runtime.backend import DelegateHandle, Plan, RunReport
from onecopy.runtime.checked_calls import KEPT, CheckedCall, CheckedStateCall, remember, templates_of
from onecopy.runtime.copy_stats import CopyStats, StatsRecord
from onecopy.runtime.host_kernels import get_host_kernel
from onecopy.runtime.method_meta import MethodMeta
from onecopy.runtime.state import State

__all__ = ["Method", "PreparedCall", "StatePreparedCall", "as_array"]

log = logging.getLogger("onecopy")

# Plans a thread keeps for `execute` calls that repeat on bound surfaces: a frame loop reuses one, double (or
# triple) buffering cycles through two or three.
REPEATS_KEPT = 4
_NO_STATS = CopyStats()


class _PerThread(threading.local):
    """What a method keeps per calling thread; the class attributes are every thread's start."""

    stats: CopyStats = _NO_STATS  # the last call's (last_copy_stats)
    # Plans kept for the calls that repeat them, newest first, as (snapshots, run) of each PreparedCall.
    repeats: tuple[tuple[tuple[np.ndarray, ...], Any], ...] = ()


def _into_storage(whole: DelegateCall, inputs: Sequence[Any], outputs: Sequence[Any] | None,
                  known: Sequence[CheckedCall | CheckedStateCall]) -> bool:
    """Whether a call that passed the checks with `outputs` storage is worth a checked call of its own: storage
    for every output, each output a value of its own, plain numpy arrays all (anything else is converted on each
    call), and no call of `known` for that signature of inputs and storage yet."""
    if outputs is None or len(set(whole.outputs)) != len(whole.outputs):
        return False
    if not all(type(a) is np.ndarray for a in (*inputs, *outputs)):
        return False
    return not any(same_shapes(inputs, c.templates) and same_shapes(outputs, c.out_templates) for c in known)


class Method:
    """An entry point of a loaded program. `execute` may be called from several threads."""

    def __init__(self, definition: MethodDef, meta: MethodMeta, delegates: dict[int, DelegateHandle],
                 named_data: NamedData, program_closed: threading.Event, *, owner: Any = None):
        # The program this method came from, held so that it lives as long as its methods: a program closes itself
        # when collected, and `load_program(p).load_method("forward")` leaves no other reference to it. An
        # explicit `close()` still ends every method (`program_closed`).
        self._owner = owner
        self._definition = definition
        self._meta = meta
        self._delegates = delegates
        # Decided once: every call asks first, before anything else runs (cache-cold, see `execute`).
        self._stateful = bool(definition.states)
        self._closed = program_closed
        self._constants = {
            c.id: np.frombuffer(named_data[c.key], dtype=c.spec.dtype).reshape([int(d) for d in c.spec.shape])
            for c in definition.constants
        }
        self._local = _PerThread()
        # Where every call of this method records what it moved, and what a call kept for later runs needs of it.
        self._record = StatsRecord(self._local, definition.name)
        self._report = RunReport(program_closed, self._check_open, self._local, self._record)
        # The method's one instruction when it is a delegate call (prepared calls plan it); `_whole_call` when that
        # call produces exactly the method's outputs (the common case): execute and prepared calls hand its results
        # back as they come, with nothing to gather afterwards.
        (single,) = definition.instructions if len(definition.instructions) == 1 else (None,)
        self._single_call: DelegateCall | None = single if isinstance(single, DelegateCall) else None
        self._whole_call: DelegateCall | None = (
            single if self._single_call and list(single.outputs) == list(definition.outputs) else None)
        # Calls whose inputs passed the checks of `_arguments`, newest first (onecopy.runtime.checked_calls);
        # replaced, never mutated, so threads read a consistent tuple without a lock.
        self._checked_calls: tuple[CheckedCall, ...] = ()
        self._checked_into: tuple[CheckedCall, ...] = ()  # the same, for callers passing storage for every output
        self._state_calls: tuple[CheckedStateCall, ...] = ()
        self._state_into: tuple[CheckedStateCall, ...] = ()
        self._kernels = {}
        for ins in definition.instructions:
            if isinstance(ins, HostOp):
                kernel = get_host_kernel(ins.op)
                if kernel is None:
                    raise ExecutionError(
                        f"Method '{definition.name}' runs '{ins.op}' on the host, but no host kernel is registered "
                        "for it; register one with onecopy.runtime.register_host_kernel before loading."
                    )
                self._kernels[ins.op] = kernel

    @property
    def name(self) -> str:
        return self._definition.name

    @property
    def method_meta(self) -> MethodMeta:
        return self._meta

    @property
    def last_copy_stats(self) -> CopyStats:
        """Bytes the last `execute` in this thread copied in/out, and used in place through bound surfaces."""
        # A copy: a plan's runs record one CopyStats object, the same each run (nothing they move varies).
        return dataclasses.replace(self._local.stats)

    def bind_surface(self, surface: Any) -> None:
        """Bind a `Surface`: an input or output that is its memory in its own layout (`surface.array()`, or a
        C-contiguous reshape) is read or written in place by the engine; any other view of it (transposed, sliced)
        is copied through its strides. Several methods and programs may bind one surface, to chain models."""
        self._check_open()
        if not self._delegates:
            raise InvalidArgument(f"Method '{self.name}' runs no delegate; there is no engine to bind a surface to.")
        for handle in self._delegates.values():
            handle.bind_surface(surface)

    @property
    def bound_surfaces(self) -> dict[str, Any]:
        """Surfaces bound to this method's delegates (including those opened by backend option bound_surfaces)."""
        found: dict[str, Any] = {}
        for handle in self._delegates.values():
            found.update(handle.bound_surfaces)
        return found

    @property
    def runs_on(self) -> dict[int, str]:
        """What runs each of its delegates: index -> engine and executor (e.g. what executor="auto" picked)."""
        return {index: handle.runs_on for index, handle in self._delegates.items()}

    @property
    def devices(self) -> dict[int, str]:
        """Each delegate's device alone (index -> e.g. `local-sync`, `OpenVINO CPU`): `runs_on`, shorter."""
        return {index: handle.device for index, handle in self._delegates.items()}

    def execute(self, inputs: Sequence[Any] | dict[str, Any], outputs: Sequence[Any] | None = None, *,
                state: Any = None) -> list[np.ndarray]:
        """Run the method. `inputs`: in the method's order (`method_meta.inputs`), or a dict by input name (the
        exported signature's: a keyword input's key). `outputs`: caller-provided storage per output (None entries
        are allocated). `state`: the `State` a stateful method reads and updates in place (None: the program's
        default state).

        A frame loop over bound surfaces calls with the same surfaces every time: such a call is planned once, as
        `prepare` would, and this thread's next calls on the same arrays (or new views of the same surfaces, same
        layout) rerun the plan, with no per-argument work."""
        if type(inputs) is dict:
            inputs = self._by_name(inputs)
        if state is not None or self._stateful:
            return self._execute_stateful(inputs, outputs, state)
        bounds = self._definition.input_bounds
        if bounds:  # inputs that index a table (a token id): the engine checks no index
            check_bounds(self.name, bounds, inputs)
        if outputs is None:
            for checked in self._checked_calls:
                if same_shapes(inputs, checked.templates):
                    produced = checked.run(inputs)
                    if produced is not None:
                        return produced
                    break
        else:
            # A kept plan that this call repeats: every array at the address, and with the shape, strides and
            # dtype, it had when the plan was made, and the outputs still writable (what could fail the checks of
            # a first call). Found and run in C (`_layout.c`): this runs first after the previous call, cache-cold,
            # where numpy's getters cost tens of microseconds and each Python step a few.
            produced = repeat_kept(self._local, inputs, outputs)
            if produced is not None:
                return produced
            for checked in self._checked_into:  # storage of a signature that passed the checks: writable is all
                if same_shapes(inputs, checked.templates) and same_shapes(outputs, checked.out_templates, True):
                    produced = checked.run(inputs, outs=outputs)
                    if produced is not None:
                        return produced
                    break
        values, storage = self._arguments(inputs, outputs)
        whole = self._whole_call
        if whole is not None and outputs is not None and self._delegates[whole.delegate].has_bound_surfaces:
            call = PreparedCall(self, values, storage, outputs, given=(inputs, outputs))
            if call.reusable:
                self._local.repeats = ((call.snapshots, call.run), *self._local.repeats)[:REPEATS_KEPT]
            return call.run()
        stats = CopyStats()
        if whole is not None:
            # Decided before the engine runs: what runs after it runs with the interpreter's caches cold.
            debug = log.isEnabledFor(DEBUG)
            handle = self._delegates[whole.delegate]
            produced = handle.execute([values[v] for v in whole.inputs], [storage.get(v) for v in whole.outputs], stats)
            # The delegate filled the caller's storage itself (in place or by its own copy): nothing to gather.
            if not storage or all(storage.get(v, array) is array for v, array in zip(whole.outputs, produced)):
                self._record(stats, debug)
                if outputs is None and not handle.has_bound_surfaces:
                    self._checked_calls = remember(self._checked_calls, inputs, lambda templates: CheckedCall(
                        self._report, handle, templates, self._delegate_arguments(whole), len(whole.outputs)))
                elif outputs is not None and not handle.has_bound_surfaces:
                    self._remember_into(handle, whole, inputs, outputs)
                return produced
            for vid, array in zip(whole.outputs, produced):
                values[vid] = array
            return self._results(values, storage, outputs, stats)
        for ins in self._definition.instructions:
            if isinstance(ins, DelegateCall):
                args = [values[v] for v in ins.inputs]
                produced = self._delegates[ins.delegate].execute(args, [storage.get(v) for v in ins.outputs], stats)
                for vid, array in zip(ins.outputs, produced):
                    values[vid] = array
            else:
                self._run_host_op(ins, values)
        return self._results(values, storage, outputs, stats)

    def _remember_into(self, handle: DelegateHandle, whole: DelegateCall, inputs: Sequence[Any],
                       outputs: Sequence[Any]) -> None:
        """Keep a `CheckedCall` for this call's signature of inputs and output storage (see `_into_storage`)."""
        if _into_storage(whole, inputs, outputs, self._checked_into):
            made = CheckedCall(self._report, handle, templates_of(inputs), self._delegate_arguments(whole),
                               len(whole.outputs), templates_of(outputs))
            self._checked_into = (made, *self._checked_into)[:KEPT]

    def _delegate_arguments(self, call: DelegateCall) -> tuple[int | np.ndarray, ...]:
        """Per input of `call`: the index of the method input it is, or a constant of the program."""
        position = {vid: i for i, vid in enumerate(self._definition.inputs)}
        return tuple(position[v] if v in position else self._constants[v] for v in call.inputs)

    def _execute_stateful(self, inputs: Sequence[Any], outputs: Sequence[Any] | None,
                          state: State | None) -> list[np.ndarray]:
        """Run on `state` (None: the program's default state), which serializes the calls made on it."""
        state = self._state_for(state)
        if outputs is None:
            for checked in self._state_calls:
                if same_shapes(inputs, checked.templates):
                    return checked.run(inputs, state)
        else:
            for checked in self._state_into:
                if same_shapes(inputs, checked.templates) and same_shapes(outputs, checked.out_templates, True):
                    return checked.run(inputs, state, outputs)
        definition = self._definition
        with state._lock:
            state._check()
            values, storage = self._arguments(inputs, outputs)
            if definition.input_bounds:
                check_bounds(self.name, definition.input_bounds, [values[v] for v in definition.inputs],
                             STATE_ADVICE)
            stats = CopyStats()
            for ins in definition.instructions:
                if isinstance(ins, DelegateCall):
                    handle = self._delegates[ins.delegate]
                    args = [values[v] for v in ins.inputs]
                    outs = [storage.get(v) for v in ins.outputs]
                    if handle.state_names:
                        produced = handle.execute_with_state(state._backend_for(handle), args, outs, stats)
                    else:
                        produced = handle.execute(args, outs, stats)
                    for vid, array in zip(ins.outputs, produced):
                        values[vid] = array
                else:
                    self._run_host_op(ins, values)
            results = self._results(values, storage, outputs, stats)
        whole = self._whole_call
        if outputs is None and whole is not None:
            handle = self._delegates[whole.delegate]
            self._state_calls = remember(self._state_calls, inputs, lambda templates: CheckedStateCall(
                self._report, self.name, definition.input_bounds, handle, templates, self._delegate_arguments(whole),
                len(whole.outputs)))
        elif whole is not None and _into_storage(whole, inputs, outputs, self._state_into):
            handle = self._delegates[whole.delegate]
            made = CheckedStateCall(self._report, self.name, definition.input_bounds, handle, templates_of(inputs),
                                    self._delegate_arguments(whole), len(whole.outputs), templates_of(outputs))
            self._state_into = (made, *self._state_into)[:KEPT]
        return results

    def _state_for(self, state: Any) -> State:
        """The State a call given `state=` runs on: `state` itself, checked to be one of this method's program,
        or the program's default state when None."""
        program = self._owner
        if program is None:
            raise InvalidArgument(f"Method '{self.name}' was not loaded by a Program; it cannot take state=.")
        if not self._stateful:
            raise InvalidArgument(f"Method '{self.name}' keeps no state; call it without state=.")
        if state is None:
            return program.default_state
        if type(state) is not State:
            raise InvalidArgument(f"state= takes an onecopy State (program.create_state()), got {type(state).__name__}.")
        if state._program is not program:
            raise InvalidArgument(
                f"The State given to method '{self.name}' belongs to another program ('{state._program.source}'); "
                "create one with this program's create_state()."
            )
        return state

    def profile(self, inputs: Sequence[Any] | None = None, *, seconds: float = 2.0) -> Any:
        """Where a call's time goes inside the engine, dispatch by dispatch: the method's engine function called
        back to back for about `seconds` under the engine's own profiler, on `inputs` (None: `method_meta`'s
        example inputs). Returns the delegate's profile (IREE: onecopy.delegate.dispatch_profile.DispatchProfile,
        what `onecopy profile` prints). A stateful method's calls start from zeroed state, not from a `State`.
        For a method that runs as one delegate call."""
        self._check_open()
        whole = self._whole_call
        if whole is None:
            raise InvalidArgument(
                f"Method '{self.name}' runs as {len(self._definition.instructions)} instructions "
                f"({', '.join(self._meta.instructions)}); profile covers a method that runs as one delegate call. "
                "Export it without skip_ops to profile its engine function.")
        inputs = self._meta.example_inputs() if inputs is None else inputs
        symbols: dict[str, int] = {}
        check_inputs(self.name, self._definition, self._meta, inputs, symbols)
        outputs = []  # storage for a destination-passing function's outputs, sized for these inputs
        for i, t in enumerate(self._meta.outputs):
            shape = t.shape_for(symbols)
            if shape is None:
                raise InvalidArgument(f"Output {i} of method '{self.name}' has shape {list(t.shape)}, which its "
                                      "inputs do not determine; profile cannot size its storage.")
            outputs.append(np.zeros(shape, t.dtype))
        values, _ = self._arguments(inputs, outputs)
        return self._delegates[whole.delegate].profile([values[v] for v in whole.inputs], outputs, seconds)

    def prepare(self, inputs: Sequence[Any], outputs: Sequence[Any] | None = None, *,
                state: Any = None) -> PreparedCall | StatePreparedCall:
        """Plan a call on these very input and output arrays once; `run()` it for each new content (a frame loop
        over bound surfaces, say), as ONNX Runtime's IOBinding does. The arrays are checked here, once: a run
        reads whatever they hold then. A stateful method's call is prepared on `state` (None: the program's
        default state): each run reads and updates it in place, as `execute(inputs, state=state)` does. Not for
        concurrent use; prepare one per thread."""
        if type(inputs) is dict:
            inputs = self._by_name(inputs)
        if state is not None or self._stateful:
            state = self._state_for(state)
            with state._lock:
                state._check()
                values, storage = self._arguments(inputs, outputs)
            return StatePreparedCall(self, values, storage, outputs, state)
        values, storage = self._arguments(inputs, outputs)
        call = PreparedCall(self, values, storage, outputs)
        bounds = self._definition.input_bounds
        if bounds:  # each run reads what the arrays hold then: their indices are checked then
            arrays, run, name = [values[v] for v in self._definition.inputs], call.run, self.name

            def checked_run() -> list[np.ndarray]:
                check_bounds(name, bounds, arrays)
                return run()

            call.run = checked_run  # type: ignore[method-assign]
        return call

    def _by_name(self, given: dict[str, Any]) -> list[Any]:
        """Inputs given by name, in the method's order. torch.export orders keyword inputs as the kwargs were
        given at export, not as the signature lists them: a list in signature order would silently swap them."""
        names = self._definition.input_names
        if not names:
            raise InvalidArgument(f"Method '{self.name}' was exported before inputs had names; pass its inputs as "
                                  f"a list in the order of method_meta.inputs ({len(self._definition.inputs)}).")
        unknown = [k for k in given if k not in names]
        missing = [n for n in names if n not in given]
        if unknown or missing:
            problems = ([f"no input named {', '.join(map(repr, unknown))}"] if unknown else []) + (
                [f"missing {', '.join(map(repr, missing))}"] if missing else [])
            raise InvalidArgument(f"Method '{self.name}' takes inputs {names}: {'; '.join(problems)}.")
        return [given[n] for n in names]

    def _arguments(
        self, inputs: Sequence[Any], outputs: Sequence[Any] | None
    ) -> tuple[list[Any], dict[int, np.ndarray]]:
        """The value table with inputs (checked) and constants in place, and the caller's output storage."""
        self._check_open()
        definition = self._definition
        values: list[Any] = [None] * definition.num_values
        symbols: dict[str, int] = {}
        for vid, array in zip(definition.inputs, check_inputs(self.name, definition, self._meta, inputs, symbols)):
            values[vid] = array
        for vid, constant in self._constants.items():
            values[vid] = constant
        return values, output_storage(self.name, definition, self._meta, outputs, symbols)

    def _results(self, values: list[Any], storage: dict[int, np.ndarray], outputs: Sequence[Any] | None,
                 stats: CopyStats) -> list[np.ndarray]:
        results = []
        gathered: set[int] = set()
        for vid, out in zip(self._definition.outputs, outputs or [None] * len(self._definition.outputs)):
            result = values[vid]
            if out is not None:
                # A value the method returns twice (`return y, y`) has one storage entry, the first given for it
                # (`output_storage`): the storage given for its later outputs is filled here, by a copy.
                target = (storage[vid] if vid not in gathered
                          else as_array(out, f"Output {len(results)} of method '{self.name}'"))
                gathered.add(vid)
                if result is not target:
                    if result.shape != target.shape:  # copyto would broadcast a smaller result
                        raise ExecutionError(f"Output {len(results)} of method '{self.name}' came out "
                                             f"{list(result.shape)}; the storage given is {list(target.shape)}.")
                    np.copyto(target, result)
                    stats.copied_out += result.nbytes
                    result = target
            results.append(result)
        self._record(stats, log.isEnabledFor(DEBUG))
        return results

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ExecutionError(f"Method '{self.name}' belongs to a closed program; load the program again.")

    def _run_host_op(self, ins: HostOp, values: list[Any]) -> None:
        def resolve(arg: ValueArg | ConstArg) -> Any:
            return values[arg.id] if isinstance(arg, ValueArg) else arg.value

        args = [resolve(a) for a in ins.args]
        kwargs = {k: resolve(a) for k, a in ins.kwargs.items()}
        try:
            result = self._kernels[ins.op](*args, **kwargs)
        except Exception as e:
            raise ExecutionError(f"Method '{self.name}': host kernel '{ins.op}' failed: {e}") from e
        if len(ins.outputs) == 1:
            arrays = [np.asarray(result)]
        else:
            arrays = [np.asarray(array) for array in result]
            if len(arrays) != len(ins.outputs):
                raise ExecutionError(f"Method '{self.name}': host kernel '{ins.op}' returned {len(arrays)} arrays; "
                                     f"the op has {len(ins.outputs)} outputs.")
        definition = self._definition
        for k, (vid, array) in enumerate(zip(ins.outputs, arrays)):
            # The dtype torch.export recorded for the result (the op's own record; in files written before it was
            # kept, a method output's spec): a kernel's result in another dtype is cast to it where that is safe
            # (an int32 for an int64, say), else refused here, naming the kernel, rather than rounded silently or
            # refused by the engine partition that reads it. (The built-in kernels return torch's dtype already.)
            if ins.output_dtypes:
                want, role = np.dtype(ins.output_dtypes[k]), f"its result {k}"
            elif vid in definition.outputs:
                index = definition.outputs.index(vid)
                want, role = np.dtype(definition.output_specs[index].dtype), f"output {index} of the method"
            else:
                want = None
            if want is not None and array.dtype != want:
                if not np.can_cast(array.dtype, want, "safe"):
                    raise ExecutionError(
                        f"Method '{self.name}': host kernel '{ins.op}' returned {array.dtype} for {role}, which "
                        f"torch.export recorded as {want}; a host kernel must return the dtype torch computes "
                        "for the op.")
                array = array.astype(want)
            values[vid] = array


class PreparedCall:
    """A call of a method on fixed input and output arrays (`Method.prepare`): `run()` runs it on what they hold
    now. A method that is one delegate call runs the delegate's plan (for IREE: the engine arguments built once,
    bound surfaces handed over as their views), so a run does no per-argument work; any other method runs as
    `execute` would. Not for concurrent use."""

    def __init__(self, method: Method, values: list[Any], storage: dict[int, np.ndarray],
                 outputs: Sequence[Any] | None, *,
                 given: tuple[Sequence[Any], Sequence[Any]] | None = None) -> None:
        self._method = method
        self._values = values
        self._storage = storage
        self._outputs = outputs
        single = method._single_call
        self._planned: Plan | None = None
        self._produces: list[int] = []
        self._direct: list[np.ndarray] | None = None
        self.reusable = False
        self.snapshots: tuple[np.ndarray, ...] = ()
        checked = self._checked_run(method, values, storage)
        if checked is not None:  # nothing bound: `execute`'s own call for a signature, on these arrays
            self.run = checked  # type: ignore[method-assign]
            return
        if single is not None:
            self._produces = list(single.outputs)
            self._planned = method._delegates[single.delegate].prepare(
                [values[v] for v in single.inputs], [storage.get(v) for v in single.outputs])
            if method._whole_call is not None and all(v in storage for v in single.outputs):
                # The delegate fills the caller's storage itself (in place or by its own copy out), which is
                # exactly what `_results` would return: the run skips it and returns this list.
                self._direct = [storage[v] for v in single.outputs]
                # A plan the delegate runs whole, natively, with this method's bookkeeping (a frame step on bound
                # surfaces): `run` is that, with no Python frame of ours per run.
                fast = self._planned.frame_run(method._report)
                if fast is not None:
                    self.run = fast  # type: ignore[method-assign]
        # `execute` keeps a plan for the calls that repeat it when it holds nothing but views of bound surfaces
        # (a plain array of the caller's would be kept alive by it) and every argument was a numpy array. The
        # snapshots are views of those arrays as they are now, which the caller cannot reshape: a later call
        # repeats this one when its arrays are laid out as these (`Method.execute`).
        arrays = (*given[0], *given[1]) if given is not None else ()
        self.reusable = bool(self._direct is not None and self._planned is not None and self._planned.only_surfaces
                             and arrays and all(type(a) is np.ndarray for a in arrays))
        self.snapshots = tuple(a.view() for a in arrays) if self.reusable else ()

    def _checked_run(self, method: Method, values: list[Any], storage: dict[int, np.ndarray]
                     ) -> Callable[[], list[np.ndarray]] | None:
        """The run of a method that is one delegate call with nothing bound: the delegate's whole checked call
        (`DelegateHandle.checked_call`, the closure `execute` keeps per signature: bookkeeping and engine call in
        one frame) on these arrays, into the caller's storage when it was given for every output. The plan below
        copies the same bytes through a general path that costs ~20 us more per call after the engine ran (the
        built-in model's `forward`, call by call). None where that does not apply; a run that finds a surface
        bound since goes the way `execute` goes then."""
        whole = method._whole_call
        if whole is None:
            return None
        handle = method._delegates[whole.delegate]
        if handle.has_bound_surfaces or handle.state_names:
            return None
        outs: list[np.ndarray] | None = None
        if storage:
            if len(set(whole.outputs)) != len(whole.outputs) or not all(v in storage for v in whole.outputs):
                return None
            outs = [storage[v] for v in whole.outputs]
        arrays = [values[v] for v in whole.inputs]
        call = handle.checked_call(arrays, len(whole.outputs), method._report)
        if call is None:
            return None
        inputs = [values[v] for v in method._definition.inputs]
        given = self._outputs

        def run() -> list[np.ndarray]:
            produced = call(arrays) if outs is None else call(arrays, outs=outs)
            return produced if produced is not None else method.execute(inputs, given)

        return run

    @property
    def last_copy_stats(self) -> CopyStats:
        return self._method.last_copy_stats

    def run(self) -> list[np.ndarray]:
        method = self._method
        if method._closed.is_set():
            method._check_open()
        if self._planned is None:
            inputs = [self._values[v] for v in method._definition.inputs]
            return method.execute(inputs, self._outputs)
        stats = CopyStats()
        direct = self._direct
        if direct is not None:
            debug = log.isEnabledFor(DEBUG)  # decided before the engine runs, like everything else here
            self._planned(stats)
            method._record(stats, debug)
            return list(direct)
        values = list(self._values)
        for vid, array in zip(self._produces, self._planned(stats)):
            values[vid] = array
        return method._results(values, self._storage, self._outputs, stats)


class StatePreparedCall:
    """A stateful method's call on fixed input and output arrays and one `State` (`Method.prepare(..., state=s)`):
    `run()` runs it on what the arrays hold now, in that State's engine storage, updated in place; no state byte
    crosses into Python. A method that is one delegate call returning its results runs the delegate's copied call
    for these arrays' signature, worked out once (`DelegateHandle.state_copied_call`); any other runs as
    `execute(inputs, outputs, state=s)` would. Not for concurrent use."""

    def __init__(self, method: Method, values: list[Any], storage: dict[int, np.ndarray],
                 outputs: Sequence[Any] | None, state: State) -> None:
        self._method = method
        self._state = state
        self._outputs = outputs
        self._inputs = [values[v] for v in method._definition.inputs]
        whole = method._whole_call
        self._handle: DelegateHandle | None = None
        self._call: Any = None
        if whole is not None and not storage and method._delegates[whole.delegate].state_names:
            self._handle = method._delegates[whole.delegate]
            self._arguments = [values[v] for v in whole.inputs]
            self._call = self._handle.state_copied_call(self._arguments, len(whole.outputs))

    @property
    def last_copy_stats(self) -> CopyStats:
        return self._method.last_copy_stats

    def run(self) -> list[np.ndarray]:
        method, state = self._method, self._state
        if method._closed.is_set():
            method._check_open()
        if self._call is None:
            return method._execute_stateful(self._inputs, self._outputs, state)
        bounds = method._definition.input_bounds
        if bounds:  # the inputs' values change between runs: an index past the cache is refused at each
            check_bounds(method.name, bounds, self._inputs, STATE_ADVICE)
        stats = CopyStats()
        debug = log.isEnabledFor(DEBUG)  # decided before the engine runs, like everything else here
        with state._lock:
            if state._closed or state._program.closed:
                state._check()
            produced = self._call(self._arguments, stats, state._backend_for(self._handle))
        method._record(stats, debug)
        return produced
