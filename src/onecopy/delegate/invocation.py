"""One call of an engine function on fixed arrays, planned once and run any number of times.

Planning decides, argument by argument, what the engine gets: a bound surface (dense rows) is handed over as the
buffer view imported from its memory, in place; any other input is copied into an engine buffer at each run (its
content may change between runs); an output is either a bound surface the engine writes in place or storage
filled from an engine buffer after the call (through its strides: padded surface rows stay padded).

`call` plans and runs one invocation per call (or none: `call_copied`, when nothing is bound). `Method.prepare` keeps one and reruns it, as
ONNX Runtime's IOBinding does: what is left per run is the surface locks and the engine call, so a frame loop
pays no Python per argument. That matters more than its microseconds suggest: a run that streams a 1080p frame
through the caches leaves the interpreter's own code and data cold, and every Python step after it costs 3-4x
what it costs in a tight loop (measured: 11 us of Python outside the engine cost ~40 us per 0.55 ms frame).
So a plan whose every argument is a bound surface runs as a frame step (onecopy.delegate.frame_step, in C by
default), which also does the method's own bookkeeping: `frame_run` makes it, and a prepared call's `run` is it.
Every run takes the same engine step (`frame_step.engine_step`: context, locks, invoke, give back).

Not for concurrent use: a plan owns its staging buffers and its argument list. Plan one per thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from logging import DEBUG
from typing import TYPE_CHECKING, Any

import numpy as np

from onecopy.delegate.engine import EngineFunction
from onecopy.delegate.frame_step import engine_step, frame_step
from onecopy.errors import ExecutionError
from onecopy.runtime.backend import Plan, RunReport
from onecopy.runtime.copy_stats import CopyStats
from onecopy.surface.lock import wake_waiting

if TYPE_CHECKING:
    from onecopy.delegate.binding import SurfaceBinding

__all__ = ["Invocation", "call", "call_copied"]

log = logging.getLogger("onecopy")


def data_pointer(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def call(function: EngineFunction, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None],
         stats: CopyStats | None = None) -> list[np.ndarray]:
    """One call of `function`: copied in and out when nothing is bound and the outputs are returned (the common
    call), else planned (bound surfaces in place, outputs written into their storage) and run once."""
    if not function.bindings and not function.outputs_in_place:
        return call_copied(function, inputs, outputs, stats if stats is not None else CopyStats())
    return Invocation(function, inputs, outputs).run(stats)


def call_copied(function: EngineFunction, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None],
                stats: CopyStats, context: Any = None) -> list[np.ndarray]:
    """The common call, with nothing to plan: no surface bound, results returned by the engine. The inputs are
    copied into engine buffers and the results copied out (into `outputs[i]` where given). It runs in `context`
    (a State's: its globals are the state) or, when None, in one checked out of the model's pool for this call.
    Written out flat, with no plan object: what runs after the engine runs with the interpreter's caches cold."""
    rt = function.rt
    args = rt.VmVariantList(len(inputs))
    copy_in = function.copy_in
    copied = 0
    for array in inputs:
        args.push_ref(copy_in(array))
        copied += array.nbytes
    stats.copied_in += copied
    results = rt.VmVariantList(max(len(outputs), 1))
    model = function.model
    pooled = context is None
    if pooled:
        try:
            context = model._pool.pop()
        except IndexError:
            context = function.new_context()  # none free; names this function if the model closed meanwhile
    try:
        context.invoke(function.vm_function, args, results)
    except (RuntimeError, ValueError) as e:  # ValueError: IREE refused the call
        raise function.engine_error(e) from e
    finally:
        if pooled:
            model.checkin(context)
    view_type, copy_out = rt.HalBufferView, function.copy_out
    return [copy_out(results.get_as_object(i, view_type), out, stats, i) for i, out in enumerate(outputs)]


def _byte_range(array: np.ndarray) -> tuple[int, int]:
    """The bytes a dense array spans, [start, end)."""
    start = data_pointer(array)
    return start, start + array.nbytes


def _overlaps(span: tuple[int, int], spans: Sequence[tuple[int, int]]) -> bool:
    return any(start < span[1] and span[0] < end for start, end in spans)


class Invocation(Plan):
    """A planned call of `function` on `inputs`, writing `outputs` (None entries: new arrays each run)."""

    def __init__(self, function: EngineFunction, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None]):
        rt = function.rt
        self._rt = rt
        self._function = function
        self._vm_function = function.vm_function
        self._outputs = list(outputs)
        self._in_place = function.outputs_in_place
        self._result_count = max(len(outputs), 1)
        self._args: Any = None
        bindings = function.bindings
        # The table this plan was made with (replaced, never mutated, on each bind): a surface bound since makes
        # the next run plan again, so that it reads or writes that surface in place, as a new call would.
        self._planned_with = bindings
        self._inputs = inputs
        self._plain = not bindings and not self._in_place
        if self._plain:  # the common call: nothing bound, results returned (`call_copied` runs it)
            self._slots: list[Any] = list(inputs)
            self.only_surfaces = False
            return
        device = function.model.device

        def bound(array: np.ndarray | None) -> SurfaceBinding | None:
            return bindings.get(data_pointer(array)) if bindings and array is not None else None

        # Per argument: a buffer view (in place) or an array to copy in at each run.
        self._slots = []
        read_in_place: list[tuple[int, int]] = []  # byte ranges the engine reads in place
        self._copied = []
        self._open_checks = []  # bound surfaces: closed ones fail the run
        locks: dict[str, tuple[Any, bool]] = {}  # surface name -> (surface, readonly); a writer wins
        in_place_in = copied_in = in_place_out = 0
        for i, array in enumerate(inputs):
            binding = bound(array)
            what = f"input {i}"
            if binding is not None:
                self._open_checks.append((binding, what))
            if binding is not None and binding.in_place(array):
                self._slots.append(binding.buffer_view(device, array.shape, array.dtype, what))
                in_place_in += array.nbytes
                read_in_place.append(_byte_range(array))
                locks.setdefault(binding.surface.name, (binding.surface, True))
            else:
                self._slots.append(array)
                self._copied.append(array)
                copied_in += array.nbytes

        self._staged = []  # in-place outputs that land in an engine buffer first
        out_bindings = [bound(out) for out in outputs]
        if self._in_place:
            if any(out is None for out in outputs):
                raise ExecutionError(
                    f"{function.where}: function '{function.name}' writes its outputs in place and needs "
                    "storage for each; pass it with outputs=[...]."
                )
            for i, (out, binding) in enumerate(zip(outputs, out_bindings)):
                what = f"output {i}"
                if binding is not None:
                    self._open_checks.append((binding, what))
                # An output over memory the engine reads in place (the same surface given as input and output)
                # lands in an engine buffer first: a kernel may read an input element after writing an output
                # element there (a flip, a convolution), which would read its own results.
                if (binding is not None and binding.in_place(out)  # type: ignore[arg-type]
                        and not _overlaps(_byte_range(out), read_in_place)):  # type: ignore[arg-type]
                    self._slots.append(binding.buffer_view(device, out.shape, out.dtype, what))  # type: ignore[union-attr]
                    in_place_out += out.nbytes  # type: ignore[union-attr]
                    locks[binding.surface.name] = (binding.surface, False)
                else:
                    view = function.allocate(out.shape, out.dtype)  # type: ignore[union-attr]
                    self._slots.append(view)
                    self._staged.append((i, view))
                    if binding is not None:  # copied into the surface under its write lock, before it is given back
                        locks[binding.surface.name] = (binding.surface, False)
        else:
            self._open_checks.extend((b, f"output {i}") for i, b in enumerate(out_bindings) if b is not None)
        # Taken in name order, so two processes locking the same surfaces never wait on each other in a cycle;
        # given back in the reverse order. One C call takes them all, one gives them back (surface/lock.py).
        ordered = [locks[name] for name in sorted(locks)]
        self._locks = [surface._lock for surface, _ in ordered]
        self._lock_cores = tuple(lock.core for lock in self._locks)
        self._lock_modes = tuple(readonly for _, readonly in ordered)
        # When every bound surface is one whose lock the run takes, a closed one fails `take_all` (closing marks
        # its lock closed): the run checks them only then, for the error. Otherwise it checks them all first.
        locked = {id(surface) for surface, _ in ordered}
        self._checks_first = [(b, w) for b, w in self._open_checks if id(b.surface) not in locked]
        self._constant = CopyStats(copied_in=copied_in, in_place_in=in_place_in, in_place_out=in_place_out)
        if not self._copied:  # every argument is a view: one argument list serves every run
            self._args = rt.VmVariantList(len(self._slots))
            for view in self._slots:
                self._args.push_ref(view)
        # Every argument is a bound surface the engine reads or writes in place: the plan holds views of surfaces
        # only, none of the caller's own arrays, so keeping it for the next call costs no memory.
        self.only_surfaces = not self._copied and not self._staged and self._in_place

    def frame_run(self, report: RunReport) -> Callable[[], list[np.ndarray]] | None:
        """This plan's run as a frame step (onecopy.delegate.frame_step), reporting each run as `report` says,
        when the plan is one: every argument a bound surface read or written in place, each one's lock taken by
        the run (so a closed one shows when taking it fails). None otherwise: `run` is the way then."""
        if not self.only_surfaces or self._checks_first:
            return None
        function = self._function
        model = function.model
        return frame_step(
            is_closed=report.closed.is_set, on_closed=report.on_closed, debug_enabled=log.isEnabledFor,
            debug_level=DEBUG, record=report.record, local=report.local, stats=self._constant,
            outputs=tuple(self._outputs), pool=model._pool, new_context=function.new_context,
            vm_function=self._vm_function, arguments=self._args, result_list=self._rt.VmVariantList,
            result_count=self._result_count, engine_error=function.engine_error, cores=self._lock_cores,
            modes=self._lock_modes, wait_locks=self._take_rest, wake=self._wake,
        )

    def _take_rest(self, taken: int) -> int:
        """The locks `take_all` did not take, from `taken` on: says which surface is closed, or waits for the
        others (see `_take_waiting`)."""
        for binding, what in self._open_checks:
            binding.check_open(what)
        return self._take_waiting(taken)

    def _wake(self, taken: int) -> None:
        wake_waiting(self._locks[:taken])

    def _take_waiting(self, taken: int) -> int:
        """The locks `take_all` could not take at once, from `taken` on, waiting as long as it takes (a surface
        held by another process or thread, or closed: that raises). Returns how many are held, all of them;
        on an error, the ones taken here are given back and those before are left to the caller."""
        locks, modes = self._locks, self._lock_modes
        start = taken
        try:
            for i in range(start, len(locks)):
                locks[i].acquire(modes[i], track=False)
                taken = i + 1
        except BaseException:
            for i in reversed(range(start, taken)):
                locks[i].release(modes[i], track=False)
            raise
        return taken

    def run(self, stats: CopyStats | None = None) -> list[np.ndarray]:
        """Run the planned call on what the arrays hold now. Every decision is taken before the engine runs:
        after it, the interpreter's caches are cold (see the module docstring), so all that is left there is
        giving back the locks and the VM context, and the results."""
        stats = stats if stats is not None else CopyStats()
        function = self._function
        if function.bindings is not self._planned_with:
            self.__init__(function, self._inputs, self._outputs)  # type: ignore[misc]
        if self._plain:
            return call_copied(function, self._slots, self._outputs, stats)
        for binding, what in self._checks_first:
            binding.check_open(what)
        args = self._args
        if args is None:
            args = self._rt.VmVariantList(len(self._slots))
            copy_in = function.copy_in
            for slot in self._slots:
                args.push_ref(copy_in(slot) if isinstance(slot, np.ndarray) else slot)
        results = self._rt.VmVariantList(self._result_count)
        stats.add(self._constant)  # what the plan copies in and uses in place; copies out are added below
        model = function.model
        outputs = self._outputs
        staged = self._staged

        def copy_staged() -> None:  # run while the surfaces' locks are held: a reader elsewhere sees it whole
            for i, view in staged:
                function.copy_out(view, outputs[i], stats, i)

        engine_step(model._pool, function.new_context, self._vm_function, args, results, self._lock_cores,
                    self._lock_modes, self._take_rest, self._wake, function.engine_error,
                    copy_staged if staged else None)
        if self._in_place:
            return list(outputs)  # type: ignore[arg-type]
        rt = self._rt
        return [function.copy_out(results.get_as_object(i, rt.HalBufferView), out, stats, i)
                for i, out in enumerate(outputs)]

    __call__ = run  # an Invocation is the callable `prepare` returns; no extra frame per run
