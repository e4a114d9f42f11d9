"""Frames: fp16 [1, 3, 1080, 1920] frames through bound surfaces (zero copy) vs the copy path vs the same engine
function called raw on pre-imported buffers vs ONNX Runtime (IOBinding) vs torch eager; and a chained two-model
pipeline through one surface.

    python benchmarks/frames.py [--quick]

Models (fp16, exported with memory_planned_outputs=False, so the engine function is destination-passing: manifest
`outputs_in_place`, the output storage is a trailing argument written in place):
- A, scale-and-bias per channel: y = x * a + b (a, b of shape [1, 3, 1, 1]); memory-bound, so the bytes moved
  per call are most of its cost;
- B, a 1x1 convolution 3 -> 3 channels with bias.
A frame is a surface of 3 x 1080 rows of 1920 fp16 values (3840-byte rows, a multiple of 64: dense, no padding).

Peers for model A, timed side by side (common.measure: warm-up, shuffled interleaved rounds, medians):
- onecopy bound: `Method.execute([S_in view], outputs=[S_out view])` with both surfaces bound to the method (the
  engine reads and writes the surfaces in place; `last_copy_stats.copied == 0` is checked);
- onecopy bound, prepared: the same call planned once with `Method.prepare` and rerun with `run()` (what ORT's
  IOBinding is to `InferenceSession.run`): the surfaces' locks and the engine call, no per-argument work;
- onecopy copy: the same call on the same surfaces' arrays through a second load of the program with nothing
  bound (copied into the engine and out again);
- pure engine compute: the function of onecopy's cache entry called through iree.runtime on buffers imported once
  from the same surfaces, on onecopy's own device (same thread pool): `VmContext.invoke` and nothing else
  (common.RawIreeInPlace);
- onnxruntime: torch.onnx.export of the fp16 model, InferenceSession with IOBinding (bind_input / bind_output on
  preallocated numpy fp16 arrays), `run_with_iobinding`;
- torch eager fp16 and fp32: the model under torch.no_grad() (fp16 elementwise kernels on CPU can be slow; fp32
  is measured too so the better of the two is on record).
Pipeline A -> B: A writes surface S, B reads S and writes T (all bound) vs the same two calls on plain numpy arrays
(copied), vs both functions raw on pre-imported buffers; frames per second.

Then onecopy against the engine alone, call by call (common.measure_alternating): bound, prepared and pure engine
compute for model A, and the bound and raw pipelines, one call each per round, thousands of rounds. These peers
share one IREE device, so nothing needs a pause between them, and a pair of calls milliseconds apart cancels the
drift of a shared machine: the ratios against pure engine compute are resolved to a percent or so, where the
side-by-side table's (blocks of calls per peer, 7 peers) spans +-6%.

Targets (the issue's): bound / pure engine compute <= 1.03 (for execute and for the prepared call), measured call
by call; copy / bound >= 1.2, side by side.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys

import common

SHAPE = (1, 3, 1080, 1920)
ROWS, WIDTH = SHAPE[1] * SHAPE[2], SHAPE[3]
TARGET_BOUND_OVER_PURE = 1.03
TARGET_COPY_OVER_BOUND = 1.2
SCALE, BIAS = (0.5, 1.5, 2.0), (0.25, -1.0, 0.125)


def make_models():
    import torch

    class ScaleBias(torch.nn.Module):
        """y = x * a + b, per channel."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("a", torch.tensor(SCALE).reshape(1, 3, 1, 1))
            self.register_buffer("b", torch.tensor(BIAS).reshape(1, 3, 1, 1))

        def forward(self, x):
            return x * self.a + self.b

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, kernel_size=1)
    return ScaleBias().eval(), conv.eval()


def export_frame_model(model, path):
    import torch

    from onecopy.export import export_program

    fp16 = copy.deepcopy(model).to(torch.float16)
    ep = torch.export.export(fp16, (torch.zeros(SHAPE, dtype=torch.float16),))
    return export_program({"forward": ep}, memory_planned_outputs=False).save(path)


class OrtIoBinding:
    """ONNX Runtime with IOBinding: input and output bound once to preallocated numpy fp16 arrays."""

    name = "onnxruntime (IOBinding)"

    def __init__(self, model, x, path):
        import numpy as np

        self.ort = common.OnnxRuntime(model, x, path)  # export + session, default CPU EP and threading
        session = self.ort.session
        self.x = np.array(x, copy=True)
        self.y = np.empty(SHAPE, np.float16)
        self.binding = session.io_binding()
        self.binding.bind_input("x", "cpu", 0, np.float16, list(SHAPE), self.x.ctypes.data)
        self.binding.bind_output("y", "cpu", 0, np.float16, list(SHAPE), self.y.ctypes.data)
        self.session = session

    def __call__(self):
        self.session.run_with_iobinding(self.binding)


def entry_of(cache_dir, before: set[str]):
    new = common.cache_entries(cache_dir) - before
    if len(new) != 1:
        raise SystemExit(f"expected one new cache entry, found {sorted(new)}")
    return cache_dir / "v1" / "entries" / new.pop()


def main() -> int:
    run = common.BenchmarkRun("frames", __doc__)
    import numpy as np
    import torch

    from onecopy import Runtime, Surface

    run.describe_machine()
    budget, chain_budget = (2.0, 1.0) if run.quick else (20.0, 10.0)
    close_budget, close_chain_budget = (2.0, 2.0) if run.quick else (20.0, 15.0)
    frame_bytes = int(np.prod(SHAPE)) * 2

    scale_bias, conv = make_models()
    rng = np.random.default_rng(0)
    frame = rng.standard_normal(SHAPE, dtype=np.float32).astype(np.float16)
    with torch.no_grad():  # references in fp32 from the same fp16 input
        ref_a = scale_bias(torch.from_numpy(frame).float()).numpy()
        ref_chain = conv(scale_bias(torch.from_numpy(frame).float())).numpy()

    with contextlib.ExitStack() as stack:
        work = stack.enter_context(common.temp_workdir("frames"))
        cache_dir = stack.enter_context(common.isolated_cache(work / "cache"))
        with common.Stopwatch() as watch:
            path_a = export_frame_model(scale_bias, work / "scale_bias.onecopy")
            path_b = export_frame_model(conv, work / "conv1x1.onecopy")
        export_s = watch.seconds
        runtime = Runtime(cache_dir=cache_dir)

        before = common.cache_entries(cache_dir)
        with common.Stopwatch() as watch:
            program_a = stack.enter_context(runtime.load_program(path_a))  # specializes A
            bound = program_a.load_method("forward")
        entry_a = entry_of(cache_dir, before)
        before = common.cache_entries(cache_dir)
        program_b = stack.enter_context(runtime.load_program(path_b))  # specializes B
        bound_b = program_b.load_method("forward")
        entry_b = entry_of(cache_dir, before)
        load_s = watch.seconds
        copying = stack.enter_context(runtime.load_program(path_a)).load_method("forward")  # restored, unbound
        copying_b = stack.enter_context(runtime.load_program(path_b)).load_method("forward")
        manifest_a = program_a.definition.delegates[0].manifest
        manifest_b = program_b.definition.delegates[0].manifest
        if not (manifest_a.get("outputs_in_place") and manifest_b.get("outputs_in_place")):
            raise SystemExit(f"expected destination-passing functions, got {manifest_a} / {manifest_b}")

        s_in, s_mid, s_out = (stack.enter_context(Surface.create(ROWS, WIDTH, "float16")) for _ in range(3))
        if not (s_in.dense and s_mid.dense and s_out.dense):
            raise SystemExit("frame surfaces should be dense (1920 fp16 = 3840-byte rows)")
        for surface in (s_in, s_mid):
            bound.bind_surface(surface)
        for surface in (s_mid, s_out):
            bound_b.bind_surface(surface)
        x_in, x_mid, x_out = (s.array().reshape(SHAPE) for s in (s_in, s_mid, s_out))
        x_in[...] = frame

        # onecopy's devices (the executor each method runs on): the raw calls run on the same ones
        raw_a = common.RawIreeInPlace(entry_a, path_a, manifest_a["function"], device=common.engine_device(bound))
        raw_a.bind([x_in], [x_mid])
        raw_b = common.RawIreeInPlace(entry_b, path_b, manifest_b["function"], device=common.engine_device(bound_b))
        raw_b.bind([x_mid], [x_out])
        scale_bias_16 = copy.deepcopy(scale_bias).to(torch.float16)
        ort = OrtIoBinding(scale_bias_16, frame, work / "scale_bias.onnx")
        t16 = torch.from_numpy(np.array(frame))
        t32 = t16.float()

        def torch_eager(model, x):
            def call():
                with torch.no_grad():
                    return model(x)
            return call

        prepared = bound.prepare([x_in], outputs=[x_mid])  # planned once, as ORT's IOBinding is
        peers = {
            "onecopy bound": lambda: bound.execute([x_in], outputs=[x_mid]),
            "onecopy bound, prepared": prepared.run,
            "onecopy copy": lambda: copying.execute([x_in], outputs=[x_mid]),
            "pure engine compute": raw_a,
            "onnxruntime (IOBinding)": ort,
            "torch eager fp16": torch_eager(scale_bias_16, t16),
            "torch eager fp32": torch_eager(scale_bias, t32),
        }

        # Results before timing: every peer against the fp32 reference, and the bytes each onecopy call copied.
        diffs, copy_stats = {}, {}
        for name, fn in peers.items():
            x_mid[...] = 0
            result = fn()
            if name.startswith("onecopy"):
                copy_stats[name] = dataclasses.asdict((copying if name == "onecopy copy" else bound).last_copy_stats)
            output = {"onnxruntime (IOBinding)": ort.y}.get(name)
            if output is None:
                output = result.numpy() if isinstance(result, torch.Tensor) else x_mid
            diffs[name] = common.max_abs_diff(output, ref_a)
        for name in ("onecopy bound", "onecopy bound, prepared"):
            if copy_stats[name]["copied_in"] or copy_stats[name]["copied_out"]:
                raise SystemExit(f"{name} copied bytes: {copy_stats[name]}")
        if copy_stats["onecopy copy"]["copied_in"] != frame_bytes or copy_stats["onecopy copy"]["copied_out"] != frame_bytes:
            raise SystemExit(f"copy path should copy the frame in: {copy_stats['onecopy copy']}")
        print("max |diff| vs torch fp32: " + ", ".join(f"{n} {d:.3g}" for n, d in diffs.items()))

        print(f"\ntiming model A ({len(peers)} peers, about {budget:.0f} s)...", flush=True)
        stats = common.measure(peers, budget_s=budget, min_rounds=6 if run.quick else 12)
        bound.execute([x_in], outputs=[x_mid])
        zero_copy_after = bound.last_copy_stats.copied == 0

        # Pipeline A -> B
        plain_in, plain_mid, plain_out = np.array(frame), np.empty(SHAPE, np.float16), np.empty(SHAPE, np.float16)

        def chain_bound():
            bound.execute([x_in], outputs=[x_mid])
            bound_b.execute([x_mid], outputs=[x_out])

        def chain_copied():
            copying.execute([plain_in], outputs=[plain_mid])
            copying_b.execute([plain_mid], outputs=[plain_out])

        def chain_raw():
            raw_a()
            raw_b()

        chain = {"onecopy bound (A writes S, B reads S)": chain_bound, "onecopy copied (numpy arrays)": chain_copied,
                 "pure engine compute (A, B raw)": chain_raw}
        bound_name, copied_name, raw_name = list(chain)
        chain_diffs, chain_copies = {}, {}
        for name, fn in chain.items():
            x_out[...] = 0
            plain_out[...] = 0
            fn()
            chain_diffs[name] = common.max_abs_diff(plain_out if "copied" in name else x_out, ref_chain)
            if name.startswith("onecopy"):
                a, b = (bound, bound_b) if "bound" in name else (copying, copying_b)
                chain_copies[name] = a.last_copy_stats.copied + b.last_copy_stats.copied
        if chain_copies["onecopy bound (A writes S, B reads S)"] != 0:
            raise SystemExit(f"bound pipeline copied bytes: {chain_copies}")
        print(f"timing the A -> B pipeline (about {chain_budget:.0f} s)...", flush=True)
        chain_stats = common.measure(chain, budget_s=chain_budget, min_rounds=6 if run.quick else 12)

        print(f"timing onecopy against the engine alone, call by call (about {close_budget + close_chain_budget:.0f}"
              " s)...", flush=True)
        snapshot = common.cpu_snapshot()
        close = common.measure_alternating(
            {name: peers[name] for name in ("onecopy bound", "onecopy bound, prepared", "pure engine compute")},
            budget_s=close_budget)
        close_chain = common.measure_alternating({name: chain[name] for name in (bound_name, raw_name)},
                                                 budget_s=close_chain_budget)
        close_others = common.foreign_cpu(snapshot)

    # -- tables (ratios paired by round: common.paired_ratio)
    ms = {name: s.median_ms for name, s in stats.items()}

    def ratio(a: str, b: str) -> float:
        return common.paired_ratio(stats[a], stats[b])

    def chain_ratio(a: str, b: str) -> float:
        return common.paired_ratio(chain_stats[a], chain_stats[b])

    rows = [[name, common.fmt_ms(s.median_ms), common.fmt_ms(s.p10_ms), common.fmt_ms(s.p90_ms), s.calls,
             f"{frame_bytes * 2 / (s.median_ms * 1e-3) / 1e9:.1f}",
             common.fmt_ratio(common.paired_ratio(stats["onecopy bound"], s)), f"{diffs[name]:.2g}"]
            for name, s in stats.items()]
    common.print_table(["model A: x * a + b, fp16 [1, 3, 1080, 1920]", "median ms", "p10", "p90", "calls",
                        "GB/s (in+out)", "bound / peer", "max|diff|"], rows,
                       title="one model, side by side (ratios: onecopy bound over the peer, below 1 = bound faster)")
    torch_best = min(("torch eager fp16", "torch eager fp32"), key=lambda n: ms[n])
    print(f"torch eager: fp16 {common.fmt_ms(ms['torch eager fp16'])} ms, fp32 {common.fmt_ms(ms['torch eager fp32'])}"
          f" ms -> {torch_best} is the faster")
    cms = {name: s.median_ms for name, s in chain_stats.items()}
    rows = [[name, common.fmt_ms(s.median_ms), f"{1e3 / s.median_ms:.1f}", s.calls,
             common.fmt_bytes(chain_copies.get(name, 0)), f"{chain_diffs[name]:.2g}"]
            for name, s in chain_stats.items()]
    common.print_table(["pipeline A -> B (1x1 conv 3 -> 3), fp16", "median ms", "frames/s", "calls", "bytes copied",
                        "max|diff|"], rows, title="chained pipeline, side by side")
    print(f"pipeline: bound {1e3 / cms[bound_name]:.1f} fps vs copied {1e3 / cms[copied_name]:.1f} fps "
          f"({chain_ratio(copied_name, bound_name):.2f}x); bound / raw {chain_ratio(bound_name, raw_name):.3f}")

    copy_over_bound = ratio("onecopy copy", "onecopy bound")

    def interval(a: str, b: str, table: dict = stats) -> tuple[float, float] | None:
        return common.paired_interval(table[a], table[b])

    # Call by call: onecopy over the engine alone, and what it adds per call (median of the pairs' differences).
    pure = "pure engine compute"
    close_rows, close_ratios = [], {}
    for table, base, label in ((close, pure, "model A"), (close_chain, raw_name, "pipeline")):
        for name, s in table.items():
            if name == base:
                continue
            value, span = common.paired_ratio(s, table[base]), interval(name, base, table)
            added_us = common.paired_difference_ms(s, table[base]) * 1e3
            close_ratios[f"{label}: {name}"] = {"ratio": value, "interval_95": span, "added_us": added_us}
            close_rows.append([f"{label}: {name} / {base}", common.fmt_ms(s.median_ms),
                               common.fmt_ms(table[base].median_ms), s.rounds, f"{value:.3f}",
                               f"{span[0]:.3f}-{span[1]:.3f}" if span else "-", f"{added_us:.1f}"])
    common.print_table(["call by call", "median ms", "engine alone ms", "pairs", "ratio", "95% interval",
                        "added us"], close_rows,
                       title="onecopy over the engine alone, call by call (ratios and differences paired per call)")
    print(f"other processes used {close_others['fraction']:.0%} of the CPUs while timing call by call")

    def close_ratio(name: str, base: str = pure, table: dict = close) -> float:
        return common.paired_ratio(table[name], table[base])

    targets = [
        common.target("bound / pure engine compute (model A)", close_ratio("onecopy bound"), "<=",
                      TARGET_BOUND_OVER_PURE, "issue target (call by call)", interval("onecopy bound", pure, close)),
        common.target("bound, prepared / pure engine compute (model A)", close_ratio("onecopy bound, prepared"), "<=",
                      TARGET_BOUND_OVER_PURE, "issue target (call by call), with the call planned once (Method.prepare)",
                      interval("onecopy bound, prepared", pure, close)),
        common.target("copy / bound (model A)", copy_over_bound, ">=", TARGET_COPY_OVER_BOUND, "issue target",
                      interval("onecopy copy", "onecopy bound")),
        common.target("pipeline bound / pure engine compute", close_ratio(bound_name, raw_name, close_chain), "<=",
                      TARGET_BOUND_OVER_PURE, "for information (call by call): the same threshold applied to the "
                      "A -> B pipeline", interval(bound_name, raw_name, close_chain)),
        common.target("pipeline copied / bound", chain_ratio(copied_name, bound_name), ">=", TARGET_COPY_OVER_BOUND,
                      "for information: the same threshold applied to the A -> B pipeline",
                      interval(copied_name, bound_name, chain_stats)),
    ]
    common.print_targets(targets)
    run.write({
        "what": "median ms per frame, fp16 [1, 3, 1080, 1920], side by side; ratios are paired (onecopy bound's "
                "median over each peer's within each round, median over the rounds)",
        "frame": {"shape": list(SHAPE), "dtype": "float16", "bytes": frame_bytes, "surface_rows": ROWS,
                  "surface_width": WIDTH, "bytes_per_row": WIDTH * 2},
        "models": {"A": "x * a + b per channel (a, b [1, 3, 1, 1] fp16)", "B": "Conv2d(3, 3, kernel_size=1) fp16"},
        "export_s": export_s, "load_with_specialization_s": load_s,
        "onnxruntime_exporter": ort.ort.exporter,
        "model_a": {"stats": stats, "median_ms": ms,
                    "bound_over_peer": {n: common.paired_ratio(stats["onecopy bound"], s) for n, s in stats.items()},
                    "bound_over_peer_ratio_of_medians": {n: ms["onecopy bound"] / v for n, v in ms.items()},
                    "max_abs_diff_vs_torch_fp32": diffs, "copy_stats_bytes": copy_stats,
                    "bound_minus_pure_ms": ms["onecopy bound"] - ms["pure engine compute"],
                    "bound_zero_copy_after_timing": zero_copy_after, "torch_eager_faster_dtype": torch_best},
        "pipeline": {"stats": chain_stats, "median_ms": cms, "frames_per_s": {n: 1e3 / v for n, v in cms.items()},
                     "bytes_copied_per_frame": chain_copies, "max_abs_diff_vs_torch_fp32": chain_diffs,
                     "bound_minus_pure_ms": cms[bound_name] - cms[raw_name],
                     "ratios": {"bound_over_raw": chain_ratio(bound_name, raw_name),
                                "copied_over_bound": chain_ratio(copied_name, bound_name)}},
        "call_by_call": {"model_a": close, "pipeline": close_chain, "ratios": close_ratios,
                         "other_processes_cpu": close_others},
        "targets": targets,
        "all_issue_targets_met": all(t["met"] for t in targets if t["note"].startswith("issue target")),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
