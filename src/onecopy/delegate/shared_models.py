"""The process-wide table of shared models: one loaded model per key, refcounted, loaded once.

Used when a delegate sets `share_multifunction_model`: every delegate of a multifunction program, in any program
loaded from the same file and in any thread, acquires the model under the same key and releases it when
destroyed; the last release unloads it.

Loads are tracked per key:
- delegates that start loading the same key at once wait for that one load;
- loads of other keys proceed in parallel (the table lock is never held while loading);
- a failed load leaves no entry: one of the waiters retries the load, and reports its own error if that fails too.

The coordinator knows nothing of IREE: it takes a `load` callable and a `close` for what it returns, so tests
drive it with fakes that block or fail on command.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["LoadCoordinator", "shared_models"]

M = TypeVar("M")


@dataclass
class _Slot(Generic[M]):
    done: threading.Event = field(default_factory=threading.Event)
    model: M | None = None
    refs: int = 0


class LoadCoordinator(Generic[M]):
    def __init__(self, close: Callable[[M], None] = lambda model: None):
        self._close = close
        self._lock = threading.Lock()
        self._slots: dict[Hashable, _Slot[M]] = {}

    def acquire(self, key: Hashable, load: Callable[[], M]) -> tuple[M, bool]:
        """The model under `key`, loading it if nobody has. Returns (model, loaded_here)."""
        while True:
            with self._lock:
                slot = self._slots.get(key)
                if slot is None:
                    slot = self._slots[key] = _Slot()
                    loading_here = True
                elif slot.model is not None:
                    slot.refs += 1
                    return slot.model, False
                else:
                    loading_here = False
            if not loading_here:
                # Another thread is loading this key. When it is done, the slot holds the model, or it is gone
                # (the load failed) and the next pass loads it here.
                slot.done.wait()
                continue
            try:
                model = load()
            except BaseException:
                with self._lock:
                    del self._slots[key]
                slot.done.set()
                raise
            with self._lock:
                slot.model = model
                slot.refs = 1
            slot.done.set()
            return model, True

    def release(self, key: Hashable) -> None:
        """Drop one reference; the last one removes the entry and closes the model."""
        with self._lock:
            slot = self._slots[key]
            slot.refs -= 1
            if slot.refs > 0:
                return
            del self._slots[key]
            model = slot.model
        self._close(model)  # type: ignore[arg-type]

    def refs(self, key: Hashable) -> int:
        with self._lock:
            slot = self._slots.get(key)
            return slot.refs if slot is not None else 0

    def keys(self) -> list[Hashable]:
        with self._lock:
            return [k for k, s in self._slots.items() if s.model is not None]


def _close_model(model) -> None:
    model.close()


#: The table the IREE backend uses.
shared_models: LoadCoordinator = LoadCoordinator(_close_model)
