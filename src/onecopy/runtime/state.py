"""State: the tensors a program keeps between calls (a KV cache), held by the engine and updated in place.

    prog = Runtime().load_program("llm.onecopy")
    prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
    s = prog.create_state()                        # its own cache; the same weights
    (logits,) = prefill.execute([ids, positions], state=s)
    (logits,) = decode.execute([next_id, position], state=s)
    s.read("key_cache_0")                          # a numpy copy
    fork = s.copy(); s.reset(); s.save("chat.npz"); prog.load_state("chat.npz")

Without `state=`, a stateful method runs on the program's default state. A State belongs to one program and is
used by one call at a time (calls on it are serialized); different States run in parallel. The state's bytes
never cross into Python on a call: `last_copy_stats` counts only the method's inputs and outputs.

A State is made lazily, per module that holds states (a backend "domain"): its engine storage is created by the
first call that needs it, so a State that only has values written or loaded keeps them here until then.
"""

from __future__ import annotations

import os
import threading
import weakref
import zipfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from onecopy.errors import ExecutionError, InvalidArgument
from onecopy.program import NamedData, ProgramDef, StateDef, write_atomically
from onecopy.runtime.backend import DelegateHandle

__all__ = ["State"]


class StateOwner(Protocol):
    """What a State needs of its program (onecopy.runtime.program.Program, which imports this module)."""

    @property
    def source(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def definition(self) -> ProgramDef: ...
    @property
    def named_data(self) -> NamedData: ...
    def create_state(self) -> State: ...


class State:
    """The states of one program, at their own values. Make one with `Program.create_state()` or
    `Program.load_state(path)`; use it with `method.execute(inputs, state=s)`."""

    def __init__(self, program: StateOwner, _token: object = None):
        if _token is not _TOKEN:
            raise InvalidArgument("Create a State with program.create_state() or program.load_state(path).")
        self._program = program
        self._defs: dict[str, StateDef] = {d.name: d for d in program.definition.states}
        # Serializes the calls on this state: one VM context is not for concurrent use.
        self._lock = threading.RLock()
        self._domains: dict[int, tuple[Any, Any]] = {}  # id(domain) -> (domain, backend state)
        self._by_name: dict[str, Any] = {}  # state name -> backend state holding it
        self._pending: dict[str, np.ndarray] = {}  # values set before the engine held them
        self._closed = False

    def __repr__(self) -> str:
        return f"<onecopy.State of {self._program.source!r}: {', '.join(self._defs)}>"

    def names(self) -> list[str]:
        """The program's state names, e.g. ['key_cache_0', 'value_cache_0', ...]."""
        return list(self._defs)

    def _check(self, name: str | None = None) -> None:
        if self._closed and not self._program.closed:
            raise ExecutionError("This State was closed (State.close()); create a new one with program.create_state().")
        if self._closed or self._program.closed:
            raise ExecutionError(
                f"This State belongs to program '{self._program.source}', which is closed; load the program again "
                "and create a new state (save() one before closing to keep its values)."
            )
        if name is not None and name not in self._defs:
            raise InvalidArgument(
                f"Program '{self._program.source}' has no state '{name}'; it has {', '.join(self._defs) or 'none'}."
            )

    def _initial(self, name: str) -> np.ndarray:
        d = self._defs[name]
        shape = [int(x) for x in d.spec.shape]
        if d.initial is None:
            return np.zeros(shape, d.spec.dtype)
        return np.frombuffer(self._program.named_data[d.initial], d.spec.dtype).reshape(shape).copy()

    def read(self, name: str) -> np.ndarray:
        """A copy of state `name` as it is now."""
        with self._lock:
            self._check(name)
            backend = self._by_name.get(name)
            if backend is not None:
                return backend.read(name)
            pending = self._pending.get(name)
            return pending.copy() if pending is not None else self._initial(name)

    def write(self, name: str, value: Any) -> None:
        """Set state `name` to `value` (same shape and dtype)."""
        with self._lock:
            self._check(name)
            array = self._checked(name, value, "State.write")
            backend = self._by_name.get(name)
            if backend is not None:
                backend.write({name: array})
            else:
                self._pending[name] = array.copy()

    def _checked(self, name: str, value: Any, what: str) -> np.ndarray:
        d = self._defs[name]
        array = np.asarray(value)
        shape = [int(x) for x in d.spec.shape]
        if list(array.shape) != shape or array.dtype != np.dtype(d.spec.dtype):
            raise InvalidArgument(
                f"{what}: state '{name}' is {shape} {d.spec.dtype}, got {list(array.shape)} {array.dtype}."
            )
        return np.require(array, requirements="C")  # keeps a 0-d array 0-d, unlike ascontiguousarray

    def reset(self) -> None:
        """Every state back to its initial value (zeros for a KV cache)."""
        with self._lock:
            self._check()
            self._pending.clear()
            for _, backend in self._domains.values():
                backend.reset()

    def copy(self) -> State:
        """A new, independent State of the same program holding this one's values now (e.g. to fork several
        continuations after one shared prompt)."""
        with self._lock:
            self._check()
            fork = self._program.create_state()
            fork._pending = self._values()
            return fork

    # `copy.copy(s)` would otherwise give a second object over the same engine storage (its dicts shared), whose
    # calls update `s` too: a fork that is none. Both copies fork, as `copy()` does.
    def __copy__(self) -> State:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> State:
        return self.copy()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The values live in the engine (a VM context): pickle would fail on a memoryview deep inside instead.
        raise InvalidArgument(
            f"A State of program '{self._program.source}' cannot be pickled: its values are held by the engine. "
            "Write them with state.save(path) and read them back with program.load_state(path)."
        )

    def _values(self) -> dict[str, np.ndarray]:
        """Copies of every state: one engine read per module holding some."""
        values: dict[str, np.ndarray] = {}
        for _, backend in self._domains.values():
            values.update(backend.read_all())
        for name in self._defs:
            if name not in values:
                pending = self._pending.get(name)
                values[name] = pending.copy() if pending is not None else self._initial(name)
        return {name: values[name] for name in self._defs}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write every state to `path` (numpy .npz) atomically: never a half-written file."""
        with self._lock:
            self._check()
            values = self._values()
        names = np.array(list(values), dtype=np.str_)
        return write_atomically(
            path, lambda out: np.savez(out, **{f"s{i}": v for i, v in enumerate(values.values())}, __names__=names),
            "the state")

    def _load(self, path: str | os.PathLike[str]) -> None:
        where = str(path)
        try:
            # np.load reads anything else as one array (.npy: no context manager, a raw TypeError below) or
            # tries pickle (refused, with a hint to unpickle the file): say what the file is not instead.
            if Path(path).is_file() and not zipfile.is_zipfile(path):
                raise ValueError("it is not the .npz archive State.save writes")
            with np.load(path, allow_pickle=False) as data:
                names = [str(n) for n in data["__names__"]]
                values = {name: data[f"s{i}"] for i, name in enumerate(names)}
        except FileNotFoundError:
            raise InvalidArgument(f"State file '{where}' does not exist.") from None
        except (OSError, ValueError, KeyError) as e:
            raise InvalidArgument(f"'{where}' is not a state saved by State.save: {e}.") from e
        if sorted(names) != sorted(self._defs):
            raise InvalidArgument(
                f"State file '{where}' holds states {sorted(names)}, but program '{self._program.source}' has "
                f"{sorted(self._defs)}; it was saved from another program."
            )
        for name, value in values.items():
            self._pending[name] = self._checked(name, value, f"State file '{where}'")

    def _backend_for(self, handle: DelegateHandle) -> Any:
        domain = handle.state_domain()
        known = self._domains.get(id(domain))
        if known is not None and known[0] is domain:
            return known[1]
        backend = handle.create_state()
        pending = {name: self._pending.pop(name) for name in handle.state_names if name in self._pending}
        if pending:
            backend.write(pending)
        for name in handle.state_names:
            self._by_name[name] = backend
        self._domains[id(domain)] = (domain, backend)
        return backend

    def close(self) -> None:
        """Release the engine memory of this state (its caches). Later use is an error."""
        with self._lock:
            self._closed = True
            for _, backend in self._domains.values():
                backend.close()
            self._domains.clear()
            self._by_name.clear()


_TOKEN = object()


def new_state(program: StateOwner) -> State:
    return State(program, _TOKEN)


def load_state(program: StateOwner, path: str | os.PathLike[str]) -> State:
    state = State(program, _TOKEN)
    state._load(path)
    return state


class StateRegistry:
    """A program's States, so closing the program releases their engine memory before its models."""

    def __init__(self) -> None:
        self._states: weakref.WeakSet[State] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, state: State) -> State:
        with self._lock:
            self._states.add(state)
        return state

    def close_all(self) -> None:
        with self._lock:
            states = list(self._states)
        for state in states:
            state.close()
