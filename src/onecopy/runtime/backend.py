"""The contract between the runtime and a delegate backend, and the table that finds a backend by name.

A backend declares its typed options and turns a manifest into a `DelegateHandle`:

    class MyBackend(Backend):
        name = "MyBackend"
        options = {"threads": int}

        def init(self, context: InitContext, manifest: Mapping[str, Any]) -> DelegateHandle: ...

Built-in backends are imported on first use, so a program that never names one never imports its engine.
"""

from __future__ import annotations

import abc
import importlib
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from onecopy.errors import DelegateError, InvalidArgument
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.init_context import InitContext, OptionValue
from onecopy.runtime.method_meta import DelegateSummary

__all__ = ["Backend", "DelegateHandle", "DelegateSummary", "OptionValue", "Plan", "RunReport", "delegate_summary",
           "get_backend", "register_backend", "backend_names"]


class RunReport(NamedTuple):
    """What a run of a method that is one delegate call does besides the call, for whatever runs it whole (a
    plan's `frame_run`, the runtime's kept calls): refuse to run once `closed` is set (`on_closed()` raises the
    error), then `record(stats, debug)` the run's `CopyStats` (copy_stats.StatsRecord: `local.stats = stats`, and
    a log line when `debug`, which the run decides before the engine runs). A native run may set `local.stats`
    itself and call `record(stats, True)` only when logging."""

    closed: threading.Event
    on_closed: Callable[[], None]
    local: threading.local
    record: Callable[[CopyStats, bool], None]


class Plan(abc.ABC):
    """A call of a delegate on fixed arrays, planned once and run many times (`DelegateHandle.prepare`).

    The runtime asks every plan the same two things, and a backend answers what its plans can do:
    - `only_surfaces`: the plan references nothing but bound surfaces (none of the caller's own arrays), so
      `Method.execute` may keep it for the calls that repeat it at no cost in memory;
    - `frame_run(report)`: a callable with no arguments that runs the plan for a method that is this one call,
      with the method's own bookkeeping (`RunReport`) done too, and returns the outputs; None when the plan has
      no such run. A backend can run a frame loop's whole step natively that way.
    """

    only_surfaces: bool = False

    @abc.abstractmethod
    def __call__(self, stats: CopyStats) -> list[np.ndarray]:
        """Run on what the arrays hold now; add the bytes copied and used in place to `stats`."""

    def frame_run(self, report: RunReport) -> Callable[[], list[np.ndarray]] | None:
        return None


class _ExecutePlan(Plan):
    """The plan of a backend that plans nothing ahead: each run is an `execute`."""

    def __init__(self, handle: DelegateHandle, inputs: Sequence[np.ndarray],
                 outputs: Sequence[np.ndarray | None]) -> None:
        self._handle, self._inputs, self._outputs = handle, inputs, outputs

    def __call__(self, stats: CopyStats) -> list[np.ndarray]:
        return self._handle.execute(self._inputs, self._outputs, stats)


class DelegateHandle(abc.ABC):
    """A delegate initialized by its backend: runs one lowered partition."""

    #: Engine function this delegate runs (for method_meta and logs).
    function: str = ""

    @abc.abstractmethod
    def execute(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None], stats: CopyStats
    ) -> list[np.ndarray]:
        """Run on `inputs`; write into `outputs[i]` where given, else return new arrays. Add the bytes copied
        in and out (and used in place) to `stats`."""

    def prepare(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None]
    ) -> Plan:
        """A call on these very arrays, planned once and run many times (`Method.prepare`; see `Plan`). A
        backend that plans nothing ahead gets this default: each run is an `execute`."""
        return _ExecutePlan(self, inputs, outputs)

    def copied_call(
        self, inputs: Sequence[np.ndarray], outputs: int
    ) -> Callable[[Sequence[np.ndarray], CopyStats], list[np.ndarray]]:
        """A call for inputs shaped as `inputs` (shapes and dtypes; the arrays may hold no memory of their own),
        nothing bound, `outputs` results returned: a callable taking the arrays and the `CopyStats` to add to.
        `Method.execute` makes one per input signature that passed its checks and calls it for every later call of
        that signature, so a backend may work out here what does not change between such calls. The callable also
        takes `outs=`: the caller's storage for every result (checked by the caller), written instead of new
        arrays. This default runs each as an `execute`."""
        nothing: list[None] = [None] * outputs
        return lambda arrays, stats, outs=None: self.execute(arrays, nothing if outs is None else outs, stats)

    def checked_call(
        self, inputs: Sequence[np.ndarray], outputs: int, report: RunReport
    ) -> Callable[..., list[np.ndarray] | None] | None:
        """`copied_call` for a method that is this one delegate call on its own inputs, with the method's
        bookkeeping (`report`) done inside the call, `call(arrays, outs=None)` (`outs` by keyword): refuse once
        closed, return None when a surface was bound since (the call must then go the checked way, planned), and
        record the CopyStats. What runs between two calls runs with the interpreter's caches cold, so a backend
        that does it all in one frame saves the runtime's frames around it. None (this default): the runtime does
        the bookkeeping around `copied_call`."""
        return None

    def bind_surface(self, surface: Any) -> None:
        """Read and write `surface` in place when an argument is the surface's memory in its own layout (its base
        address, C-contiguous, all of it); any other view of it is copied through its strides."""
        raise InvalidArgument(f"Delegate '{self.function}' (backend {type(self).__name__}) cannot bind surfaces.")

    @property
    def bound_surfaces(self) -> dict[str, Any]:
        """Surfaces bound to this delegate, by name."""
        return {}

    @property
    def runs_on(self) -> str:
        """What runs this delegate's calls, in a few words (engine, device, executor): for people and tools."""
        return type(self).__name__

    @property
    def device(self) -> str:
        """The device part of `runs_on` alone, short enough for a table column (e.g. `local-sync`)."""
        return self.runs_on

    @property
    def has_bound_surfaces(self) -> bool:
        """Whether any surface is bound (checked on every call: cheaper than `bound_surfaces`)."""
        return False

    # Program state (onecopy.runtime.state). A delegate whose module holds states names them in `state_names`;
    # every delegate returning the same `state_domain()` shares one backend state per `State` (`create_state`),
    # in which `execute_with_state` runs it.
    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the program states this delegate's module holds (empty: it holds none)."""
        return ()

    def state_domain(self) -> Any:
        raise InvalidArgument(f"Delegate '{self.function}' (backend {type(self).__name__}) holds no state.")

    def create_state(self) -> Any:
        """A new backend state holding every state of this delegate's domain at its initial value. It has
        `read(name) -> np.ndarray`, `read_all() -> {name: array}`, `write({name: array})`, `reset()` and
        `close()`."""
        raise InvalidArgument(f"Delegate '{self.function}' (backend {type(self).__name__}) holds no state.")

    def execute_with_state(self, state: Any, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None],
                           stats: CopyStats) -> list[np.ndarray]:
        """`execute` on the states of `state` (made by `create_state` of a delegate of the same domain)."""
        raise InvalidArgument(f"Delegate '{self.function}' (backend {type(self).__name__}) holds no state.")

    def state_copied_call(self, inputs: Sequence[np.ndarray], outputs: int
                          ) -> Callable[[Sequence[np.ndarray], CopyStats, Any], list[np.ndarray]]:
        """`execute_with_state` for inputs shaped as `inputs`, nothing bound, `outputs` results returned: a
        callable taking (arrays, stats, backend state, outs=None), made once per input signature (see
        `copied_call`)."""
        nothing: list[None] = [None] * outputs
        return lambda arrays, stats, state, outs=None: self.execute_with_state(
            state, arrays, nothing if outs is None else outs, stats)

    def profile(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], seconds: float) -> Any:
        """Where a call's time goes inside the engine (`Method.profile`): the call made back to back on `inputs`
        (`outputs`: storage of the outputs' shapes, for an engine that takes it) for about `seconds`."""
        raise InvalidArgument(f"Delegate '{self.function}' (backend {type(self).__name__}) cannot profile its "
                              "calls; profiles cover IREE's CPU executors.")

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release engine resources. Called once, by `Program.close()`."""


class Backend(abc.ABC):
    name: ClassVar[str]
    #: Typed backend options: name -> bool, int or str. Anything else given at load is `InvalidArgument`.
    options: ClassVar[Mapping[str, type]]

    @abc.abstractmethod
    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> DelegateHandle:
        """Validate `manifest` and load what it points at. Raise `DelegateError`/`InvalidArgument` on bad input."""

    def engine_version(self) -> str:
        """The engine's version, where a choice between delegates measured on this machine depends on it (the
        key of `load_program(prefer="latency")`'s record). This default: none."""
        return ""

    def describe(self, manifest: Mapping[str, Any], where: str) -> DelegateSummary:
        """`manifest` read through this backend's schema (a bad one raises `DelegateError` naming `where`). This
        default knows nothing of it."""
        return DelegateSummary()

    def verify_manifest(self, manifest: Mapping[str, Any], named_data: Collection[str], where: str) -> list[str]:
        """Problems with `manifest` found without loading anything (`Program.verify`, `onecopy verify`): its
        schema, and the keys of `named_data` it names. One sentence each, naming `where`; empty when clean. This
        default finds none."""
        return []


_BUILTIN: dict[str, str] = {"IreeBackend": "onecopy.delegate.backend:IreeBackend",
                             "OpenVinoBackend": "onecopy.delegate.openvino.backend:OpenVinoBackend"}
_registered: dict[str, Backend] = {}
_lock = threading.Lock()


def register_backend(backend: Backend) -> None:
    with _lock:
        _registered[backend.name] = backend


def delegate_summary(index: int, program: Any, where: str = "") -> DelegateSummary:
    """Delegate `index` of `program` (a `ProgramDef`) as its backend reads its manifest, a bad one an error naming
    `where`; a backend this process does not know describes nothing (loading it fails, naming the known ones)."""
    delegate = program.delegates[index]
    try:
        backend = get_backend(delegate.backend)
    except DelegateError:
        return DelegateSummary()
    return backend.describe(delegate.manifest, where or f"delegate {index} ({delegate.backend})")


def backend_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_registered))


def get_backend(name: str) -> Backend:
    with _lock:
        backend = _registered.get(name)
        if backend is not None:
            return backend
        target = _BUILTIN.get(name)
        if target is None:
            raise DelegateError(f"No backend named '{name}'; known backends: {', '.join(backend_names())}.")
        module_name, class_name = target.split(":")
        backend = getattr(importlib.import_module(module_name), class_name)()
        _registered[name] = backend
        return backend
