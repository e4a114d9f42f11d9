"""Vision: ResNet-18 and MobileNetV3-small, B=1 and B=8, 3x224x224 fp32, onecopy beside ONNX Runtime, OpenVINO and
torch eager in one run; the depthwise rewrite on and off; a bound fp16 NHWC frame into ResNet-18; memory per load.

    python benchmarks/vision.py [--quick]

Models: onecopy.models.vision (torchvision's architectures and parameter counts, random weights from seed 0,
eval mode). Each model is one multifunction program with methods `b1` and `b8` (weights once).

Peers, timed side by side per model and batch (common.measure: warm-up, shuffled interleaved rounds; p50 and p90
of the calls; ratios paired within rounds, ONNX Runtime as 1.00):
- onecopy: the default export (`CompileSpec()`: the depthwise_nhwc rewrite on) and load (specialized for this CPU);
- onecopy, no rewrites: `CompileSpec(rewrites=())`, for MobileNetV3-small (ResNet-18 has no depthwise conv, so its
  program is the same either way);
- onecopy prefer=latency: `CompileSpec(delegates=("iree", "openvino"))` loaded with `prefer="latency"`: each
  method on the delegate its first load measured fastest here (`runs_on` says which); with native bf16 also
  `precision="bf16"` ("onecopy prefer=latency bf16"), the issue's bf16 target (<= 0.5 on ResNet-18);
- onnxruntime 1.32: torch.onnx.export, default CPU execution provider and threading;
- openvino fp32: `openvino.convert_model(exported program)`, `compile_model(..., "CPU",
  {"INFERENCE_PRECISION_HINT": "f32"})` (its default on AMX CPUs is bf16), default threading;
- torch eager under no_grad;
- onecopy bf16 (on CPUs with native bf16): the default export loaded with `precision="bf16"`; its error against
  onecopy fp32 (max abs, cosine) is recorded beside the others' against torch. benchmarks/vision_bf16.py is the
  short run of the bf16 rows alone.
Every peer's output is checked against torch eager before timing (max abs difference recorded).

Depthwise layers alone (B=1): the rewrite's effect on single layers (3x3 on 72 channels at 56x56, 5x5 on 240
channels at 14x14), onecopy with and without it, ONNX Runtime as 1.00.

Bound frame: the issue's use case. A camera frame is an fp16 NHWC [1, 224, 224, 3] surface (224 rows of 672 fp16,
dense); the program takes it as it is and does the cast, the transpose and the ImageNet normalization inside, then
ResNet-18. `execute` on the bound surface (no copy in) vs the ResNet-18 program's `b1` on an fp32 NCHW array (the
model alone). Target: bound frame -> logits <= 1.05x the model alone.

Memory per load (each in a fresh process): RSS and PSS growth for 1 and 4 loads of ResNet-18: OpenVINO
`compile_model` (after one `convert_model`; one inference each) vs onecopy `load_program` of the specialized
program (restored from the cache; one call each).

Exports use `check_compiles=False`: the first load compiles the same module, so compiling at export too would only
double this script's time; it changes nothing that is measured. The results also say how this machine
specialized each program (`specializations`: the configuration tuning kept and every candidate's latency, each
function's figures on both CPU executors) and what ran each method (`runs_on`). Results:
benchmarks/results/vision.json and vision.md. On a shared machine the times move by tens of percent: compare the ratios of one run.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import common

BATCHES = (1, 8)
MODELS = ("resnet18", "mobilenet_v3_small")
DEPTHWISE_LAYERS = {"dw3x3 c72 56x56": (72, 3, 56), "dw5x5 c240 14x14": (240, 5, 14)}
FRAME_SHAPE = (1, 224, 224, 3)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TARGET_FRAME_OVER_MODEL = 1.05


class OpenVino:
    """OpenVINO fp32 on the CPU plugin, default threading, one infer request reused."""

    name = "openvino fp32"

    def __init__(self, model, example):
        import openvino as ov
        import torch

        ep = torch.export.export(model, (torch.from_numpy(example),))
        self.compiled = ov.Core().compile_model(ov.convert_model(ep), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        self.request = self.compiled.create_infer_request()

    def __call__(self, x):
        self.request.infer({0: x})
        return self.request.get_output_tensor(0).data


def build(name: str):
    from onecopy.models import vision

    return getattr(vision, name)()


def frame_model(resnet):
    """fp16 NHWC frame -> ResNet-18 logits, the normalization inside the program."""
    import torch

    class FrameResNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = resnet
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1))

        def forward(self, frame):
            x = frame.float().permute(0, 3, 1, 2)
            return self.model((x - self.mean) / self.std)

    return FrameResNet().eval()


def export(methods: dict, path: Path, **spec) -> Path:
    import torch

    from onecopy.export import CompileSpec, Partitioner, export_program

    eps = {name: torch.export.export(model, (torch.from_numpy(x),)) for name, (model, x) in methods.items()}
    export_program(eps, partitioner=Partitioner(multifunction=len(eps) > 1),
                   compile_spec=CompileSpec(check_compiles=False, **spec)).save(path)
    return path


def check(peers: dict, want, x) -> dict[str, str]:
    # As text: the results file rounds floats to 6 decimals, which would write these (~1e-7) as 0.
    return {name: f"{common.max_abs_diff(fn(x), want):.2e}" for name, fn in peers.items()}


def rounds(quick: bool) -> dict:
    """`common.measure`'s settings. No round is thrown away for other processes' CPU (busy_threshold=1): on the
    shared machine this was written on nearly every round would be, doubling a run of tens of minutes; the share
    of the CPUs others took is recorded instead. A quick run is a smoke run: a few rounds of one call."""
    return {"busy_threshold": 1.0, **({"min_rounds": 4, "warmup": 2, "min_inner": 1} if quick else {})}


def timed(peers: dict, x, budget: float, reference: str, settings: dict) -> dict:
    stats = common.measure({name: (lambda fn=fn: fn(x)) for name, fn in peers.items()}, budget_s=budget, **settings)
    ref = stats[reference]
    return {name: {"p50_ms": s.median_ms, "p90_ms": s.p90_ms, "calls": s.calls, "rounds": s.rounds,
                   "rounds_discarded": s.rounds_discarded,
                   "ratio_to_ort": common.paired_ratio(s, ref), "ratio_of_medians": s.median_ms / ref.median_ms,
                   "interval_95": common.paired_interval(s, ref) if name != reference else None}
            for name, s in stats.items()}


def print_rows(title: str, results: dict) -> None:
    rows = [[name, common.fmt_ms(r["p50_ms"]), common.fmt_ms(r["p90_ms"]), common.fmt_ratio(r["ratio_to_ort"])]
            for name, r in results.items()]
    common.print_table(["peer", "p50 ms", "p90 ms", "/ ORT"], rows, title=title)


def memory_child(engine: str, path: str, cache_dir: str, loads: int) -> None:
    """In a fresh process: RSS/PSS growth of each of `loads` loads of ResNet-18 (printed as JSON)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    keep = []
    if engine == "openvino":
        import openvino as ov
        import torch

        core = ov.Core()
        model = ov.convert_model(torch.export.export(build("resnet18"), (torch.from_numpy(x),)))

        def load():
            compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
            compiled.create_infer_request().infer({0: x})
            return compiled
    else:
        from onecopy import Runtime

        runtime = Runtime(cache_dir=cache_dir)

        def load():
            program = runtime.load_program(path)
            program.load_method("b1").execute([x])
            return program
    base = common.smaps_rollup()
    growth = []
    for _ in range(loads):
        keep.append(load())
        now = common.smaps_rollup()
        growth.append({"rss": now["Rss"] - base["Rss"], "pss": now["Pss"] - base["Pss"]})
    print("MEMORY " + json.dumps(growth))


def memory(path: Path, cache_dir: Path, loads: int) -> dict:
    found = {}
    for engine in ("openvino", "onecopy"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", engine, str(path), str(cache_dir), str(loads)],
                             capture_output=True, text=True, timeout=900)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MEMORY ")), None)
        if line is None:
            raise SystemExit(f"memory child ({engine}) failed:\n{out.stderr[-2000:]}")
        found[engine] = json.loads(line.removeprefix("MEMORY "))
    return found


def markdown(machine: dict, payload: dict) -> str:
    quick = " (a --quick smoke run: a few rounds of one call per peer)" if payload["quick"] else ""
    lines = [f"# Vision benchmark ({payload['date']}){quick}", "",
             f"CPU: {machine['cpu_model']}, {machine['usable_cpus']} usable of {machine['logical_cpus']} logical CPUs "
             f"({', '.join(machine['cpu_flags'])}). Other processes used {payload['other_cpu']:.0%} of the CPUs "
             "during the run: a contended machine moves times by tens of percent; compare ratios within the run.",
             "", "Ratios to ONNX Runtime (paired within rounds); p50 / p90 in ms.", "",
             "| model | B | peer | p50 ms | p90 ms | / ORT |", "|---|---|---|---|---|---|"]
    for key, results in payload["models"].items():
        model, batch = key.rsplit(" B=", 1)
        for peer, r in results["timings"].items():
            lines.append(f"| {model} | {batch} | {peer} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['ratio_to_ort']:.2f} |")
    lines += ["", "Depthwise layers alone (B=1):", "", "| layer | peer | p50 ms | / ORT |", "|---|---|---|---|"]
    for layer, results in payload["depthwise_layers"].items():
        for peer, r in results.items():
            lines.append(f"| {layer} | {peer} | {r['p50_ms']:.3f} | {r['ratio_to_ort']:.2f} |")
    frame = payload["bound_frame"]
    loads = len(next(iter(payload["memory"].values())))
    lines += ["", f"Bound fp16 NHWC frame -> ResNet-18 logits: {frame['ratio']:.3f}x the model alone "
              f"(target <= {TARGET_FRAME_OVER_MODEL}); copied in per call: {frame['copy_stats']['copied_in']} B.", "",
              "Memory growth per load of ResNet-18 (MiB, fresh process each):", "",
              f"| engine | RSS 1 load | RSS {loads} loads | PSS 1 load | PSS {loads} loads |", "|---|---|---|---|---|"]
    for engine, growth in payload["memory"].items():
        lines.append(f"| {engine} | {common.mib(growth[0]['rss'])} | {common.mib(growth[-1]['rss'])} | "
                     f"{common.mib(growth[0]['pss'])} | {common.mib(growth[-1]['pss'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        engine, path, cache_dir, loads = sys.argv[2:6]
        memory_child(engine, path, cache_dir, int(loads))
        return 0
    run = common.BenchmarkRun("vision", __doc__)
    import numpy as np
    import torch

    from onecopy import Runtime, Surface

    from onecopy.delegate.precision import native_bf16_flags
    from onecopy.delegate.targets import cpu_flags

    machine = run.describe_machine()
    native_bf16 = any(flag in cpu_flags() for flag in native_bf16_flags())
    budget = 1.5 if run.quick else 8.0
    settings = rounds(run.quick)
    rng = np.random.default_rng(0)
    payload: dict = {"models": {}, "depthwise_layers": {}, "openvino_version": importlib.metadata.version("openvino")}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(common.temp_workdir("vision"))
        cache_dir = stack.enter_context(common.isolated_cache(work / "cache"))
        runtime = Runtime(cache_dir=cache_dir)
        inputs = {b: rng.standard_normal((b, 3, 224, 224), dtype=np.float32) for b in BATCHES}
        programs = {}
        for name in MODELS:
            model = build(name)
            methods = {f"b{b}": (model, inputs[b]) for b in BATCHES}
            variants = {"onecopy": {}, "onecopy prefer=latency": {"delegates": ("iree", "openvino")}}
            if name != "resnet18":
                variants["onecopy, no rewrites"] = {"rewrites": ()}
            loaded = {}
            for i, (peer, spec) in enumerate(variants.items()):
                prefer = "latency" if "delegates" in spec else "memory"
                with common.Stopwatch() as exporting:
                    path = export(methods, work / f"{name}{i}.onecopy", **spec)
                with common.Stopwatch() as specializing:  # the first method loaded compiles the module
                    program = stack.enter_context(runtime.load_program(path, prefer=prefer))
                    program.load_method("b1")
                print(f"{name} ({peer}): export {exporting.seconds:.1f} s, first load (specialize) "
                      f"{specializing.seconds:.1f} s")
                payload.setdefault("export_and_specialize_s", {})[f"{name} ({peer})"] = {
                    "export": exporting.seconds, "specialize": specializing.seconds}
                programs[(name, peer)] = path
                loaded[peer] = program
            if native_bf16:  # the default export again, specialized in bf16 (onecopy's precision="bf16")
                program = stack.enter_context(runtime.load_program(programs[(name, "onecopy")], precision="bf16"))
                program.load_method("b1")
                loaded["onecopy bf16"] = program
                program = stack.enter_context(runtime.load_program(
                    programs[(name, "onecopy prefer=latency")], precision="bf16", prefer="latency"))
                program.load_method("b1")
                loaded["onecopy prefer=latency bf16"] = program
            for peer in variants:  # what tuning kept and each function's executor figures, per precision
                payload.setdefault("specializations", {})[f"{name} ({peer})"] = common.specializations(
                    programs[(name, peer)], cache_dir)
            for b in BATCHES:
                x = inputs[b]
                peers = {peer: common.OnecopyMethod(p.load_method(f"b{b}")) for peer, p in loaded.items()}
                peers["onnxruntime"] = common.OnnxRuntime(model, x, work / f"{name}_b{b}.onnx")
                peers["openvino fp32"] = OpenVino(model, x)
                peers["torch eager"] = common.TorchEager(model)
                with torch.no_grad():
                    want = model(torch.from_numpy(x)).numpy()
                errors = check(peers, want, x)
                for peer in ("onecopy bf16", "onecopy prefer=latency bf16"):
                    if peer in peers:
                        bf16, fp32 = np.asarray(peers[peer](x)).ravel(), np.asarray(peers["onecopy"](x)).ravel()
                        errors[f"{peer} vs onecopy fp32"] = (
                            f"{np.max(np.abs(bf16 - fp32)):.2e}, cosine {bf16 @ fp32 / np.linalg.norm(bf16) / np.linalg.norm(fp32):.6f}")
                payload.setdefault("runs_on", {})[f"{name} B={b}"] = {
                    peer: "; ".join(p.load_method(f"b{b}").runs_on.values()) for peer, p in loaded.items()}
                print(f"{name} B={b}: timing {', '.join(peers)}", flush=True)
                timings = timed(peers, x, budget, "onnxruntime", settings)
                payload["models"][f"{name} B={b}"] = {"timings": timings, "max_abs_error": errors}
                print_rows(f"{name} B={b}", timings)

        for layer, (channels, kernel, size) in DEPTHWISE_LAYERS.items():
            torch.manual_seed(0)
            conv = torch.nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels).eval()
            x = rng.standard_normal((1, channels, size, size), dtype=np.float32)
            peers = {}
            for peer, spec in {"onecopy": {}, "onecopy, no rewrites": {"rewrites": ()}}.items():
                path = export({"forward": (conv, x)}, work / f"dw{kernel}{len(spec)}.onecopy", **spec)
                peers[peer] = common.OnecopyMethod(stack.enter_context(runtime.load_program(path)).load_method("forward"))
            peers["onnxruntime"] = common.OnnxRuntime(conv, x, work / f"dw{kernel}.onnx")
            timings = timed(peers, x, budget / 2, "onnxruntime", settings)
            payload["depthwise_layers"][layer] = timings
            print_rows(layer, timings)

        resnet = build("resnet18")
        frame = (rng.uniform(0, 1, FRAME_SHAPE)).astype(np.float16)
        frame_path = export({"forward": (frame_model(resnet), frame)}, work / "frame_resnet18.onecopy")
        frame_method = stack.enter_context(runtime.load_program(frame_path)).load_method("forward")
        surface = stack.enter_context(Surface.create(FRAME_SHAPE[1], FRAME_SHAPE[2] * FRAME_SHAPE[3], "float16"))
        frame_method.bind_surface(surface)
        view = surface.array().reshape(FRAME_SHAPE)
        view[...] = frame
        alone = stack.enter_context(runtime.load_program(programs[("resnet18", "onecopy")])).load_method("b1")
        normalized = ((frame.astype(np.float32).transpose(0, 3, 1, 2) - np.reshape(IMAGENET_MEAN, (1, 3, 1, 1)))
                      / np.reshape(IMAGENET_STD, (1, 3, 1, 1))).astype(np.float32)
        (got,) = frame_method.execute([view])
        copy_stats = frame_method.last_copy_stats
        with torch.no_grad():
            want = resnet(torch.from_numpy(normalized)).numpy()
        stats = common.measure({"bound frame -> logits": lambda: frame_method.execute([view]),
                                "model alone (fp32 NCHW)": lambda: alone.execute([normalized])}, budget_s=budget,
                               **settings)
        ratio = common.paired_ratio(stats["bound frame -> logits"], stats["model alone (fp32 NCHW)"])
        interval = common.paired_interval(stats["bound frame -> logits"], stats["model alone (fp32 NCHW)"])
        payload["bound_frame"] = {
            "ratio": ratio, "interval_95": interval,
            "timings": {k: {"p50_ms": s.median_ms, "p90_ms": s.p90_ms} for k, s in stats.items()},
            "max_abs_error": f"{common.max_abs_diff(got, want):.2e}",  # as text: see `check`
            "copy_stats": {f: getattr(copy_stats, f) for f in ("copied_in", "copied_out", "in_place_in", "in_place_out")},
            "target": common.target("bound frame / model alone", ratio, "<=", TARGET_FRAME_OVER_MODEL,
                                    interval=interval),
        }
        print(f"\nbound frame -> logits / model alone: {ratio:.3f} (target <= {TARGET_FRAME_OVER_MODEL}); "
              f"{payload['bound_frame']['copy_stats']}")

        loads = 2 if run.quick else 4
        payload["memory"] = memory(programs[("resnet18", "onecopy")], cache_dir, loads)
        for engine, growth in payload["memory"].items():
            print(f"{engine}: RSS +{common.mib(growth[0]['rss'])} MiB for 1 load, +{common.mib(growth[-1]['rss'])} "
                  f"for {loads}; PSS +{common.mib(growth[0]['pss'])} / +{common.mib(growth[-1]['pss'])}")
    path = run.write(payload)
    document = json.loads(path.read_text())
    summary = {**payload, "date": document["date"], "quick": run.quick, "other_cpu": (document["other_processes_cpu"] or {}).get("fraction", 0.0)}
    path.with_suffix(".md").write_text(markdown(machine, summary))
    print(f"wrote {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
