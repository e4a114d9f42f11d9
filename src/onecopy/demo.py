"""`onecopy demo`: what onecopy buys on this machine, measured on the built-in model in about a minute.

1. program size: default vs multifunction export (code vs parameters);
2. cold vs warm load in fresh processes (specialize vs restore from the cache);
3. memory of K = 1, 2, 4, 8 programs loaded from one file, shared model off vs on (RSS and PSS growth);
4. a chained two-model frame pipeline through bound surfaces vs plain numpy I/O (bytes copied, time per frame).

Every figure is measured now, in this run; nothing is quoted from elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["run_demo", "DemoResults"]

FRAME = (1, 3, 270, 480)  # fp16 frames: 810 rows of 480 values = 960-byte rows, a dense surface


@dataclass
class DemoResults:
    sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    frames: dict[str, dict[str, float]] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)


def _memory_mib() -> dict[str, float]:
    """RSS and PSS of this process, MiB. PSS counts shared pages once per sharer: the figure for 'one copy'."""
    found = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Rss", "Pss"):
                found[key.lower()] = int(line.split()[1]) / 1024
    return found


def _child(*args: str, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "onecopy.demo", *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        raise RuntimeError(f"demo child {args[0]} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- children (fresh processes) --------------------------------------------------------------------------------


def _child_load(program: str, cache_dir: str) -> dict:
    started = time.perf_counter()
    import iree.runtime  # noqa: F401  (the engine's import: ~1 s here, paid by every runtime, cold or warm)
    import numpy as np

    import onecopy.delegate.backend  # noqa: F401  (imported on first load otherwise; imports are not loading)
    from onecopy import Runtime

    imported = time.perf_counter()
    with Runtime(cache_dir=cache_dir).load_program(program) as loaded:
        forward = loaded.load_method("forward")
        forward.execute([np.ones((1, 1024), np.float32)])
        first = time.perf_counter()
    return {"import_ms": (imported - started) * 1e3, "first_result_ms": (first - imported) * 1e3}


def _child_memory(program: str, cache_dir: str, share: bool) -> dict:
    import numpy as np

    from onecopy import Runtime
    from onecopy.delegate import quarantine

    runtime = Runtime(cache_dir=cache_dir)
    with runtime.load_program(program) as warm:  # the cache is warm; engine libraries are loaded
        warm.load_method("forward").execute([np.ones((1, 1024), np.float32)])
    quarantine.drain()  # the closed warm-up's weights are freed a moment after its close: not in the baseline
    base = _memory_mib()
    options = {"IreeBackend": {"share_multifunction_model": share}}
    programs, growth = [], {}
    for k in range(1, 9):
        program_k = runtime.load_program(program, backend_options=options)
        for name, batch in (("forward", 1), ("prefill", 16)):
            program_k.load_method(name).execute([np.ones((batch, 1024), np.float32)])
        programs.append(program_k)
        if k in (1, 2, 4, 8):
            now = _memory_mib()
            growth[k] = {"rss": now["rss"] - base["rss"], "pss": now["pss"] - base["pss"]}
    for p in programs:
        p.close()
    return growth


# -- the demo -------------------------------------------------------------------------------------------------


def _export_programs(out: Path, progress, task) -> dict[str, Path]:
    import torch

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.models import builtin_methods, builtin_model

    model = builtin_model()
    paths = {}
    for label, partitioner in (("default", Partitioner()), ("multifunction", Partitioner(multifunction=True))):
        progress.update(task, description=f"exporting the built-in model ({label})")
        paths[label] = export_program(builtin_methods(model), partitioner=partitioner,
                                      compile_spec=CompileSpec(packaging="mlir")).save(out / f"builtin-{label}.onecopy")
        progress.advance(task)

    class ScaleBias(torch.nn.Module):
        def forward(self, x):
            return x * 0.5 + 0.25

    class Gain(torch.nn.Module):
        def forward(self, x):
            return torch.clamp(x * 2.0, 0.0, 1.0)

    progress.update(task, description="exporting the frame models")
    for name, frame_model in (("scale_bias", ScaleBias()), ("gain", Gain())):
        ep = torch.export.export(frame_model, (torch.zeros(FRAME, dtype=torch.float16),))
        paths[name] = export_program({"forward": ep}, memory_planned_outputs=False).save(out / f"{name}.onecopy")
    progress.advance(task)
    return paths


def _frames(paths: dict[str, Path], cache_dir: Path, results: DemoResults) -> None:
    import numpy as np

    from onecopy import Runtime, Surface

    runtime = Runtime(cache_dir=cache_dir)
    height, width = FRAME[0] * FRAME[1] * FRAME[2], FRAME[3]
    tag = f"demo-{os.getpid()}"
    surfaces = [Surface.create(height, width, "float16", name=f"{tag}-{i}") for i in range(3)]
    try:
        src, middle, dst = surfaces
        src.array()[:] = np.random.default_rng(0).random((height, width), dtype=np.float32).astype(np.float16)
        with runtime.load_program(paths["scale_bias"]) as first, runtime.load_program(paths["gain"]) as second:
            a, b = first.load_method("forward"), second.load_method("forward")
            plain_in = np.array(src.array()).reshape(FRAME)
            plain_mid, plain_out = np.empty(FRAME, np.float16), np.empty(FRAME, np.float16)

            def copied():
                a.execute([plain_in], outputs=[plain_mid])
                b.execute([plain_mid], outputs=[plain_out])
                return a.last_copy_stats.copied + b.last_copy_stats.copied

            for s in (src, middle):
                a.bind_surface(s)
            for s in (middle, dst):
                b.bind_surface(s)
            views = [s.array().reshape(FRAME) for s in surfaces]
            # A frame loop plans each call once (Method.prepare) and reruns it on each new frame.
            first_call = a.prepare([views[0]], outputs=[views[1]])
            second_call = b.prepare([views[1]], outputs=[views[2]])

            def bound():
                first_call.run()
                second_call.run()
                return first_call.last_copy_stats.copied + second_call.last_copy_stats.copied

            timings: dict[str, list[float]] = {"copied": [], "bound": []}
            bytes_copied = {}
            for _ in range(3):  # warm-up
                copied(), bound()
            for _ in range(15):  # interleaved, so both see the same machine
                for name, fn in (("copied", copied), ("bound", bound)):
                    start = time.perf_counter()
                    bytes_copied[name] = fn()
                    timings[name].append(time.perf_counter() - start)
            expected = np.clip((plain_in.astype(np.float32) * 0.5 + 0.25) * 2.0, 0, 1)
            results.accuracy["frames"] = float(np.abs(views[2].astype(np.float32) - expected).max())
            if not np.array_equal(views[2], plain_out):
                raise RuntimeError("the bound and the copied frame pipelines disagree")
        for name, samples in timings.items():
            samples.sort()
            median = samples[len(samples) // 2]
            results.frames[name] = {"ms_per_frame": median * 1e3, "fps": 1 / median, "bytes_copied": bytes_copied[name]}
    finally:
        for s in surfaces:
            s.close()
            s.unlink()


def _report(results: DemoResults, console) -> None:
    from rich.table import Table

    table = Table(title="onecopy on this machine (built-in model: 8 x Linear(1024, 1024) + ReLU, forward [1, 1024] + prefill [16, 1024])")
    table.add_column("figure")
    table.add_column("measured", justify="right")
    table.add_column("meaning")
    mib = 2**20
    d, m = results.sizes["default"], results.sizes["multifunction"]
    table.add_row("program size, default", f"{d['file'] / mib:.2f} MiB",
                  f"code {d['code'] / mib:.3f} MiB + parameters {d['parameters'] / mib:.2f} MiB")
    table.add_row("program size, multifunction", f"{m['file'] / mib:.2f} MiB",
                  f"{m['file'] / d['file']:.3f} x default (onecopy stores weights once in both)")
    cold, warm = results.load["cold_ms"], results.load["warm_ms"]
    table.add_row("cold load -> first result", f"{cold:.0f} ms", "fresh process, empty cache: specialize for this CPU")
    table.add_row("warm load -> first result", f"{warm:.1f} ms", f"fresh process, restored from the cache: {cold / warm:.0f}x faster")
    table.add_row("python imports (each process)", f"{results.load['import_ms']:.0f} ms", "not counted above")
    for share in ("off", "on"):
        growth = results.memory[share]
        # PSS is the figure: RSS counts a page of the mapped weights once per mapping of it, so programs mapping
        # the same file pages again grow RSS without using more memory. No K=8 / K=1 ratio: over a baseline that
        # already maps the weights (the warm-up's cache entry), K=1 can grow by ~0 MiB.
        table.add_row(f"memory, 8 programs, sharing {share}",
                      f"PSS +{growth[8]['pss']:.0f} MiB",
                      f"PSS +{growth[1]['pss']:.0f} MiB at K=1; RSS +{growth[1]['rss']:.0f} MiB at K=1, "
                      f"+{growth[8]['rss']:.0f} MiB at K=8 (RSS counts each mapping of the weights again)")
    c, b = results.frames["copied"], results.frames["bound"]
    table.add_row("frame pipeline, numpy I/O", f"{c['ms_per_frame']:.2f} ms/frame",
                  f"{c['fps']:.0f} fps, {c['bytes_copied'] / mib:.1f} MiB copied per frame")
    table.add_row("frame pipeline, bound surfaces", f"{b['ms_per_frame']:.2f} ms/frame",
                  f"{b['fps']:.0f} fps, {b['bytes_copied']} bytes copied; {c['ms_per_frame'] / b['ms_per_frame']:.2f}x")
    table.add_row("accuracy vs torch eager", f"{results.accuracy['builtin']:.1e}", "max |diff|, forward and prefill")
    console.print(table)


def _plot(results: DemoResults, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from onecopy.errors import InvalidArgument

        raise InvalidArgument("--plot needs matplotlib: pip install 'onecopy[plot]'.") from e
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ks = [1, 2, 4, 8]
    for share, style in (("off", "o--"), ("on", "s-")):
        axes[0].plot(ks, [results.memory[share][k]["rss"] for k in ks], style, label=f"RSS, sharing {share}")
        axes[0].plot(ks, [results.memory[share][k]["pss"] for k in ks], style, alpha=0.5, label=f"PSS, sharing {share}")
    axes[0].set(title="memory growth for K programs", xlabel="K programs", ylabel="MiB")
    axes[0].legend()
    axes[1].bar(["cold (specialize)", "warm (restore)"], [results.load["cold_ms"], results.load["warm_ms"]])
    axes[1].set(title="load -> first result (fresh process)", ylabel="ms", yscale="log")
    axes[2].bar(["numpy I/O", "bound surfaces"], [results.frames["copied"]["ms_per_frame"], results.frames["bound"]["ms_per_frame"]])
    axes[2].set(title=f"two-model frame pipeline, fp16 {list(FRAME)}", ylabel="ms per frame")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_demo(workdir: Path | None = None, plot: Path | None = None) -> int:
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from onecopy import Runtime
    from onecopy.inspect import summarize
    from onecopy.models import builtin_model
    from onecopy.program import read_program

    console = Console()
    results = DemoResults()
    with tempfile.TemporaryDirectory(prefix="onecopy-demo-") as tmp:
        out = workdir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        cache_dir = Path(tmp) / "cache"  # the demo's own cache: cold means cold
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("exporting", total=7)
            paths = _export_programs(out, progress, task)
            for label in ("default", "multifunction"):
                loaded = read_program(paths[label])
                try:
                    summary = summarize(loaded, paths[label].stat().st_size)
                finally:
                    loaded.close()
                results.sizes[label] = {"file": summary.file_bytes, "code": summary.code_bytes,
                                        "parameters": summary.parameter_bytes}

            progress.update(task, description="cold load: specializing for this CPU in a fresh process")
            cold = _child("load", str(paths["multifunction"]), str(cache_dir))
            progress.advance(task)
            progress.update(task, description="warm load: restoring from the cache in fresh processes")
            warm = [_child("load", str(paths["multifunction"]), str(cache_dir),
                           env={"ONECOPY_FORBID_SPECIALIZE": "1"}) for _ in range(3)]
            results.load = {
                "cold_ms": cold["first_result_ms"],
                "warm_ms": sorted(w["first_result_ms"] for w in warm)[1],
                "import_ms": cold["import_ms"],
            }
            progress.advance(task)

            progress.update(task, description="memory: 1, 2, 4, 8 programs, shared model off and on")
            for share in ("off", "on"):
                growth = _child("memory", str(paths["multifunction"]), str(cache_dir), share)
                results.memory[share] = {int(k): v for k, v in growth.items()}
            progress.advance(task)

            progress.update(task, description="accuracy and the frame pipeline")
            model = builtin_model()
            worst = 0.0
            import torch

            with Runtime(cache_dir=cache_dir).load_program(paths["multifunction"]) as loaded:
                for name, batch in (("forward", 1), ("prefill", 16)):
                    x = torch.randn(batch, 1024)
                    (y,) = loaded.load_method(name).execute([x.numpy()])
                    with torch.no_grad():
                        worst = max(worst, float(np.abs(y - model(x).numpy()).max()))
            results.accuracy["builtin"] = worst
            _frames(paths, cache_dir, results)
            progress.advance(task)
        _report(results, console)
        if plot is not None:
            _plot(results, plot)
            console.print(f"figures written to {plot}")
        if workdir:
            console.print(f"programs in {out}")
    return 0 if results.accuracy["builtin"] < 1e-4 else 1


def _child_main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "load":
        print(json.dumps(_child_load(argv[1], argv[2])))
    elif kind == "memory":
        print(json.dumps(_child_memory(argv[1], argv[2], argv[3] == "on")))
    else:
        raise SystemExit(f"unknown demo child {kind!r}")


if __name__ == "__main__":
    _child_main(sys.argv[1:])
