"""Where an `export_llm` program's decode spends its time, per iree-compile flag set: how many dispatches one
decode call runs (from the stream IR) and each distinct dispatch's time run alone (IREE's executable benchmarks,
`--iree-hal-dump-executable-benchmarks-to`, each run by iree-benchmark-module on local-sync).

    python benchmarks/llm_dispatches.py PROGRAM [--flags="--iree-opt-data-tiling --iree-llvmcpu-enable-ukernels=all"]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_BASE = ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"]


def decode_source(path: str) -> bytes:
    from onecopy.program import read_program

    loaded = read_program(path)
    try:
        manifest = next(d.manifest for d in loaded.definition.delegates if d.manifest["function"] == "decode_0")
        return bytes(loaded.named_data[manifest["bundle"]["portable"]])
    finally:
        loaded.close()


def dispatch_counts(source: bytes, flags: list[str]) -> dict[str, int]:
    import iree.compiler as ic

    ir = ic.compile_str(source, input_type="auto", extra_args=_BASE + flags + [
        "--compile-to=stream", "--mlir-print-debuginfo=false"]).decode()
    counts = {}
    for fn in ("prefill_0", "decode_0"):
        body = re.search(r"util\.func public @" + re.escape(fn) + r"\$async\(.*?\n  }", ir, re.S)
        counts[fn] = len(re.findall(r"stream\.(?:cmd|async)\.dispatch", body.group(0))) if body else 0
    return counts


def dispatch_times(source: bytes, flags: list[str]) -> list[tuple[float, str]]:
    import iree.compiler as ic

    tools = os.path.dirname(sys.executable)
    out = Path(tempfile.mkdtemp(prefix="llm-dispatches-"))
    ic.compile_str(source, input_type="auto", extra_args=_BASE + flags + [
        f"--iree-hal-dump-executable-benchmarks-to={out}"])
    rows = []
    for f in sorted(out.glob("*decode*.mlir")):
        vmfb = f.with_suffix(".vmfb")
        subprocess.run([f"{tools}/iree-compile", str(f), "-o", str(vmfb)] + _BASE + flags, check=True)
        run = subprocess.run([f"{tools}/iree-benchmark-module", f"--module={vmfb}", "--device=local-sync",
                              "--benchmark_repetitions=5", "--benchmark_min_time=0.05s"],
                             capture_output=True, text=True, check=True)
        for line in run.stdout.splitlines():
            m = re.match(r"BM_(\S+?)/.*_median\s+([\d.]+) (\w+)", line)
            if m:
                rows.append((float(m.group(2)) * {"ns": 1e-3, "us": 1.0, "ms": 1e3}[m.group(3)], m.group(1)))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("program")
    parser.add_argument("--flags", default="--iree-opt-data-tiling --iree-llvmcpu-enable-ukernels=all",
                        help="iree-compile flags beside the target's (default: what onecopy specializes with)")
    args = parser.parse_args()
    flags = args.flags.split()
    source = decode_source(args.program)
    print(f"flags {flags}: dispatches per call {dispatch_counts(source, flags)}")
    rows = dispatch_times(source, flags)
    total = sum(t for t, _ in rows)
    print(f"{len(rows)} distinct decode dispatches, sum of their medians {total:.1f} us (each run alone)")
    for t, name in rows[:15]:
        print(f"  {t:8.2f} us  {t / total:5.1%}  {name.rsplit('$async_', 1)[-1][:90]}")


if __name__ == "__main__":
    main()
