"""Serving on Ray Serve: requests/s and p50/p90 latency over HTTP, and the replicas' memory, for 1 vs 2 replicas.

The built-in model (8 x Linear(1024, 1024), mlir, multifunction) is served by `onecopy.serve.deployment` on a local
Ray (num_cpus=2, replicas of 0.5 CPU each), one application at a time. Clients POST npz requests to /forward
(B=1) from a few threads for a fixed time. Memory is each replica process's PSS from /proc/<pid>/smaps_rollup
(whole process) and, from /proc/<pid>/smaps, of the mappings of the program file and the specialization cache
(the weights: what onecopy shares), measured after the program was specialized, so every replica restores it;
target: 2 replicas' weight PSS <= 1.1x one replica's.

    python benchmarks/serve.py [--quick] [--wait-quiet 120]
"""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def replica_pids(app: str) -> list[int]:
    """Replica processes of an application, by the title Ray gives them (ray::ServeReplica:<app>:...)."""
    marker = f"ServeReplica:{app}:"
    return sorted(p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or ()))


def mapped_pss(pid: int, prefixes: tuple[str, ...]) -> int:
    """PSS (bytes) of the process's mappings of files under any of `prefixes`."""
    return sum(m.pss for m in psutil.Process(pid).memory_maps(grouped=True) if m.path.startswith(prefixes))


def load(url: str, body: bytes, clients: int, seconds: float) -> dict:
    """`clients` threads POSTing `body` for `seconds`: requests/s and latency percentiles (ms)."""
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < stop:
            request = urllib.request.Request(url, data=body, headers={"content-type": "application/x-npz"})
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                    ok = response.status == 200
            except OSError:
                ok = False
            elapsed = (time.perf_counter() - start) * 1e3
            with lock:
                if ok:
                    latencies.append(elapsed)
                else:
                    failures[0] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    p50, p90 = np.percentile(latencies, [50, 90]) if latencies else (float("nan"), float("nan"))
    return {"requests": len(latencies), "failures": failures[0], "seconds": wall,
            "requests_per_s": len(latencies) / wall, "p50_ms": float(p50), "p90_ms": float(p90)}


def main() -> int:
    run = common.BenchmarkRun("serve", __doc__)
    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.models import builtin_methods

    run.describe_machine()
    seconds, clients, rounds = (3.0, 4, 1) if run.quick else (10.0, 4, 3)
    with common.temp_workdir("serve") as work, common.isolated_cache(work / "cache") as cache:
        path = work / "builtin.onecopy"
        export_program(builtin_methods(), partitioner=Partitioner(multifunction=True),
                       compile_spec=CompileSpec(packaging="mlir")).save(path)
        print(f"exported the built-in model: {path.stat().st_size:,} B", flush=True)
        # Specialize here, once: every replica measured then restores (a specializing replica reads all the
        # program's weights to pack them, and would count those pages too).
        from onecopy.runtime import Runtime

        with Runtime().load_program(path, backend_options={"IreeBackend": {"share_multifunction_model": True}}) as p:
            p.load_method("forward")
        import ray
        from ray import serve

        from onecopy.serve import deployment

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Workers inherit ONECOPY_CACHE_DIR from this process: every replica uses the run's own cache.
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        results: dict[str, dict] = {}
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            buffer = io.BytesIO()
            np.savez(buffer, np.random.default_rng(0).standard_normal((1, 1024), dtype=np.float32))
            body = buffer.getvalue()
            url = f"http://127.0.0.1:{port}/forward"
            prefixes = (str(path.resolve()), str(cache.resolve()))
            loads: dict[int, list[dict]] = {1: [], 2: []}
            for replicas in (1, 2):
                app = f"bench{replicas}"
                serve.run(deployment(path, replicas=replicas, ray_actor_options={"num_cpus": 0.5}), name=app,
                          route_prefix="/")
                load(url, body, clients, 1.0)  # warm-up: every replica has served
                pids = replica_pids(app)
                rollups = [common.smaps_rollup(pid) for pid in pids]
                weights = [mapped_pss(pid, prefixes) for pid in pids]
                results[app] = {"replica_pids": pids, "pss": [r["Pss"] for r in rollups],
                                "rss": [r["Rss"] for r in rollups], "weights_pss": weights,
                                "pss_total": sum(r["Pss"] for r in rollups), "weights_pss_total": sum(weights)}
                serve.delete(app)
            # Throughput rounds alternate 1 and 2 replicas, so that other load on the machine hits both alike.
            for round_ in range(rounds):
                for replicas in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                    app = f"bench{replicas}"
                    serve.run(deployment(path, replicas=replicas, ray_actor_options={"num_cpus": 0.5}), name=app,
                              route_prefix="/")
                    load(url, body, clients, 1.0)
                    loads[replicas].append(load(url, body, clients, seconds))
                    serve.delete(app)
        finally:
            serve.shutdown()
            ray.shutdown()

    def med(replicas: int, key: str) -> float:
        return common.median([r[key] for r in loads[replicas]])

    one, two = results["bench1"], results["bench2"]
    pss_ratio = two["pss_total"] / one["pss_total"]
    weight_ratio = two["weights_pss_total"] / one["weights_pss_total"]
    common.print_table(
        ["replicas", "requests/s", "p50 ms", "p90 ms", "PSS total MiB", "weights PSS MiB"],
        [[n, f"{med(n, 'requests_per_s'):.1f}", f"{med(n, 'p50_ms'):.2f}", f"{med(n, 'p90_ms'):.2f}",
          common.mib(r["pss_total"]), common.mib(r["weights_pss_total"])] for n, r in ((1, one), (2, two))],
        title=f"HTTP POST /forward (B=1, npz), {clients} clients, {seconds:.0f} s x {rounds} rounds; medians",
    )
    targets = [
        common.target("2 replicas' weight PSS / 1 replica's", weight_ratio, "<=", 1.1),
        common.target("2 replicas' whole-process PSS / 1 replica's", pss_ratio, "<=", 2.0,
                      note="each replica is also a Python interpreter with Ray"),
    ]
    common.print_targets(targets)
    run.write({"clients": clients, "seconds": seconds, "rounds": rounds, "memory": results,
               "loads": {str(k): v for k, v in loads.items()},
               "requests_per_s": {"1": med(1, "requests_per_s"), "2": med(2, "requests_per_s")},
               "p50_ms": {"1": med(1, "p50_ms"), "2": med(2, "p50_ms")},
               "p90_ms": {"1": med(1, "p90_ms"), "2": med(2, "p90_ms")},
               "pss_ratio_2_over_1": pss_ratio, "weights_pss_ratio_2_over_1": weight_ratio,
               "targets": targets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
