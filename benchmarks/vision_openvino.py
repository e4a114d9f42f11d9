"""Vision with the OpenVINO delegate: ResNet-18 and MobileNetV3-small, B=1, 3x224x224 fp32, a program exported with
`CompileSpec(delegates=("iree", "openvino"))` loaded with `prefer="latency"` beside the same program with
`prefer="memory"` (IREE), ONNX Runtime fp32 and OpenVINO fp32 used directly, in one run; memory per load.

    python benchmarks/vision_openvino.py [--quick]

Peers, timed side by side (vision.py's settings: common.measure, shuffled interleaved rounds, ratios paired
within rounds, ONNX Runtime as 1.00):
- onecopy prefer=memory: the program's IREE delegate (the default load);
- onecopy prefer=latency: the delegate the first load measured fastest on this machine (its choice and the
  timings it made are recorded in the results);
- onnxruntime 1.32 and openvino fp32 (`convert_model` + `compile_model(..., {"INFERENCE_PRECISION_HINT": "f32"})`,
  as vision.py), and torch eager.
Target (issue #22): prefer="latency" <= 1.0x ONNX Runtime fp32.

File: the program's size beside the IREE-only export of the same model, and the bytes of constants OpenVINO
computed itself at conversion (folded batch norms) that the file stores beside the parameters IREE reads.

Memory per load (each in a fresh process, the choice already recorded): RSS and PSS growth of 1 and N loads of
the program with prefer="memory" and with prefer="latency" (one call each).

Results: benchmarks/results/vision_openvino.json (.quick.json for --quick).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import common
from vision import OpenVino, build, print_rows, rounds, timed

MODELS = ("resnet18", "mobilenet_v3_small")
TARGET_LATENCY_OVER_ORT = 1.0


def export(model, x, path: Path, delegates: tuple[str, ...]) -> Path:
    import torch

    from onecopy.export import CompileSpec, export_program

    ep = torch.export.export(model, (torch.from_numpy(x),))
    export_program({"b1": ep}, compile_spec=CompileSpec(check_compiles=False, delegates=delegates)).save(path)
    return path


def memory_child(path: str, cache_dir: str, prefer: str, loads: int) -> None:
    import numpy as np

    from onecopy import Runtime

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    runtime = Runtime(cache_dir=cache_dir)
    keep, growth = [], []
    if prefer == "latency":
        import openvino  # noqa: F401  the library's own pages are not a load's

    base = common.smaps_rollup()
    for _ in range(loads):
        program = runtime.load_program(path, prefer=prefer)
        method = program.load_method("b1")
        method.execute([x])
        keep.append(program)
        now = common.smaps_rollup()
        growth.append({"rss": now["Rss"] - base["Rss"], "pss": now["Pss"] - base["Pss"],
                       "backend": method.method_meta.delegates[0].backend})
    print("MEMORY " + json.dumps(growth))


def memory(path: Path, cache_dir: Path, loads: int) -> dict:
    found = {}
    for prefer in ("memory", "latency"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(path), str(cache_dir), prefer, str(loads)],
                             capture_output=True, text=True, timeout=900)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MEMORY ")), None)
        if line is None:
            raise SystemExit(f"memory child ({prefer}) failed:\n{out.stderr[-2000:]}")
        found[f"prefer={prefer}"] = json.loads(line.removeprefix("MEMORY "))
    return found


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        path, cache_dir, prefer, loads = sys.argv[2:6]
        memory_child(path, cache_dir, prefer, int(loads))
        return 0
    run = common.BenchmarkRun("vision_openvino", __doc__)
    import numpy as np
    import torch

    from onecopy import Runtime
    from onecopy.program import read_program

    run.describe_machine()  # records the machine (torch threads etc.) in the results
    budget = 1.5 if run.quick else 8.0
    settings = rounds(run.quick)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    payload: dict = {"models": {}, "openvino_version": importlib.metadata.version("openvino")}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(common.temp_workdir("vision-openvino"))
        cache_dir = stack.enter_context(common.isolated_cache(work / "cache"))
        runtime = Runtime(cache_dir=cache_dir)
        for name in MODELS:
            model = build(name)
            with common.Stopwatch() as exporting:
                path = export(model, x, work / f"{name}.onecopy", ("iree", "openvino"))
            iree_only = export(model, x, work / f"{name}.iree.onecopy", ("iree",))
            loaded = read_program(path)
            try:
                (alternative,) = loaded.definition.methods[0].alternatives
                folded = loaded.definition.delegates[alternative].manifest.get("folded_bytes", 0)
            finally:
                loaded.close()
            with common.Stopwatch() as choosing:
                latency = stack.enter_context(runtime.load_program(path, prefer="latency")).load_method("b1")
            choice = latency.method_meta.choice
            memory_method = stack.enter_context(runtime.load_program(path, prefer="memory")).load_method("b1")
            print(f"{name}: export {exporting.seconds:.1f} s; first prefer=latency load {choosing.seconds:.1f} s "
                  f"chose {choice.backend} ({choice.latency_ms}); OpenVINO's own constants {folded} B", flush=True)
            peers = {"onecopy prefer=memory": common.OnecopyMethod(memory_method),
                     "onecopy prefer=latency": common.OnecopyMethod(latency),
                     "onnxruntime": common.OnnxRuntime(model, x, work / f"{name}.onnx"),
                     "openvino fp32": OpenVino(model, x),
                     "torch eager": common.TorchEager(model)}
            with torch.no_grad():
                want = model(torch.from_numpy(x)).numpy()
            errors = {peer: f"{common.max_abs_diff(fn(x), want):.2e}" for peer, fn in peers.items()}
            timings = timed(peers, x, budget, "onnxruntime", settings)
            print_rows(f"{name} B=1", timings)
            ratio = timings["onecopy prefer=latency"]["ratio_to_ort"]
            payload["models"][f"{name} B=1"] = {
                "timings": timings, "max_abs_error": errors,
                "choice": {"backend": choice.backend, "latency_ms": choice.latency_ms, "memory_mb": choice.memory_mb,
                           "note": choice.note, "first_load_s": choosing.seconds},
                "file_bytes": {"iree_and_openvino": path.stat().st_size, "iree_only": iree_only.stat().st_size,
                               "openvino_own_constants": folded},
                "target": common.target("prefer=latency / ORT fp32", ratio, "<=", TARGET_LATENCY_OVER_ORT,
                                        interval=timings["onecopy prefer=latency"]["interval_95"]),
            }
            loads = 2 if run.quick else 4
            payload["models"][f"{name} B=1"]["memory"] = memory(path, cache_dir, loads)
            for label, growth in payload["models"][f"{name} B=1"]["memory"].items():
                print(f"{name} {label} ({growth[0]['backend']}): RSS +{common.mib(growth[0]['rss'])} MiB for 1 load, "
                      f"+{common.mib(growth[-1]['rss'])} for {loads}; PSS +{common.mib(growth[0]['pss'])} / "
                      f"+{common.mib(growth[-1]['pss'])}", flush=True)
    run.write(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
