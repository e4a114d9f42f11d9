"""The demo's workloads on the built-in model, each measured beside its peers: time to first result and memory
(fresh processes), latency per call, and a chained two-model frame pipeline on bound surfaces."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onecopy.demo.children import run_child
from onecopy.demo.config import FRAME, DemoConfig
from onecopy.demo.progress import Steps

__all__ = ["frame_models", "measure_load", "measure_memory", "measure_latency", "measure_frames"]


def frame_models():
    import torch

    class ScaleBias(torch.nn.Module):
        def forward(self, x):
            return x * 0.5 + 0.25

    class Gain(torch.nn.Module):
        def forward(self, x):
            return torch.clamp(x * 2.0, 0.0, 1.0)

    return {"scale_bias": ScaleBias(), "gain": Gain()}


def measure_load(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool, steps: Steps) -> dict:
    steps.start("cold load: a fresh process specializes the program for this CPU")
    cold = run_child("load-onecopy", str(paths["onecopy"]), str(cache_dir))
    steps.done()
    steps.start("warm loads: fresh processes restore it from the cache")
    warm = [run_child("load-onecopy", str(paths["onecopy"]), str(cache_dir), env={"ONECOPY_FORBID_SPECIALIZE": "1"})
            for _ in range(config.warm_loads)]
    load = {"onecopy": {"import_ms": statistics.median([w["import_ms"] for w in warm]),
                        "cold_ms": cold["first_result_ms"],
                        "warm_ms": statistics.median([w["first_result_ms"] for w in warm])}}
    steps.done()
    if ort_ok:
        steps.start("ONNX Runtime sessions in fresh processes")
        runs = [run_child("load-ort", str(paths["onnx_forward"])) for _ in range(config.warm_loads)]
        load["onnxruntime"] = {"import_ms": statistics.median([r["import_ms"] for r in runs]),
                               "first_result_ms": statistics.median([r["first_result_ms"] for r in runs])}
    steps.done()
    return load


def measure_memory(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool,
                   steps: Steps) -> dict:
    """Each (engine, K) in its own fresh process, one after the other: a process mapping the same pages at the
    same time would take a share of their PSS."""
    memory: dict[str, dict[str, dict[str, float]]] = {"onecopy_shared": {}, "onecopy_unshared": {}}
    if ort_ok:
        memory["onnxruntime"] = {}
    for k in config.ks:
        for engine in memory:
            steps.start(f"memory: {k} load{'s' if k > 1 else ''}, {engine.replace('_', ' ')} (fresh process)")
            if engine == "onnxruntime":
                growth = run_child("memory-ort", str(paths["onnx_forward"]), str(paths["onnx_tiny"]), str(k))
            else:
                share = "on" if engine == "onecopy_shared" else "off"
                growth = run_child("memory-onecopy", str(paths["onecopy"]), str(cache_dir), share, str(k),
                                env={"ONECOPY_FORBID_SPECIALIZE": "1"})
            memory[engine][str(k)] = growth
            steps.done()
    return memory


def measure_latency(paths: dict[str, Path], cache_dir: Path, model, config: DemoConfig, ort_ok: bool,
                    steps: Steps) -> tuple[dict, dict]:
    import numpy as np
    import torch

    from onecopy import Runtime
    from onecopy.measure import interleaved, paired_ratio
    from onecopy.models import METHOD_BATCH, WIDTH

    rng = np.random.default_rng(0)
    latency, accuracy = {}, {}
    sessions = {}
    if ort_ok:
        import onnxruntime as ort

        sessions = {name: ort.InferenceSession(str(paths[f"onnx_{name}"]), providers=["CPUExecutionProvider"])
                    for name in METHOD_BATCH}
    with Runtime(cache_dir=cache_dir).load_program(paths["onecopy"]) as program:
        for name, batch in METHOD_BATCH.items():
            steps.start(f"latency, {name} B={batch}: onecopy, ONNX Runtime, torch eager in interleaved rounds")
            x = rng.standard_normal((batch, WIDTH), dtype=np.float32)
            method = program.load_method(name)
            peers: dict[str, Callable[[], Any]] = {"onecopy": lambda m=method, x=x: m.execute([x])}
            if name in sessions:
                peers["onnxruntime"] = lambda s=sessions[name], x=x: s.run(None, {"x": x})

            def eager(x=x):
                with torch.no_grad():
                    return model(torch.from_numpy(x))

            peers["torch"] = eager
            expected = eager().numpy()
            for engine in ("onecopy", "onnxruntime"):
                if engine in peers:
                    got = np.asarray(peers[engine]()[0])
                    accuracy[engine] = max(accuracy.get(engine, 0.0), float(np.abs(got - expected).max()))
            start = time.perf_counter()
            for fn in peers.values():
                fn()
            # about 50 ms (quick: 15) per peer per round, at least 2 calls: B=16 takes many times B=1
            each = (time.perf_counter() - start) / len(peers)
            inner = max(2, min(10, int(config.latency_block_s / max(each, 1e-6))))
            timings = interleaved(peers, rounds=config.latency_rounds, inner=inner)
            latency[f"B={batch}"] = {
                "method": name,
                "ms": {engine: t.median_ms for engine, t in timings.items()},
                "onecopy_over": {engine: paired_ratio(timings["onecopy"], t)
                                 for engine, t in timings.items() if engine != "onecopy"},
            }
            steps.done()
    return latency, accuracy


def measure_frames(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool) -> dict:
    import numpy as np

    from onecopy import Runtime, Surface
    from onecopy.measure import interleaved, paired_ratio

    runtime = Runtime(cache_dir=cache_dir)
    height, width = FRAME[0] * FRAME[1] * FRAME[2], FRAME[3]
    tag = f"onecopy-demo-{os.getpid()}"
    surfaces = []
    try:
        for i in range(3):
            surfaces.append(Surface.create(height, width, "float16", name=f"{tag}-{i}"))
        src, middle, dst = surfaces
        src.array()[:] = np.random.default_rng(0).random((height, width), dtype=np.float32).astype(np.float16)
        with runtime.load_program(paths["scale_bias"]) as first, runtime.load_program(paths["gain"]) as second:
            a, b = first.load_method("forward"), second.load_method("forward")
            plain_in = np.array(src.array()).reshape(FRAME)
            plain_mid, plain_out = np.empty(FRAME, np.float16), np.empty(FRAME, np.float16)
            copied_bytes = {}

            def numpy_io():
                a.execute([plain_in], outputs=[plain_mid])
                b.execute([plain_mid], outputs=[plain_out])
                copied_bytes["onecopy_numpy"] = a.last_copy_stats.copied + b.last_copy_stats.copied

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
                copied_bytes["onecopy_bound"] = first_call.last_copy_stats.copied + second_call.last_copy_stats.copied

            peers: dict[str, Callable[[], Any]] = {"onecopy_bound": bound, "onecopy_numpy": numpy_io}
            ort_out = None
            if ort_ok:
                import onnxruntime as ort

                # ONNX Runtime's best for a frame loop: IOBinding to preallocated arrays, bound once.
                ort_mid, ort_out = np.empty(FRAME, np.float16), np.empty(FRAME, np.float16)
                runs = []
                for key, x, y in (("onnx_scale_bias", plain_in, ort_mid), ("onnx_gain", ort_mid, ort_out)):
                    session = ort.InferenceSession(str(paths[key]), providers=["CPUExecutionProvider"])
                    binding = session.io_binding()
                    binding.bind_input("x", "cpu", 0, np.float16, list(FRAME), x.ctypes.data)
                    binding.bind_output("y", "cpu", 0, np.float16, list(FRAME), y.ctypes.data)
                    runs.append(lambda s=session, io=binding: s.run_with_iobinding(io))
                peers["onnxruntime_iobinding"] = lambda: (runs[0](), runs[1]())
            timings = interleaved(peers, rounds=config.frame_rounds, inner=5)
            expected = np.clip((plain_in.astype(np.float32) * 0.5 + 0.25) * 2.0, 0, 1)
            accuracy = float(np.abs(views[2].astype(np.float32) - expected).max())
            if not np.array_equal(views[2], plain_out):
                raise RuntimeError("the bound and the copied frame pipelines disagree")
            if ort_out is not None:
                accuracy = max(accuracy, float(np.abs(ort_out.astype(np.float32) - expected).max()))
    finally:
        for s in surfaces:
            s.close()
            s.unlink()
    return {
        "frame": list(FRAME), "dtype": "float16",
        "ms_per_frame": {peer: t.median_ms for peer, t in timings.items()},
        "bytes_copied_per_frame": copied_bytes,
        "onecopy_bound_over": {peer: paired_ratio(timings["onecopy_bound"], t)
                               for peer, t in timings.items() if peer != "onecopy_bound"},
        "max_abs_diff_vs_float32": accuracy,
    }
