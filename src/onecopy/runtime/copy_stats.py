"""How many bytes a call copied into and out of the engine, and how many it used in place (bound surfaces).

`Method.last_copy_stats` holds the last call's figures (per thread), so a user can verify zero-copy:

    forward.bind_surface(frame)
    forward.execute([frame.array()], outputs=[result.array()])
    assert forward.last_copy_stats.copied == 0
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

__all__ = ["CopyStats", "StatsRecord"]

log = logging.getLogger("onecopy")


@dataclass
class CopyStats:
    """Bytes moved by one call: copied into/out of the engine, or used in place through bound surfaces."""

    copied_in: int = 0
    copied_out: int = 0
    in_place_in: int = 0
    in_place_out: int = 0

    def add(self, other: "CopyStats") -> None:
        self.copied_in += other.copied_in
        self.copied_out += other.copied_out
        self.in_place_in += other.in_place_in
        self.in_place_out += other.in_place_out

    @property
    def copied(self) -> int:
        return self.copied_in + self.copied_out


class StatsRecord:
    """The one place a method's calls record what they moved: `record(stats, debug)` keeps `stats` as the calling
    thread's last call's (`local.stats`, read by `Method.last_copy_stats`) and logs them when `debug`. Callers
    decide `debug` before the engine runs: what runs after it runs with the interpreter's caches cold."""

    __slots__ = ("_local", "_name")

    def __init__(self, local: threading.local, name: str) -> None:
        self._local = local
        self._name = name

    def __call__(self, stats: CopyStats, debug: bool) -> None:
        self._local.stats = stats
        if debug:
            log.debug("method %s: copied in %d B, out %d B; in place in %d B, out %d B", self._name,
                      stats.copied_in, stats.copied_out, stats.in_place_in, stats.in_place_out)
