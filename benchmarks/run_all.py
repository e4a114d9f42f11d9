"""Run every benchmark, each in a fresh process, then print every target and whether it was met.

    python benchmarks/run_all.py [--quick] [--only latency,load,size,memory,frames,frame_overhead]
                                 [--wait-quiet SECONDS]

Each benchmark writes benchmarks/results/<name>.json (with --quick: <name>.quick.json, not kept in git).
Exits non-zero only when a benchmark fails to run, never because a target was missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common

BENCHMARKS = ("latency", "load", "size", "memory", "frames", "frame_overhead")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short smoke runs of every benchmark")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="before each benchmark, wait up to SECONDS for other processes to leave the CPUs idle")
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help="comma-separated subset of " + ", ".join(BENCHMARKS))
    args = parser.parse_args()
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")

    failed, durations = [], {}
    for name in chosen:
        print(f"\n===== {name} =====", flush=True)
        start = time.perf_counter()
        passed = ["--quick"] if args.quick else []
        if args.wait_quiet:
            passed += ["--wait-quiet", str(args.wait_quiet)]
        done = common.run_script(f"{name}.py", passed)
        durations[name] = time.perf_counter() - start
        if done.returncode != 0:
            failed.append(name)
            print(f"{name}: FAILED (exit {done.returncode})", flush=True)

    rows = []
    for name in chosen:
        if name in failed:
            rows.append([name, "(benchmark failed)", "", "", "", ""])
            continue
        document = json.loads(common.results_path(name, args.quick).read_text())
        rows.extend([name, *common.target_row(t)] for t in document.get("targets", []))
    common.print_table(["benchmark", *common.TARGET_COLUMNS], rows, title="===== all targets =====")
    print("\n" + ", ".join(f"{n} {s:.0f} s" for n, s in durations.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
