"""Frame overhead: what onecopy adds to an engine call on bound surfaces when the caches are cold, as they are
right after a frame, measured apart from the frame's own time.

    python benchmarks/frame_overhead.py [--quick]

In `frames.py` onecopy's cost per frame is a few microseconds on a call of ~1 ms whose time itself varies by
tens of microseconds. Here the model is frames.py's model A on a tiny frame (fp16 [1, 3, 16, 64]), so the engine
call is short, and before every timed call a 32 MB array is copied (untimed): that evicts the caches as a
streamed frame does (harsher: the last-level cache is flushed whole). Peers, called in a shuffled order each
round, each after its own flush:
- pure engine compute: the function of onecopy's cache entry called raw on buffers imported once from the same
  surfaces (common.RawIreeInPlace, onecopy's device): `VmContext.invoke` only;
- onecopy bound, prepared: `Method.prepare(...).run()` (the surfaces' locks and the engine call, `FrameRun` in C);
- onecopy bound: `Method.execute([...], outputs=[...])`, which reruns its kept plan (`repeat_kept`, then the same
  FrameRun);
- engine call on onecopy's context: the same invoke as pure engine compute, on a context from onecopy's pool with
  onecopy's argument list, no locks: what the rest of onecopy's run costs shows against it.
Each onecopy peer's figure is the median over rounds of (its time - pure engine compute's time in the round), in
microseconds, with a bootstrap 95% interval. No targets: this is the breakdown behind frames.py's bound / pure
engine compute figures (benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import time

import common
import frames

SHAPE = (1, 3, 16, 64)  # 48 rows of 64 fp16 values: 128-byte rows, a dense surface
FLUSH_BYTES = 32 << 20


def main() -> int:
    run = common.BenchmarkRun("frame_overhead", __doc__)
    import numpy as np
    import torch

    from onecopy import Runtime, Surface
    from onecopy.export import export_program

    run.describe_machine()
    rounds = 300 if run.quick else 3000
    scale_bias, _ = frames.make_models()
    flush_from = np.ones(FLUSH_BYTES // 2, np.float16)
    flush_to = np.empty_like(flush_from)

    with contextlib.ExitStack() as stack:
        work = stack.enter_context(common.temp_workdir("frame_overhead"))
        cache_dir = stack.enter_context(common.isolated_cache(work / "cache"))
        model = copy.deepcopy(scale_bias).to(torch.float16)
        ep = torch.export.export(model, (torch.zeros(SHAPE, dtype=torch.float16),))
        path = export_program({"forward": ep}, memory_planned_outputs=False).save(work / "scale_bias.onecopy")
        runtime = Runtime(cache_dir=cache_dir)
        before = common.cache_entries(cache_dir)
        program = stack.enter_context(runtime.load_program(path))
        method = program.load_method("forward")
        entry = frames.entry_of(cache_dir, before)
        manifest = program.definition.delegates[0].manifest

        rows = SHAPE[1] * SHAPE[2]
        s_in, s_out = (stack.enter_context(Surface.create(rows, SHAPE[3], "float16")) for _ in range(2))
        for surface in (s_in, s_out):
            method.bind_surface(surface)
        x_in, x_out = (s.array().reshape(SHAPE) for s in (s_in, s_out))
        x_in[...] = 1
        raw = common.RawIreeInPlace(entry, path, manifest["function"], device=common.engine_device(method))
        raw.bind([x_in], [x_out])
        prepared = method.prepare([x_in], outputs=[x_out])
        method.execute([x_in], outputs=[x_out])  # planned and kept: the timed calls rerun it
        if method.last_copy_stats.copied or prepared.last_copy_stats.copied:
            raise SystemExit(f"the bound calls copied bytes: {method.last_copy_stats}")

        # The engine call alone on onecopy's own context and argument list (the plan's), for reference.
        plan = prepared._planned
        engine_model = plan._function.model
        context = engine_model.checkout()
        engine_model.checkin(context)
        results_list = plan._rt.VmVariantList

        def engine_on_onecopys_context():
            context.invoke(plan._vm_function, plan._args, results_list(1))

        inputs, outputs = [x_in], [x_out]
        peers = {
            "pure engine compute": raw,
            "onecopy bound, prepared": prepared.run,
            "onecopy bound": lambda: method.execute(inputs, outputs=outputs),
            "engine call on onecopy's context": engine_on_onecopys_context,
        }
        names = list(peers)
        times = {name: [] for name in names}
        for name in names:  # warm-up
            for _ in range(20):
                peers[name]()
        print(f"timing {len(names)} peers, {rounds} rounds, each call after a {FLUSH_BYTES >> 20} MB copy...",
              flush=True)
        snapshot = common.cpu_snapshot()
        clock = time.perf_counter
        shuffle = random.Random(1).shuffle
        for _ in range(rounds):
            shuffle(names)
            for name in names:
                np.copyto(flush_to, flush_from)
                call = peers[name]
                start = clock()
                call()
                times[name].append(clock() - start)
        others = common.foreign_cpu(snapshot)

    base = np.array(times["pure engine compute"]) * 1e6
    rng = np.random.default_rng(0)
    added = {}
    for name in peers:
        if name == "pure engine compute":
            continue
        differences = np.array(times[name]) * 1e6 - base
        resampled = np.median(rng.choice(differences, (1000, len(differences))), axis=1)
        low, high = np.percentile(resampled, [2.5, 97.5])
        added[name] = {"added_us": float(np.median(differences)), "interval_95_us": [float(low), float(high)],
                       "median_us": float(np.median(times[name]) * 1e6)}
    common.print_table(
        ["peer", "median us", "added to pure engine compute, us", "95% interval"],
        [["pure engine compute", f"{np.median(base):.1f}", "-", "-"]]
        + [[name, f"{a['median_us']:.1f}", f"{a['added_us']:+.1f}",
            f"{a['interval_95_us'][0]:+.1f} to {a['interval_95_us'][1]:+.1f}"] for name, a in added.items()],
        title=f"after a {FLUSH_BYTES >> 20} MB copy (cold caches), model A on fp16 {list(SHAPE)}, paired per round")
    print(f"\nother processes used {others['fraction']:.0%} of the CPUs while timing")
    run.write({
        "what": "microseconds onecopy's calls on bound surfaces add to the raw engine call, each call timed right "
                "after a cache-evicting copy; median of the per-round differences, bootstrap 95% interval",
        "frame": list(SHAPE),
        "flush_bytes": FLUSH_BYTES,
        "rounds": rounds,
        "pure_engine_compute_median_us": float(np.median(base)),
        "added": added,
        "other_processes_cpu": others,
        "targets": [],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
