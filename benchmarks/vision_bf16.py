"""Vision in bf16: ResNet-18 and MobileNetV3-small at B=1, onecopy `precision="bf16"` beside onecopy fp32, ONNX
Runtime fp32 and OpenVINO bf16 in one run, with each bf16 answer's error against fp32.

    python benchmarks/vision_bf16.py [--quick]

The issue's target (#22): onecopy bf16 / ONNX Runtime fp32 <= 0.5 on ResNet-18 on a CPU with native bf16, on
whichever delegate wins, logits' cosine similarity to fp32 >= 0.999. Programs are exported as in
benchmarks/vision.py (its models and helpers) and loaded twice, `precision="fp32"` and `precision="bf16"` (each
specialized, tuned, for this CPU): IREE, one copy of the weights in memory. The same model exported with
`CompileSpec(delegates=("iree", "openvino"))` is loaded a third time with `prefer="latency", precision="bf16"`: the
delegate its first load measured fastest in bf16 (`onecopy bf16 latency`; the JSON records which), the row the
target is judged on. OpenVINO bf16:
`INFERENCE_PRECISION_HINT: "bf16"` (its own bf16 path, the peer that already has one). Errors: max abs difference
and cosine of both bf16 peers' logits against onecopy fp32 (itself within 1e-6 of torch eager). Needs a CPU with native bf16 (avx512_bf16, amx_bf16, Arm bf16): elsewhere onecopy
refuses bf16, and so does this script. Results: benchmarks/results/vision_bf16.json.
"""

from __future__ import annotations

import contextlib
import sys

import common
import vision

MODELS = ("resnet18", "mobilenet_v3_small")
TARGET_RATIO, TARGET_COSINE = 0.5, 0.999


class OpenVinoBf16(vision.OpenVino):
    name = "openvino bf16"

    def __init__(self, model, example):
        import openvino as ov
        import torch

        ep = torch.export.export(model, (torch.from_numpy(example),))
        self.compiled = ov.Core().compile_model(ov.convert_model(ep), "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
        self.request = self.compiled.create_infer_request()


def agreement(got, want) -> dict:
    import numpy as np

    a, b = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    return {"max_abs_error": float(np.max(np.abs(a - b))), "cosine": float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)),
            "scale": float(np.max(np.abs(b)))}


def main() -> int:
    run = common.BenchmarkRun("vision_bf16", __doc__)
    import numpy as np

    from onecopy import Runtime
    from onecopy.delegate.precision import native_bf16_flags
    from onecopy.delegate.targets import cpu_flags

    machine = run.describe_machine()
    if not any(flag in cpu_flags() for flag in native_bf16_flags()):
        raise SystemExit(f"this CPU has none of {', '.join(native_bf16_flags())}: onecopy refuses bf16 here")
    budget = 2.0 if run.quick else 8.0
    settings = vision.rounds(run.quick)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    payload: dict = {"models": {}, "targets": [], "cpu_bf16_flags": sorted(set(native_bf16_flags()) & cpu_flags())}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(common.temp_workdir("vision_bf16"))
        cache_dir = stack.enter_context(common.isolated_cache(work / "cache"))
        runtime = Runtime(cache_dir=cache_dir)
        for name in MODELS:
            model = vision.build(name)
            path = vision.export({"forward": (model, x)}, work / f"{name}.onecopy")
            peers, loads = {}, {}
            for precision in ("fp32", "bf16"):
                with common.Stopwatch() as specializing:
                    program = stack.enter_context(runtime.load_program(path, precision=precision))
                    peers[f"onecopy {precision}"] = common.OnecopyMethod(program.load_method("forward"))
                loads[precision] = specializing.seconds
                print(f"{name}: first load in {precision} (specialize, tuned) {specializing.seconds:.1f} s", flush=True)
            both = vision.export({"forward": (model, x)}, work / f"{name}-both.onecopy", delegates=("iree", "openvino"))
            program = stack.enter_context(runtime.load_program(both, prefer="latency", precision="bf16"))
            latency_method = program.load_method("forward")
            peers["onecopy bf16 latency"] = common.OnecopyMethod(latency_method)
            latency_choice = latency_method.method_meta.choice
            print(f"{name}: prefer='latency' in bf16 chose {latency_choice.backend} ({latency_choice.latency_ms})", flush=True)
            peers["onnxruntime"] = common.OnnxRuntime(model, x, work / f"{name}.onnx")
            peers["openvino bf16"] = OpenVinoBf16(model, x)
            reference = np.array(peers["onecopy fp32"](x))
            errors = {peer: agreement(np.array(peers[peer](x)), reference)
                      for peer in ("onecopy bf16", "onecopy bf16 latency", "openvino bf16")}
            timings = vision.timed(peers, x, budget, "onnxruntime", settings)
            vision.print_rows(f"{name} B=1", timings)
            for peer, e in errors.items():
                print(f"{name} {peer} vs onecopy fp32: max |err| {e['max_abs_error']:.3g} (scale {e['scale']:.3g}), "
                      f"cosine {e['cosine']:.6f}")
            # What tuned specialization kept for each precision, and what its code runs in (from the cache entries):
            # the reason a ratio is what it is.
            specialized = common.specializations(path, cache_dir)
            runs_in = {p: found["runs_in"] for p, found in specialized.items()}
            print(f"{name}: onecopy bf16 (IREE) runs in {runs_in.get('bf16')} (tuning keeps fp32 where it measured "
                  "faster)", flush=True)
            payload["models"][name] = {"timings": timings, "vs_onecopy_fp32": errors, "first_load_s": loads,
                                       "specializations": {p: found["tuning"] for p, found in specialized.items()},
                                       "iree_runs_in": runs_in,
                                       "bf16_latency_choice": {"backend": latency_choice.backend,
                                                               "latency_ms": latency_choice.latency_ms,
                                                               "memory_mb": latency_choice.memory_mb}}
            if name == "resnet18":
                best = timings["onecopy bf16 latency"]
                payload["targets"] += [
                    common.target(f"ResNet-18 onecopy bf16 (prefer=latency: {latency_choice.backend}) / ORT fp32",
                                  best["ratio_to_ort"], "<=", TARGET_RATIO, interval=best["interval_95"]),
                    common.target(f"ResNet-18 onecopy bf16 (IREE, one copy in memory, runs in {runs_in.get('bf16')}) "
                                  "/ ORT fp32",
                                  timings["onecopy bf16"]["ratio_to_ort"], "<=", TARGET_RATIO, "for information",
                                  interval=timings["onecopy bf16"]["interval_95"]),
                    common.target("ResNet-18 bf16 logits cosine to fp32",
                                  min(errors["onecopy bf16"]["cosine"], errors["onecopy bf16 latency"]["cosine"]),
                                  ">=", TARGET_COSINE),
                ]
    common.print_targets(payload["targets"])
    payload["cpu_model"] = machine.get("cpu_model")
    run.write(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
