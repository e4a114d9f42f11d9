"""Runtime and Program: load a program file, list and load its methods, release everything on close."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from onecopy.errors import DelegateError, InvalidArgument, OnecopyError, ProgramFormatError
from onecopy.program import DelegateCall, LoadedProgramFile, MethodDef, Problem, check_program, read_program
from onecopy.program.validate import hash_problems
from onecopy.runtime.backend import DelegateHandle, delegate_summary, get_backend
from onecopy.runtime.backend_options import DEFAULT_PRECISION, BackendOptions, check_precision, parse_backend_options
from onecopy.runtime.init_context import InitContext
from onecopy.runtime.method import Method
from onecopy.runtime.method_meta import DelegateSummary, MethodMeta
from onecopy.runtime.state import State, StateRegistry, load_state, new_state

__all__ = ["Runtime", "Program", "verify_program"]

log = logging.getLogger("onecopy")


def verify_program(program: str | os.PathLike[str] | bytes | bytearray | memoryview) -> list[Problem]:
    """Check a program file whole, without running it (`onecopy verify`): its header's structure, every segment
    against its sha256, every delegate's manifest against its backend's schema (nothing is loaded) and the named
    data each names. One `Problem` per thing wrong; empty when the file is whole. A path that cannot be opened
    raises `InvalidArgument`."""
    loaded, problems = check_program(program)
    if loaded is None:
        return problems
    try:
        problems.extend(_manifest_problems(loaded))
    finally:
        loaded.close()
    return problems


def _manifest_problems(loaded: LoadedProgramFile) -> list[Problem]:
    problems = []
    keys = {s.key for s in loaded.definition.segments}
    for index, delegate in enumerate(loaded.definition.delegates):
        where = f"delegate {index} ({delegate.backend})"
        try:
            found = get_backend(delegate.backend).verify_manifest(delegate.manifest, keys, where)
        except OnecopyError as e:  # no such backend
            found = [str(e)]
        problems.extend(Problem(where, text.removeprefix(f"{where}: ")) for text in found)
    return problems


class Runtime:
    """Entry point of the runtime. `cache_dir`: where specialized programs are kept (None: the default)."""

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None):
        if cache_dir is not None and os.fspath(cache_dir) == "":
            # Path("") is ".": the cache went silently into whatever the working directory was at each load
            raise InvalidArgument("Runtime(cache_dir='') names no directory; pass a path, or None for the default.")
        # Absolute now: a relative cache_dir must not move with a later os.chdir
        self.cache_dir = Path(cache_dir).absolute() if cache_dir is not None else None

    def load_program(
        self,
        program: str | os.PathLike[str] | bytes | bytearray | memoryview,
        *,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        prefer: str = "memory",
        precision: str = DEFAULT_PRECISION,
    ) -> "Program":
        """Map a program file (or bytes) and check its header; methods load on `load_method`.

        `prefer`: for methods with an alternative delegate (exported with `CompileSpec(delegates=("iree",
        "openvino"))`), "memory" (default) runs IREE, which keeps one copy of the weights in memory; "latency"
        runs the delegate measured fastest on this machine (timed at the first load, recorded in the cache; see
        onecopy.runtime.selection).

        `precision`: "fp32" (default) or "bf16": fp32 inputs and outputs, matmuls and convolutions computed on
        bf16 inputs with f32 accumulation, for CPUs with native bf16 (AVX512-BF16, AMX-BF16, Arm BF16). A
        delegate that cannot honour it (another CPU, an AOT `vmfb` program) fails `load_method` with
        `InvalidArgument` saying why."""
        if prefer != "memory":
            # Imported only when asked for: a process that never prefers latency never pays for it.
            from onecopy.runtime.selection import PREFERENCES

            if prefer not in PREFERENCES:
                raise InvalidArgument(f"load_program: prefer={prefer!r} is not one of "
                                      f"{', '.join(map(repr, PREFERENCES))}; use prefer=\"memory\" (one copy of the "
                                      'weights) or prefer="latency".')
        options = parse_backend_options(backend_options)
        check_precision(precision, f"load_program({str(program)[:80]!r})" if isinstance(program, (str, os.PathLike))
                        else "load_program")
        return Program(read_program(program), options, self, prefer=prefer, precision=precision)


class Program:
    """A loaded program. Close it (or use it as a context manager) to release its delegates and its mapping."""

    def __init__(self, loaded: LoadedProgramFile, options: BackendOptions, runtime: Runtime, *,
                 prefer: str = "memory", precision: str = DEFAULT_PRECISION):
        self._file = loaded
        self._prefer = prefer
        self._options = options
        self.precision = precision
        self._runtime = runtime
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._handles: list[DelegateHandle] = []
        self._methods = {m.name: m for m in loaded.definition.methods}
        # The methods loaded, by name: `load_method` hands out the same one, with its bound surfaces, plans and
        # kept calls. A method holds its program (see Method), so the two form a cycle: a program nobody holds
        # any more is closed by the cycle collector, or by `close()`.
        self._loaded: dict[str, Method] = {}
        self._states = StateRegistry()
        self._default_state: State | None = None

    @property
    def source(self) -> str:
        return self._file.source

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def state_names(self) -> list[str]:
        """The program's states (tensors its methods keep between calls, e.g. a KV cache)."""
        return [s.name for s in self._file.definition.states]

    def create_state(self) -> State:
        """A new State: every state at its initial value, its own engine memory, the program's one copy of the
        weights. Use it with `method.execute(inputs, state=s)`."""
        self._check_stateful()
        return self._states.add(new_state(self))

    def load_state(self, path: str | os.PathLike[str]) -> State:
        """A new State holding the values `State.save` wrote to `path` (checked against this program's states)."""
        self._check_stateful()
        return self._states.add(load_state(self, path))

    @property
    def default_state(self) -> State:
        """The State a stateful method uses when called without `state=`."""
        with self._lock:
            if self._default_state is None:
                self._check_stateful()
                self._default_state = self._states.add(new_state(self))
            return self._default_state

    def _check_stateful(self) -> None:
        if self._closed.is_set():
            raise InvalidArgument(f"Program '{self._file.source}' is closed; load it again.")
        if not self._file.definition.states:
            raise InvalidArgument(f"Program '{self._file.source}' keeps no state; its methods are pure functions.")

    @property
    def method_names(self) -> list[str]:
        return list(self._methods)

    @property
    def path(self) -> Path | None:
        return self._file.path

    @property
    def definition(self):
        return self._file.definition

    @property
    def named_data(self):
        """The program's named data store (weights, constants, initial states), mapped from its file."""
        return self._file.named_data

    def method_meta(self, name: str) -> MethodMeta:
        return MethodMeta.from_definition(self._method_def(name), self._file.definition, self._describer(name))

    def _method_def(self, name: str):
        try:
            return self._methods[name]
        except KeyError:
            raise InvalidArgument(
                f"Program '{self._file.source}' has no method '{name}'; it has {', '.join(self._methods)}."
            ) from None

    def load_method(self, name: str) -> Method:
        """Initialize the method's delegates and return it ready to execute; the same Method for the same name
        on every later call (its bound surfaces and kept plans with it)."""
        if self._closed.is_set():
            raise InvalidArgument(f"Program '{self._file.source}' is closed; load it again.")
        method = self._loaded.get(name)
        if method is not None:
            return method
        definition = self._method_def(name)
        meta = MethodMeta.from_definition(definition, self._file.definition, self._describer(name))
        if self._prefer == "latency" and definition.alternatives:
            from onecopy.runtime.selection import choose_and_load

            method, handles = choose_and_load(
                definition, meta, self._file.definition, source=self._file.source, cache_dir=self._runtime.cache_dir,
                init=lambda indices: self._init_delegates(definition, meta, indices),
                make=lambda shown, handles: self._make_method(definition, shown, handles), precision=self.precision)
        else:
            handles = self._init_delegates(definition, meta, [ins.delegate for ins in definition.instructions
                                                               if isinstance(ins, DelegateCall)])
            method = self._make_method(definition, meta, handles)
        with self._lock:
            known = self._loaded.get(name)
            if known is None and not self._closed.is_set():
                self._handles.extend(handles.values())
                self._loaded[name] = method
                return method
        # Another thread loaded it meanwhile (that one is handed out), or the program closed while loading.
        for handle in handles.values():
            handle.destroy()
        if known is None:
            raise InvalidArgument(f"Program '{self._file.source}' is closed; load it again.")
        return known

    def _describer(self, method: str) -> Callable[[int], DelegateSummary]:
        """What MethodMeta asks of each delegate of `method`, a bad manifest named as its load would name it."""
        return lambda index: delegate_summary(index, self._file.definition, f"Method '{method}', delegate {index}")

    def _init_delegates(self, definition: MethodDef, meta: MethodMeta, indices: list[int]
                        ) -> dict[int, DelegateHandle]:
        """Initialize the delegates `indices` of the program for `definition`'s method; on failure, none stay."""
        name = definition.name
        handles: dict[int, DelegateHandle] = {}
        with _destroyed_on_error(handles):
            for index in indices:
                if index in handles:
                    continue
                delegate = self._file.definition.delegates[index]
                backend = get_backend(delegate.backend)
                context = InitContext(
                    method_name=name,
                    delegate_index=index,
                    named_data=self._file.named_data,
                    backend_options=self._options.get(delegate.backend, {}),
                    program_path=self._file.path,
                    cache_dir=self._runtime.cache_dir,
                    _method_meta=lambda: meta,
                    precision=self.precision,
                )
                try:
                    handles[index] = backend.init(context, delegate.manifest)
                except OnecopyError:
                    raise
                except Exception as e:
                    # A backend meets the bytes of a bundle first: a damaged one fails in its engine's terms.
                    raise DelegateError(
                        f"{context.where} (backend {delegate.backend}) failed to load: {type(e).__name__}: {e}. "
                        f"The program may be damaged; {self._verify_hint()} checks it."
                    ) from e
        return handles

    def _make_method(self, definition: MethodDef, meta: MethodMeta, handles: dict[int, DelegateHandle]) -> Method:
        """The Method over initialized `handles`; they are destroyed if it cannot be made."""
        with _destroyed_on_error(handles):
            try:
                return Method(definition, meta, handles, self._file.named_data, self._closed, owner=self)
            except OnecopyError:
                raise
            except Exception as e:
                raise ProgramFormatError(
                    f"Program '{self._file.source}', method '{definition.name}' cannot be loaded: "
                    f"{type(e).__name__}: {e}. {self._verify_hint()} checks the program."
                ) from e

    def verify(self) -> list[Problem]:
        """Check the whole program without running it: each segment's bytes against its sha256 (loading hashes
        none: programs are hundreds of MB), each delegate's manifest against its backend's schema, and the named
        data each names. The header's structure was checked at load. One `Problem` per thing wrong; empty when
        the program is whole."""
        if self._closed.is_set():
            raise InvalidArgument(f"Program '{self._file.source}' is closed; load it again.")
        named_data = self._file.named_data
        return hash_problems(self._file.definition.segments, named_data) + _manifest_problems(self._file)

    def _verify_hint(self) -> str:
        path = self._file.path
        return f"`onecopy verify {path}`" if path is not None else "Program.verify()"

    def close(self) -> None:
        """Destroy every delegate, then unmap the program. Methods of a closed program refuse to run."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            handles, self._handles = self._handles, []
            self._loaded.clear()
        self._states.close_all()  # their VM contexts go before the models they run on
        for handle in handles:
            handle.destroy()
        self._file.close()

    def __enter__(self) -> "Program":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Delegates hold engine references into the mapping; release them before the mapping goes.
        try:
            self.close()
        except Exception:
            pass


@contextlib.contextmanager
def _destroyed_on_error(handles: Mapping[int, DelegateHandle]) -> Iterator[None]:
    """Destroy every handle in `handles` (as filled so far) if the block fails: a method loads whole or not at all."""
    try:
        yield
    except BaseException:
        for handle in handles.values():
            handle.destroy()
        raise
