"""What a benchmark script prints: plain aligned tables and the formats of their cells."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["fmt_ms", "fmt_ratio", "fmt_bytes", "mib", "print_table"]


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else (f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}")


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n:,}"



def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"



def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()
