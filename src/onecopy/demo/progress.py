"""The demo's progress bar (rich, on stderr), and the seconds each kind of step took."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Steps"]


class Steps:
    """One progress bar over the demo's steps (on stderr)."""

    def __init__(self, progress, total: int, check_interrupt: Callable[[], None] = lambda: None) -> None:
        self.progress, self.task = progress, progress.add_task("", total=total)
        self._check_interrupt = check_interrupt  # raises a Ctrl-C that was received but lost on the way
        self.seconds: dict[str, float] = {}  # per kind of step (the description's text before ':')
        self._current: tuple[str, float] | None = None

    def start(self, description: str) -> None:
        self._check_interrupt()
        self._stop()
        self._current = (description.split(":")[0], time.perf_counter())
        self.progress.update(self.task, description=description)

    def _stop(self) -> None:
        if self._current is not None:
            kind, began = self._current
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - began
            self._current = None

    def done(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)
