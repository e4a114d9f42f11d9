"""A loaded method: runs its instructions (delegate calls and host ops) over a table of values."""

from __future__ import annotations

import dataclasses
import logging
from logging import DEBUG
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from onecopy.errors import ExecutionError, InvalidArgument
from onecopy.program import ConstArg, DelegateCall, HostOp, MethodDef, NamedData, ValueArg
from onecopy.runtime.backend import DelegateHandle, RunReport
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.host_kernels import get_host_kernel
from onecopy.runtime._layout import repeat_kept, same_shapes
from onecopy.runtime.method_meta import MethodMeta, TensorMeta
from onecopy.runtime.state import execute_stateful

__all__ = ["CheckedCall", "Method", "PreparedCall", "as_array"]

log = logging.getLogger("onecopy")

# Plans a thread keeps for `execute` calls that repeat on bound surfaces: a frame loop reuses one, double (or
# triple) buffering cycles through two or three.
REPEATS_KEPT = 4
# Input signatures (shapes, dtypes) a method keeps for `execute` calls on the copy path: a model called at one or
# two batch sizes, or a few sequence lengths, skips the first call's checks for each.
CHECKED_KEPT = 4
_NO_STATS = CopyStats()


class _PerThread(threading.local):
    """What a method keeps per calling thread; the class attributes are every thread's start."""

    stats: CopyStats = _NO_STATS  # the last call's (last_copy_stats)
    # Plans kept for the calls that repeat them, newest first, as (snapshots, run) of each PreparedCall.
    repeats: tuple[tuple[tuple[np.ndarray, ...], Any], ...] = ()


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays as they are; DLPack producers (torch, jax, cupy on host) as zero-copy views; else asarray."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise ExecutionError(f"{what} cannot be viewed as a host array through DLPack: {e}") from e
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ExecutionError(f"{what} is not an array: {type(value).__name__}.") from e


def _check_list(given: Any, what: str, example: str) -> None:
    """Inputs and outputs come as a list (or tuple) with one entry per tensor; a bare array would be taken apart
    along its first axis."""
    if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
        raise ExecutionError(f"{what} as a list with one entry per tensor ({example}), got {type(given).__name__}.")


def _check_tensor(
    array: np.ndarray, meta: TensorMeta, symbols: dict[str, int], what: str,
    ranges: dict[str, list[int | None]] | None = None,
) -> None:
    if array.dtype != meta.dtype:
        raise ExecutionError(
            f"{what} has dtype {array.dtype}; expected {meta.dtype}. Convert it, e.g. x.astype(np.{meta.dtype})."
        )
    if array.ndim != len(meta.shape):
        raise ExecutionError(f"{what} has shape {list(array.shape)}; expected {list(meta.shape)}.")
    for axis, (given, want) in enumerate(zip(array.shape, meta.shape)):
        if isinstance(want, str):
            low, high = (ranges or {}).get(want, (None, None))
            if (low is not None and given < low) or (high is not None and given > high):
                raise ExecutionError(
                    f"{what} has size {given} at dimension {axis} ('{want}'), outside its exported range "
                    f"[{low}, {high if high is not None else 'inf'}]; re-export with a wider torch.export.Dim."
                )
            bound = symbols.setdefault(want, given)
            if bound != given:
                raise ExecutionError(
                    f"{what} has size {given} at dimension {axis} ('{want}'), but another input set '{want}' = {bound}."
                )
        elif given != want:
            raise ExecutionError(f"{what} has shape {list(array.shape)}; expected {list(meta.shape)}.")


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
        # The method's one instruction when it is a delegate call (prepared calls plan it); `_whole_call` when that
        # call produces exactly the method's outputs (the common case): execute and prepared calls hand its results
        # back as they come, with nothing to gather afterwards.
        (single,) = definition.instructions if len(definition.instructions) == 1 else (None,)
        self._single_call: DelegateCall | None = single if isinstance(single, DelegateCall) else None
        self._whole_call: DelegateCall | None = (
            single if self._single_call and list(single.outputs) == list(definition.outputs) else None)
        self._all_planned = all(o.memory_planned for o in meta.outputs)
        # Calls whose inputs passed the checks of `_arguments`, newest first (see `_checked`); replaced, never
        # mutated, so threads read a consistent tuple without a lock.
        self._checked_calls: tuple[CheckedCall, ...] = ()
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
        """Bind a `Surface` to this method's model instance: when an input or output is the surface's memory in
        its own layout (`surface.array()`, or a C-contiguous reshape of it), the engine reads or writes it in place.
        Any other view of it (transposed, sliced) is copied through its strides, as a plain array would be. Several
        methods (and programs) may bind the same surface, e.g. to chain one model's output into another's input."""
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

    def execute(self, inputs: Sequence[Any], outputs: Sequence[Any] | None = None, *,
                state: Any = None) -> list[np.ndarray]:
        """Run the method. `outputs`: caller-provided storage per output (None entries are allocated). `state`: the
        `State` a stateful method reads and updates in place (None: the program's default state).

        A frame loop over bound surfaces calls with the same surfaces every time: such a call is planned once, as
        `prepare` would, and this thread's next calls on the same arrays (or new views of the same surfaces, same
        layout) rerun the plan, with no per-argument work."""
        if state is not None or self._stateful:
            return execute_stateful(self, inputs, outputs, state)
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
            debug = log.isEnabledFor(logging.DEBUG)
            handle = self._delegates[whole.delegate]
            produced = handle.execute([values[v] for v in whole.inputs], [storage.get(v) for v in whole.outputs], stats)
            # The delegate filled the caller's storage itself (in place or by its own copy): nothing to gather.
            if not storage or all(storage.get(v, array) is array for v, array in zip(whole.outputs, produced)):
                self._record_stats(stats, debug)
                if outputs is None and not handle.has_bound_surfaces:
                    self._remember_checked(inputs, whole, handle)
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

    def _remember_checked(self, inputs: Sequence[Any], whole: DelegateCall, handle: DelegateHandle) -> None:
        """Keep the signature of a copy-path call that passed every check, so that the next calls with inputs of
        the same shapes and dtypes go straight to the delegate (`CheckedCall`). Only plain numpy arrays count:
        anything else is converted on each call anyway."""
        if not all(type(a) is np.ndarray for a in inputs):
            return
        templates = tuple(np.broadcast_to(np.zeros((), a.dtype), a.shape) for a in inputs)
        known = self._checked_calls
        if any(same_shapes(list(templates), c.templates) for c in known):
            return
        position = {vid: i for i, vid in enumerate(self._definition.inputs)}
        arguments = tuple(position[v] if v in position else self._constants[v] for v in whole.inputs)
        self._checked_calls = (CheckedCall(self, handle, templates, arguments, len(whole.outputs)), *known)[:CHECKED_KEPT]

    def prepare(self, inputs: Sequence[Any], outputs: Sequence[Any] | None = None) -> PreparedCall:
        """Plan a call on these very input and output arrays once; `run()` it for each new content (a frame loop
        over bound surfaces, say), as ONNX Runtime's IOBinding does. The arrays are checked here, once: a run
        reads whatever they hold then. Not for concurrent use; prepare one per thread."""
        if self._stateful:
            raise InvalidArgument(f"Method '{self.name}' keeps state; call execute(inputs, state=...) instead of "
                                  "prepare (prepared calls of stateful methods are not supported yet).")
        values, storage = self._arguments(inputs, outputs)
        return PreparedCall(self, values, storage, outputs)

    def _arguments(
        self, inputs: Sequence[Any], outputs: Sequence[Any] | None
    ) -> tuple[list[Any], dict[int, np.ndarray]]:
        """The value table with inputs (checked) and constants in place, and the caller's output storage."""
        self._check_open()
        definition, meta = self._definition, self._meta
        _check_list(inputs, f"Method '{self.name}' takes its inputs", "execute([x, ...])")
        if len(inputs) != len(meta.inputs):
            raise ExecutionError(f"Method '{self.name}' takes {len(meta.inputs)} inputs, got {len(inputs)}.")
        values: list[Any] = [None] * definition.num_values
        symbols: dict[str, int] = {}
        for i, (value, vid, tmeta) in enumerate(zip(inputs, definition.inputs, meta.inputs)):
            what = f"Input {i} of method '{self.name}'"
            array = as_array(value, what)
            _check_tensor(array, tmeta, symbols, what, definition.symbols)
            values[vid] = array
        for vid, constant in self._constants.items():
            values[vid] = constant
        return values, self._output_storage(outputs)

    def _results(self, values: list[Any], storage: dict[int, np.ndarray], outputs: Sequence[Any] | None,
                 stats: CopyStats) -> list[np.ndarray]:
        results = []
        for vid, out in zip(self._definition.outputs, outputs or [None] * len(self._definition.outputs)):
            result = values[vid]
            if out is not None and result is not storage.get(vid):
                np.copyto(storage[vid], result)
                stats.copied_out += result.nbytes
                result = storage[vid]
            results.append(result)
        self._record_stats(stats, log.isEnabledFor(logging.DEBUG))
        return results

    def _record_stats(self, stats: CopyStats, debug: bool) -> None:
        """Keep `stats` as this thread's last_copy_stats; log them when `debug` (decided by the caller, which may
        have done so before the engine ran)."""
        self._local.stats = stats
        if debug:
            log.debug("method %s: copied in %d B, out %d B; in place in %d B, out %d B", self.name,
                      stats.copied_in, stats.copied_out, stats.in_place_in, stats.in_place_out)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ExecutionError(f"Method '{self.name}' belongs to a closed program; load the program again.")

    def _unplanned(self, index: int) -> str:
        return (f"Output {index} of method '{self.name}' is not memory planned (exported with "
                "memory_planned_outputs=False); pass its storage with outputs=[...].")

    def _output_storage(self, outputs: Sequence[Any] | None) -> dict[int, np.ndarray]:
        if outputs is None:
            if not self._all_planned:
                raise ExecutionError(self._unplanned(next(i for i, o in enumerate(self._meta.outputs) if not o.memory_planned)))
            return {}
        meta = self._meta
        _check_list(outputs, f"Method '{self.name}' takes output storage", "outputs=[y, ...], None for any the runtime "
                    "allocates")
        if len(outputs) != len(meta.outputs):
            raise ExecutionError(
                f"Method '{self.name}' has {len(meta.outputs)} outputs; outputs= gave {len(outputs)} (use None for "
                "outputs the runtime should allocate)."
            )
        storage: dict[int, np.ndarray] = {}
        for i, (out, vid, tmeta) in enumerate(zip(outputs, self._definition.outputs, meta.outputs)):
            if out is None:
                if not tmeta.memory_planned:
                    raise ExecutionError(self._unplanned(i))
                continue
            what = f"Output {i} of method '{self.name}'"
            if not isinstance(out, np.ndarray) and not hasattr(out, "__dlpack__"):
                # np.asarray would make a new array: the results would be written there and lost.
                raise ExecutionError(f"{what} must be an array to write into (numpy, or a DLPack tensor on the "
                                     f"host), got {type(out).__name__}.")
            array = as_array(out, what)
            if not array.flags.writeable:
                raise ExecutionError(f"{what} is read-only; pass writable storage.")
            _check_tensor(array, tmeta, {}, what)
            if vid in storage:  # one value returned twice: the second copy is made at the end
                continue
            storage[vid] = array
        return storage

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
            values[ins.outputs[0]] = np.asarray(result)
        else:
            for vid, array in zip(ins.outputs, result):
                values[vid] = np.asarray(array)


class CheckedCall:
    """A method that is one delegate call, on inputs of one signature (shapes and dtypes, held by `templates`:
    arrays without memory) that passed `Method._arguments` and were copied into the engine, with nothing bound.

    A later `execute` on inputs of that signature and no output storage would pass the same checks: it hands them
    to the delegate and returns its results, with no value table. That is most of a call's Python, and it runs
    first after the previous call, with the interpreter's caches cold (a call streaming the built-in model's 32 MB
    of weights paid 80 us for it, 5% of the call). Immutable, so shared by every thread calling the method."""

    __slots__ = ("_method", "_closed", "_local", "_handle", "templates", "_arguments", "_call", "_direct")

    def __init__(self, method: Method, handle: DelegateHandle, templates: tuple[np.ndarray, ...],
                 arguments: tuple[int | np.ndarray, ...], outputs: int) -> None:
        self._method = method
        self._closed = method._closed
        self._local = method._local
        self._handle = handle
        self.templates = templates
        # Per delegate input: the index of the method input it is, or a constant of the program.
        self._arguments = arguments
        # The delegate takes the inputs as given (compared one by one: a constant is an array, never equal).
        self._direct = len(arguments) == len(templates) and all(
            type(a) is int and a == i for i, a in enumerate(arguments))
        # What the delegate can work out once for this signature, it does now (DelegateHandle.copied_call).
        shapes = [a if isinstance(a, np.ndarray) else templates[a] for a in arguments]
        self._call = handle.copied_call(shapes, outputs)

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray] | None:
        """The call's results; None when a surface was bound since (the call must go the checked way)."""
        if self._closed.is_set():
            self._method._check_open()
        handle = self._handle
        if handle.has_bound_surfaces:  # an input may now be a bound surface: let the planning see it
            return None
        arguments = inputs if self._direct else [
            inputs[a] if isinstance(a, int) else a for a in self._arguments]
        stats = CopyStats()
        debug = log.isEnabledFor(DEBUG)
        produced = self._call(arguments, stats)
        self._local.stats = stats  # Method._record_stats, inline: this runs cache-cold, after the engine
        if debug:
            self._method._record_stats(stats, debug)
        return produced


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
        self._planned: Any = None
        self._produces: list[int] = []
        self._direct: list[np.ndarray] | None = None
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
                frame_run = getattr(self._planned, "frame_run", None)
                fast = frame_run(RunReport(method._closed, method._check_open, method._local,
                                           method._record_stats)) if frame_run is not None else None
                if fast is not None:
                    self.run = fast  # type: ignore[method-assign]
        # `execute` keeps a plan for the calls that repeat it when it holds nothing but views of bound surfaces
        # (a plain array of the caller's would be kept alive by it) and every argument was a numpy array. The
        # snapshots are views of those arrays as they are now, which the caller cannot reshape: a later call
        # repeats this one when its arrays are laid out as these (`Method.execute`).
        arrays = (*given[0], *given[1]) if given is not None else ()
        self.reusable = bool(self._direct is not None and getattr(self._planned, "only_surfaces", False)
                             and arrays and all(type(a) is np.ndarray for a in arrays))
        self.snapshots: tuple[np.ndarray, ...] = tuple(a.view() for a in arrays) if self.reusable else ()

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
            # Decided before the engine runs, like everything else here; what follows it runs cache-cold, so
            # Method._record_stats is inlined.
            debug = log.isEnabledFor(DEBUG)
            self._planned(stats)
            method._local.stats = stats
            if debug:
                method._record_stats(stats, debug)
            return list(direct)
        values = list(self._values)
        for vid, array in zip(self._produces, self._planned(stats)):
            values[vid] = array
        return method._results(values, self._storage, self._outputs, stats)
