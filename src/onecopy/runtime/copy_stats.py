"""How many bytes a call copied into and out of the engine, and how many it used in place (bound surfaces).

`Method.last_copy_stats` holds the last call's figures (per thread), so a user can verify zero-copy:

    forward.bind_surface(frame)
    forward.execute([frame.array()], outputs=[result.array()])
    assert forward.last_copy_stats.copied == 0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CopyStats"]


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
