"""Where each call's time goes, dispatch by dispatch (`Method.profile`, what `onecopy profile` prints), on the
models the latency and vision benchmarks compare: the built-in model (forward B=1, prefill B=16), the 4-layer
transformer encoder of latency.py (B=1 and B=16, T=128), ResNet-18 and MobileNetV3-small of vision.py (B=1).

    python benchmarks/dispatches.py [--quick]

Each program is exported and loaded as those benchmarks do (default export; specialized, tuned and its executor
chosen by the load), then each method profiled: per call, its dispatches (the slowest first, how many times a call
runs each), the time between them, how long the task workers took to start once the call was ready, and the rest
of the call. Not a comparison with other engines (latency.py and vision.py are): it says where onecopy's own time
goes, the dispatches timed in their module, not alone (IREE's executable benchmarks read inputs nothing wrote: one
zero page, in cache). The child process's calling thread waits as IREE's tools do, not with onecopy's batch wait,
so "the rest of the call" reads longer than in a `Method.execute` loop on few cores. Results:
benchmarks/results/dispatches.json (every dispatch of every profile).
"""

from __future__ import annotations

import common

TOP = 8  # dispatches printed per profile; the JSON keeps them all


def programs(work):
    """(label, program path, {method: example input}) for each model profiled."""
    import numpy as np
    import torch

    from latency import export_models
    from onecopy.export import Partitioner, export_program
    from onecopy.models import vision

    for label, _, examples, methods in export_models():
        path = export_program(methods, partitioner=Partitioner(multifunction=True)).save(work / f"{label}.onecopy")
        yield label, path, examples
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    for name in ("resnet18", "mobilenet_v3_small"):
        model = getattr(vision, name)().eval()
        path = export_program({"b1": torch.export.export(model, (torch.from_numpy(x),))}).save(work / f"{name}.onecopy")
        yield name, path, {"b1": x}


def main() -> int:
    run = common.BenchmarkRun("dispatches", __doc__)
    import torch  # noqa: F401  (machine_info records its thread count)

    from onecopy import Runtime

    run.describe_machine()
    seconds = 0.5 if run.quick else 3.0
    profiles = {}
    with common.temp_workdir("dispatches") as work, common.isolated_cache(work / "cache") as cache_dir:
        runtime = Runtime(cache_dir=cache_dir)
        for label, path, examples in programs(work):
            with runtime.load_program(path) as program:
                for method, x in examples.items():
                    profile = program.load_method(method).profile([x], seconds=seconds)
                    profiles[f"{label} {method} {list(x.shape)}"] = profile.to_dict()
                    print(f"{label} {method} {list(x.shape)}: " + "\n".join(profile.lines(TOP)), flush=True)
    run.write({"seconds_per_profile": seconds, "profiles": profiles})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
