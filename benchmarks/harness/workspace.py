"""Where a benchmark works and what it runs: a temporary directory, a specialization cache of its own (the
user's is never touched), onecopy's cache entries and load states, and other benchmark scripts run in fresh
interpreters."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["temp_workdir", "isolated_cache", "cache_entries", "collect_load_states", "run_script"]


@contextlib.contextmanager
def temp_workdir(prefix: str) -> Iterator[Path]:
    """A temporary directory, removed afterwards. Program files and caches of a run live here."""
    path = Path(tempfile.mkdtemp(prefix=f"onecopy-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def isolated_cache(directory: Path) -> Iterator[Path]:
    """Point ONECOPY_CACHE_DIR at `directory` for the duration, so nothing touches the user's cache even where a
    Runtime is created without cache_dir (scripts pass Runtime(cache_dir=...) as well)."""
    directory.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("ONECOPY_CACHE_DIR")
    os.environ["ONECOPY_CACHE_DIR"] = str(directory)
    try:
        yield directory
    finally:
        if old is None:
            os.environ.pop("ONECOPY_CACHE_DIR", None)
        else:
            os.environ["ONECOPY_CACHE_DIR"] = old


def cache_entries(cache_dir: Path) -> set[str]:
    """Keys of the specialization cache entries in `cache_dir` (layout: <dir>/v1/entries/<key>/module.vmfb)."""
    entries = cache_dir / "v1" / "entries"
    return {p.name for p in entries.iterdir() if (p / "module.vmfb").exists()} if entries.exists() else set()


def specializations(path: Path, cache_dir: Path) -> dict[str, dict[str, str]]:
    """How this machine specialized the program at `path` (from its cache entries), per precision: the
    configuration tuning kept, with each candidate's latency, each function's figures on both CPU executors
    (what a load picked from), and the precision its code runs in. The reason a ratio is what it is."""
    from onecopy.delegate.executors import describe
    from onecopy.inspect import describe_tuning, specializations as entries_of
    from onecopy.program import read_program

    loaded = read_program(path)
    try:
        hashes = [d.manifest["export_hash"] for d in loaded.definition.delegates if "export_hash" in d.manifest]
    finally:
        loaded.close()
    # runs_in: the precision the code runs in (precision="bf16" runs fp32 where tuning measured fp32 faster).
    return {entry.precision: {"tuning": describe_tuning(entry.tuning), "executors": describe(entry.executors),
                              "runs_in": (entry.tuning or {}).get("chosen_precision", entry.precision)}
            for entries in entries_of(hashes, cache_dir).values() for entry in entries}


def collect_load_states() -> list[str]:
    """Load states ('specialized' / 'restored') from onecopy's log, one per delegate load."""
    import logging

    states: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            for state in ("specialized", "restored"):
                if f" {state} " in message:
                    states.append(state)

    logger = logging.getLogger("onecopy")
    logger.setLevel(logging.INFO)
    logger.addHandler(Collect())
    return states


def run_script(script: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> in a fresh interpreter (the same Python)."""
    return subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / script), *args],
                          env={**os.environ, **(env or {})}, timeout=timeout)
