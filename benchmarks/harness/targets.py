"""The targets of the issues a benchmark checks: each one measured, compared with its threshold, and said unresolved
when the run's interval holds the threshold."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.tables import print_table

__all__ = ["target", "TARGET_COLUMNS", "target_row", "print_targets"]


def target(name: str, value: float | None, op: str, threshold: float, note: str = "",
           interval: tuple[float, float] | None = None) -> dict[str, Any]:
    """One target of the issue and whether this run met it. `op` is '<=' or '>='. `interval` (`paired_interval`):
    when it contains the threshold, the run did not resolve the target either way, and the verdict says so."""
    if value is None:
        met = None
    elif op == "<=":
        met = value <= threshold
    elif op == ">=":
        met = value >= threshold
    else:
        raise ValueError(op)
    entry = {"name": name, "value": value, "op": op, "threshold": threshold, "met": met}
    if interval is not None:
        entry["interval_95"] = [interval[0], interval[1]]
        entry["resolved"] = not interval[0] <= threshold <= interval[1]
    if note:
        entry["note"] = note
    return entry


TARGET_COLUMNS = ["target", "measured", "95% interval", "wanted", "verdict"]


def target_row(t: Mapping[str, Any]) -> list[str]:
    """A target as a table row (TARGET_COLUMNS)."""
    value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
    if t.get("resolved") is False:
        verdict += " (unresolved)"
    interval = t.get("interval_95")
    spread = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "-"
    return [t["name"], value, spread, f"{t['op']} {t['threshold']}", verdict]


def print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    print_table(TARGET_COLUMNS, [target_row(t) for t in targets], title="targets")
