"""Calls a method keeps for the calls that repeat them: a signature (shapes and dtypes) whose inputs passed the
checks once goes straight to the delegate on later calls, with no value table and no checks.

Such a call runs first after the previous one, with the interpreter's caches cold, where the checks are most of
what a call costs on top of the engine (a call streaming the built-in model's 32 MB of weights paid 80 us for
them, 5% of the call; a decode step of 0.12 ms ~15 of ~20 us).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import DEBUG
from operator import itemgetter
from typing import TypeVar

import numpy as np

from onecopy.runtime._layout import same_shapes
from onecopy.runtime.arguments import STATE_ADVICE, check_bounds
from onecopy.runtime.backend import DelegateHandle, RunReport
from onecopy.runtime.copy_stats import CopyStats, log
from onecopy.runtime.state import State

__all__ = ["CheckedCall", "CheckedStateCall", "KEPT", "remember", "templates_of"]

# Input signatures a method keeps: a model called at one or two batch sizes, or a few sequence lengths, skips
# the first call's checks for each.
KEPT = 4

_Call = TypeVar("_Call", "CheckedCall", "CheckedStateCall")


def templates_of(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Arrays of the shapes and dtypes of `arrays`, holding no memory: what `same_shapes` compares calls with."""
    return tuple(np.broadcast_to(np.zeros((), a.dtype), a.shape) for a in arrays)


def remember(known: tuple[_Call, ...], inputs: Sequence[object],
             make: Callable[[tuple[np.ndarray, ...]], _Call]) -> tuple[_Call, ...]:
    """`known` with a call for the signature of `inputs` first (made by `make(templates)`, `templates_of` the
    inputs), unless one is known or an input is not a plain numpy array (anything else is converted on each call
    anyway). At most `KEPT`, newest first."""
    if not all(type(a) is np.ndarray for a in inputs):
        return known
    templates = templates_of(inputs)  # type: ignore[arg-type]
    if any(same_shapes(list(templates), c.templates) for c in known):
        return known
    return (make(templates), *known)[:KEPT]


def _shapes(arguments: tuple[int | np.ndarray, ...], templates: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    return [a if isinstance(a, np.ndarray) else templates[a] for a in arguments]


class CheckedCall:
    """A method that is one delegate call, on inputs of one signature (`templates`) that passed the method's
    checks and were copied into the engine, with nothing bound: a later `execute` on inputs of that signature
    hands them to the delegate and returns its results. With `out_templates`, the call of a caller that passed
    storage for every output (of those shapes and dtypes, writable: checked by `Method.execute` on each call),
    written instead of new arrays. Immutable, so shared by every thread calling the method. `arguments`: per
    delegate input, the index of the method input it is, or a constant of the program."""

    __slots__ = ("_report", "_handle", "templates", "out_templates", "_arguments", "_call", "_direct", "run")

    def __init__(self, report: RunReport, handle: DelegateHandle, templates: tuple[np.ndarray, ...],
                 arguments: tuple[int | np.ndarray, ...], outputs: int,
                 out_templates: tuple[np.ndarray, ...] | None = None) -> None:
        self._report = report
        self._handle = handle
        self.templates = templates
        self.out_templates = out_templates
        self._arguments = arguments
        # The delegate takes the inputs as given (compared one by one: a constant is an array, never equal).
        self._direct = len(arguments) == len(templates) and all(
            type(a) is int and a == i for i, a in enumerate(arguments))
        # What the delegate can work out once for this signature, it does now: the whole call with the method's
        # bookkeeping when it can (DelegateHandle.checked_call, one frame: `run` is that callable), else the
        # engine call, around which `_checked_run` does the bookkeeping (DelegateHandle.copied_call).
        whole = handle.checked_call(templates, outputs, report) if self._direct else None
        self._call = handle.copied_call(_shapes(arguments, templates), outputs) if whole is None else None
        self.run = whole if whole is not None else self._checked_run

    run: Callable[..., list[np.ndarray] | None]
    """`run(inputs, outs=None)` (`outs` by keyword): the call's results (`outs` when given); None when a surface
    was bound since (the call must go the checked way)."""

    def _checked_run(self, inputs: Sequence[np.ndarray], outs: Sequence[np.ndarray] | None = None
                     ) -> list[np.ndarray] | None:
        report = self._report
        if report.closed.is_set():
            report.on_closed()
        if self._handle.has_bound_surfaces:  # an input may now be a bound surface: let the planning see it
            return None
        arguments = inputs if self._direct else [
            inputs[a] if isinstance(a, int) else a for a in self._arguments]
        stats = CopyStats()
        debug = log.isEnabledFor(DEBUG)
        produced = self._call(arguments, stats) if outs is None else self._call(arguments, stats, outs=outs)
        report.record(stats, debug)
        return produced


class CheckedStateCall:
    """`CheckedCall` for a stateful method: run on a `State`, whose calls it serializes, with the inputs that
    index the engine's memory checked on every call (`bounds`: input index -> [low, high])."""

    __slots__ = ("_report", "_name", "_bounds", "_handle", "templates", "out_templates", "_arguments", "_call",
                 "_pick", "_domain")

    def __init__(self, report: RunReport, name: str, bounds: dict[int, tuple[int, int]], handle: DelegateHandle,
                 templates: tuple[np.ndarray, ...], arguments: tuple[int | np.ndarray, ...], outputs: int,
                 out_templates: tuple[np.ndarray, ...] | None = None) -> None:
        self._report = report
        self._name = name
        self._bounds = bounds
        self._handle = handle
        self.templates = templates
        self.out_templates = out_templates
        self._arguments = arguments
        self._call = handle.state_copied_call(_shapes(arguments, templates), outputs)
        # A decode step runs every few tens of microseconds, where each Python frame is a few percent: the
        # delegate's arguments taken from the inputs by one C call when they are inputs only (a list
        # comprehension is a frame of its own), and the State's backend state looked up without two.
        self._pick = itemgetter(*arguments) if len(arguments) > 1 and all(type(a) is int for a in arguments) else None
        self._domain = handle.state_domain()

    def run(self, inputs: Sequence[np.ndarray], state: State, outs: Sequence[np.ndarray] | None = None
            ) -> list[np.ndarray]:
        report = self._report
        if report.closed.is_set():
            report.on_closed()
        if self._bounds:
            check_bounds(self._name, self._bounds, inputs, STATE_ADVICE)
        pick = self._pick
        arguments = pick(inputs) if pick is not None else [inputs[a] if type(a) is int else a for a in self._arguments]
        stats = CopyStats()
        debug = log.isEnabledFor(DEBUG)
        domain = self._domain
        with state._lock:
            if state._closed or state._program.closed:
                state._check()
            known = state._domains.get(id(domain))  # State._backend_for, inline when the State has it
            backend_state = known[1] if known is not None and known[0] is domain else state._backend_for(self._handle)
            produced = (self._call(arguments, stats, backend_state) if outs is None
                        else self._call(arguments, stats, backend_state, outs=outs))
        report.record(stats, debug)
        return produced
