"""One run of `onecopy demo`: every measurement in order, in one temporary directory removed at the end, on an
error and on Ctrl-C (SIGTERM too); then the figures as JSON, or as the table and the picture."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from onecopy.demo.config import FRAME, FULL, PLOT_HINT, DemoConfig
from onecopy.demo.llm_rows import measure_llm_rows
from onecopy.demo.peers import export_onnx, onnx_bytes, onnxruntime_missing, tiny_onnx
from onecopy.demo.progress import Steps
from onecopy.demo.workloads import frame_models, measure_frames, measure_latency, measure_load, measure_memory

__all__ = ["measure", "run_demo"]


def _machine() -> dict[str, Any]:
    import importlib.metadata

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("model name", "Hardware")):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("onecopy", "torch", "iree-base-runtime", "onnxruntime", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu_model": model, "cores": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "machine": platform.machine(), "python": platform.python_version(), "versions": versions}


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _interrupts() -> Iterator[Callable[[], None]]:
    """Ctrl-C (SIGINT) and SIGTERM end the demo through the finally blocks that remove what it made: each raises
    KeyboardInterrupt where the main thread is. A SIGINT the demo was started ignoring (a background job, or a
    parent that ignores it: the child inherits SIG_IGN, and Python then installs no handler) stays ignored. A raise
    inside a finalizer (a `__del__`, a weakref callback) is printed and dropped by CPython, so each signal is also
    recorded, and the check this yields (called at every step) raises it again."""
    received: list[int] = []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def check() -> None:
        if received:
            raise KeyboardInterrupt

    handled = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    try:
        previous = {signum: signal.signal(signum, interrupt) for signum in handled}
    except ValueError:  # not the main thread: leave signals alone
        yield lambda: None
        return
    try:
        yield check
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def measure(config: DemoConfig = FULL, *, workdir: Path | None = None, console=None) -> dict[str, Any]:
    """Run every measurement and return the figures (what `--json` prints)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.inspect import summarize
    from onecopy.models import METHOD_BATCH, WIDTH, builtin_methods, builtin_model
    from onecopy.program import read_program

    started = time.perf_counter()
    console = console or Console(stderr=True)
    missing = onnxruntime_missing()
    ort_ok = missing is None
    figures: dict[str, Any] = {
        "machine": _machine(),
        "model": f"8 x Linear({WIDTH}, {WIDTH}) + ReLU, fp32; methods "
                 + ", ".join(f"{n} [{b}, {WIDTH}]" for n, b in METHOD_BATCH.items()),
        "config": dataclasses.asdict(config),
        "onnxruntime": "measured" if ort_ok else missing,
    }
    with contextlib.ExitStack() as stack:
        check_interrupt = stack.enter_context(_interrupts())
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="onecopy-demo-")))
        # Files the engines leave in the temporary directory (ONNX Runtime a telemetry session file on import, torch
        # its compile caches) go into ours, in this process and its children.
        (tmp / "tmp").mkdir()
        stack.enter_context(_environ("TMPDIR", str(tmp / "tmp")))
        stack.enter_context(_environ("TORCHINDUCTOR_CACHE_DIR", str(tmp / "torch")))
        import torch

        out = workdir or tmp
        out.mkdir(parents=True, exist_ok=True)
        cache_dir = tmp / "cache"  # the demo's own cache: cold means cold, and the user's cache is left alone
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        progress = stack.enter_context(Progress(*columns, console=console, transient=True))
        steps = Steps(progress, 10 + len(config.ks) * (3 if ort_ok else 2) + len(METHOD_BATCH),
                      check_interrupt)

        steps.start("exporting the built-in model and two frame models")
        model = builtin_model()
        paths: dict[str, Path] = {}
        exported = builtin_methods(model)
        paths["onecopy"] = export_program(exported, partitioner=Partitioner(multifunction=True),
                                          compile_spec=CompileSpec(packaging="mlir")).save(out / "builtin.onecopy")
        pipeline = frame_models()
        for name, frame_model in pipeline.items():
            exported[name] = torch.export.export(frame_model, (torch.zeros(FRAME, dtype=torch.float16),))
            paths[name] = export_program({"forward": exported[name]},
                                         memory_planned_outputs=False).save(out / f"{name}.onecopy")
        loaded = read_program(paths["onecopy"])
        try:
            summary = summarize(loaded, paths["onecopy"].stat().st_size)
        finally:
            loaded.close()
        figures["size_bytes"] = {"onecopy": {"file": summary.file_bytes, "code": summary.code_bytes,
                                             "parameters": summary.parameter_bytes}}
        steps.done()

        steps.start("exporting ONNX files for ONNX Runtime (torch.onnx)")
        if ort_ok:
            onnx_dir = out / "onnx"
            onnx_dir.mkdir(exist_ok=True)
            for name, batch in METHOD_BATCH.items():
                paths[f"onnx_{name}"] = export_onnx(model, torch.zeros(batch, WIDTH), onnx_dir / f"{name}.onnx",
                                                     exported[name])
            for name, frame_model in pipeline.items():
                paths[f"onnx_{name}"] = export_onnx(frame_model, torch.zeros(FRAME, dtype=torch.float16),
                                                     onnx_dir / f"{name}.onnx", exported[name])
            paths["onnx_tiny"] = tiny_onnx(onnx_dir / "tiny.onnx")
            per_method = {name: onnx_bytes(paths[f"onnx_{name}"]) for name in METHOD_BATCH}
            figures["size_bytes"]["onnxruntime"] = {**per_method, "total": sum(per_method.values())}
        steps.done()

        figures["load_ms"] = measure_load(paths, cache_dir, config, ort_ok, steps)
        # Before the parent loads anything: a page this process mapped would take a share of a child's PSS.
        figures["memory_mib"] = measure_memory(paths, cache_dir, config, ort_ok, steps)
        figures["latency_ms"], figures["max_abs_diff_vs_torch"] = measure_latency(
            paths, cache_dir, model, config, ort_ok, steps)
        steps.start("frames: a two-model fp16 pipeline, bound surfaces vs numpy I/O vs ONNX Runtime IOBinding")
        figures["frames"] = measure_frames(paths, cache_dir, config, ort_ok)
        steps.done()
        figures["llm"] = measure_llm_rows(out, cache_dir, config, steps, console)
        steps.start("done")
        figures["seconds_by_step"] = steps.seconds
        if workdir:
            figures["workdir"] = str(out)
    figures["duration_s"] = time.perf_counter() - started
    # Other processes' work slows every figure here (the ratios less): a load average above the CPU count says so.
    figures["load_average_at_end"] = list(os.getloadavg())
    return figures


def run_demo(workdir: Path | None = None, plot: Path | None = None, *, as_json: bool = False,
             config: DemoConfig = FULL) -> int:
    from rich.console import Console

    from onecopy.demo.report import draw, print_table

    console = Console(stderr=as_json)
    if not console.is_terminal:  # piped or captured: rich would wrap the table at 80 columns; no terminal to fit
        console = Console(stderr=as_json, width=112)
    figures = measure(config, workdir=workdir, console=Console(stderr=True))
    if as_json:
        print(json.dumps(figures, indent=2))
    else:
        print_table(figures, console)
    if plot is not None:
        try:
            draw(figures, plot)
            console.print(f"picture written to {plot.resolve()}", markup=False, highlight=False)
        except ImportError:
            console.print(f"no picture: matplotlib is not installed. For the picture: {PLOT_HINT}.", markup=False,
                          highlight=False)
    accurate = figures["max_abs_diff_vs_torch"].get("onecopy", 1.0) < 1e-4
    return 0 if accurate else 1
