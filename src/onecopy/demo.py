"""`onecopy demo`: export the built-in model, load it, run both methods against torch eager, print a report."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

__all__ = ["run_demo"]


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def _median_ms(fn, repeats: int = 20) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def run_demo(workdir: Path | None = None) -> int:
    import numpy as np
    import torch

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.models import METHOD_BATCH, WIDTH, builtin_methods, builtin_model
    from onecopy.runtime import Runtime

    with tempfile.TemporaryDirectory(prefix="onecopy-demo-") as tmp:
        out = workdir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = builtin_model()
        print(f"built-in model: 8 x Linear({WIDTH}, {WIDTH}) + ReLU, methods {dict(METHOD_BATCH)}")
        rows = []
        for label, partitioner, spec in [
            ("default (mlir)", Partitioner(), CompileSpec(packaging="mlir")),
            ("multifunction (mlir)", Partitioner(multifunction=True), CompileSpec(packaging="mlir")),
            ("multifunction (vmfb)", Partitioner(multifunction=True), CompileSpec(packaging="vmfb")),
        ]:
            start = time.perf_counter()
            path = export_program(builtin_methods(model), partitioner=partitioner, compile_spec=spec).save(
                out / f"builtin-{label.split()[0]}-{spec.packaging}.onecopy"
            )
            rows.append((label, path, time.perf_counter() - start))
        print("\nexport                 file size     export s")
        for label, path, seconds in rows:
            print(f"{label:22} {_mib(path.stat().st_size)} {seconds:8.2f}")

        print("\nrun (multifunction)    load ms   method    onecopy ms   torch ms   max |diff|")
        runtime = Runtime()
        for label, path, _ in rows[1:]:
            start = time.perf_counter()
            with runtime.load_program(path) as program:
                methods = {name: program.load_method(name) for name in program.method_names}
                load_ms = (time.perf_counter() - start) * 1e3
                for name, method in methods.items():
                    x = torch.randn(METHOD_BATCH[name], WIDTH)
                    with torch.no_grad():
                        expected = model(x).numpy()
                    xs = x.numpy()
                    (y,) = method.execute([xs])
                    ours = _median_ms(lambda: method.execute([xs]))
                    with torch.no_grad():
                        eager = _median_ms(lambda: model(x))
                    diff = float(np.abs(y - expected).max())
                    print(f"{label:22} {load_ms:7.0f}   {name:8} {ours:10.3f} {eager:10.3f}   {diff:.2e}")
                    if diff > 1e-4:
                        print(f"error: {name} differs from torch eager by {diff}")
                        return 1
        print(f"\nprograms in {out}" if workdir else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_demo(Path(os.environ["ONECOPY_DEMO_DIR"]) if "ONECOPY_DEMO_DIR" in os.environ else None))
