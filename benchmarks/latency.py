"""Latency: onecopy Method.execute vs the same module called raw through IREE vs ONNX Runtime vs torch eager.

    python benchmarks/latency.py [--quick]

Models:
- the built-in model (8 x Linear(1024, 1024) + ReLU, fp32): methods forward [1, 1024] and prefill [16, 1024];
- a small transformer encoder (torch's nn.TransformerEncoder: 4 layers, d=256, 4 heads, MLP 1024): methods b1
  [1, 128, 256] and b16 [16, 128, 256].
Each model is exported by onecopy as ONE multifunction portable (mlir) program, loaded with onecopy.Runtime (the
load specializes it for this CPU into a temporary cache), and each method is timed against the peers side by side
(common.measure: warm-up, shuffled interleaved rounds, medians):
- onecopy: Method.execute([x]), as loaded by default: each method on the executor its specialization measured
  faster here (backend option executor="auto": IREE's task workers or the calling thread);
- onecopy parallel / onecopy inline: the same program loaded with backend option executor="parallel" (IREE's task
  workers, local-task) or "inline" (the calling thread, local-sync): what the default chose between;
- raw IREE: the module of onecopy's cache entry called directly through iree.runtime on onecopy's own device (the
  executor the default picked) (common.RawIree);
- onnxruntime: torch.onnx.export + InferenceSession, default CPU execution provider and threading;
- torch eager: the model under torch.no_grad().
A tiny model (one Linear(16, 16)) measures onecopy's own cost per call, where the engine has next to nothing to do.
Then onecopy and raw IREE alone, call by call (common.measure_alternating: one call each per round, thousands of
rounds; both on one IREE device, so nothing needs a pause between them): the runtime overhead, resolved to a
percent or so where the side-by-side rounds (blocks of calls, four peers) span several. On IREE's workers onecopy's
calling thread waits as a batch thread (onecopy.delegate.caller_wait), which moves a call by more than onecopy's
own cost: there the overhead is measured against the raw call waiting the same way, and the plain raw call runs
beside them to show what the wait itself does.

Targets (the issue's): built-in model onecopy/raw IREE <= 1.03 (runtime overhead, call by call), onecopy/ORT <= 0.9,
onecopy/torch eager <= 0.5 at B=16; encoder onecopy/ORT <= 1.0; p90/p50 of onecopy's calls <= 1.3 everywhere. All
in the configuration a user gets: no environment variables, no flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

import common

ENCODER = {"dim": 256, "heads": 4, "layers": 4, "seq": 128, "batch": {"b1": 1, "b16": 16}}
PEERS = ("onecopy", "onecopy parallel", "onecopy inline", "raw IREE", "onnxruntime", "torch eager")
EXECUTORS = {"onecopy parallel": "parallel", "onecopy inline": "inline"}
# (threshold, which rows): the targets per model; "b16" only: the torch target is at B=16.
THRESHOLDS = {
    "builtin": {"raw IREE": (1.03, None), "onnxruntime": (0.9, None), "torch eager": (0.5, "prefill")},
    "encoder": {"raw IREE": (1.03, None), "onnxruntime": (1.0, None)},
}
TAIL = 1.3  # p90 / p50 of onecopy's calls
SAME_WAIT = "raw IREE, caller waits as onecopy's"


def export_models():
    """(label, model, {method: example input}, {method: torch.export program}) for each model measured."""
    import numpy as np
    import torch

    from onecopy.models import METHOD_BATCH, WIDTH, builtin_methods, builtin_model, transformer_encoder

    rng = np.random.default_rng(0)
    builtin = builtin_model()
    examples = {name: rng.standard_normal((batch, WIDTH), dtype=np.float32) for name, batch in METHOD_BATCH.items()}
    yield "builtin", builtin, examples, builtin_methods(builtin)

    encoder = transformer_encoder(ENCODER["dim"], ENCODER["heads"], ENCODER["layers"])
    examples = {name: rng.standard_normal((b, ENCODER["seq"], ENCODER["dim"]), dtype=np.float32)
                for name, b in ENCODER["batch"].items()}
    methods = {name: torch.export.export(encoder, (torch.from_numpy(x),)) for name, x in examples.items()}
    yield "encoder", encoder, examples, methods


def per_call_overhead(work: Path, cache_dir: Path, runtime, budget: float) -> dict:
    """onecopy's own cost per call: a model so small (one Linear(16, 16) + ReLU) that the engine's work is next
    to nothing, onecopy Method.execute vs the same module called raw."""
    import numpy as np

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.models import builtin_methods, builtin_model

    model = builtin_model(width=16, layers=1)
    path = export_program(builtin_methods(model, batches={"forward": 1}, width=16),
                          partitioner=Partitioner(multifunction=True),
                          compile_spec=CompileSpec(packaging="mlir")).save(work / "tiny.onecopy")
    before = common.cache_entries(cache_dir)
    program = runtime.load_program(path)
    method = program.load_method("forward")
    (key,) = common.cache_entries(cache_dir) - before
    x = np.ones((1, 16), np.float32)
    peers = {"onecopy": common.OnecopyMethod(method),
             "raw IREE": common.RawIree(cache_dir / "v1" / "entries" / key, path, "forward_0",
                                        device=common.engine_device(method))}
    stats = common.measure_alternating({p: (lambda f=f: f(x)) for p, f in peers.items()}, budget_s=budget / 2)
    program.close()
    us = {p: stats[p].median_ms * 1e3 for p in peers}
    return {"model": "Linear(16, 16) + ReLU, [1, 16]", "median_us": us, "stats": stats,
            "onecopy_minus_raw_us": common.paired_difference_ms(stats["onecopy"], stats["raw IREE"]) * 1e3}


def describe(label: str, method: str, x) -> str:
    if label == "builtin":
        return f"builtin {method} B={x.shape[0]}"
    return f"encoder B={x.shape[0]} T={x.shape[1]}"


def main() -> int:
    run = common.BenchmarkRun("latency", __doc__)
    import torch  # noqa: F401  (machine_info records its thread count)

    from onecopy import Runtime
    from onecopy.delegate import caller_wait
    from onecopy.delegate.targets import compiler_flags, host_cpu_target
    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.inspect import summarize
    from onecopy.program import DelegateCall, read_program

    run.describe_machine()
    flags = compiler_flags(host_cpu_target(), for_host=True)
    print(f"IREE compile flags of the specialization: {' '.join(flags)}")
    budget = 1.5 if run.quick else 10.0
    close_budget = 1.0 if run.quick else 12.0

    rows, results, targets, programs = [], [], [], []
    with common.temp_workdir("latency") as work, common.isolated_cache(work / "cache") as cache_dir:
        runtime = Runtime(cache_dir=cache_dir)
        for label, model, examples, methods in export_models():
            path = work / f"{label}.onecopy"
            with common.Stopwatch() as export_watch:
                export_program(methods, partitioner=Partitioner(multifunction=True),
                               compile_spec=CompileSpec(packaging="mlir")).save(path)
            export_s = export_watch.seconds
            before = common.cache_entries(cache_dir)
            with common.Stopwatch() as load_watch:
                program = runtime.load_program(path)
                loaded = {name: program.load_method(name) for name in examples}
            load_s = load_watch.seconds
            # The same program on each executor, forced: restored, the same cache entry.
            forced_programs = {peer: runtime.load_program(path, backend_options={"IreeBackend": {"executor": e}})
                               for peer, e in EXECUTORS.items()}
            forced = {peer: {name: p.load_method(name) for name in examples} for peer, p in forced_programs.items()}
            new = common.cache_entries(cache_dir) - before
            if len(new) != 1:
                raise SystemExit(f"expected one new cache entry for the {label} program, found {sorted(new)}")
            key = new.pop()
            entry_dir = cache_dir / "v1" / "entries" / key
            entry_files = {p.name: p.stat().st_size for p in sorted(entry_dir.iterdir()) if p.is_file()}
            program_file = read_program(path)
            parameter_bytes = summarize(program_file, path.stat().st_size).parameter_bytes
            program_file.close()
            encoded_ratio = entry_files.get("encoded.bin", 0) / parameter_bytes if parameter_bytes else None
            models = {id(d.model): d.model for m in loaded.values() for d in m._delegates.values()}.values()
            huge = sum(model.huge_page_bytes() for model in models)
            programs.append({"model": label, "methods": {n: list(x.shape) for n, x in examples.items()},
                             "export_s": export_s, "load_with_specialization_s": load_s, "cache_key": key,
                             "cache_entry_files_bytes": entry_files, "program_bytes": path.stat().st_size,
                             # a non-empty encoded.bin: specialization also ran IREE's parameter encoder
                             "specialization_encoded_parameters": entry_files.get("encoded.bin", 0) > 0,
                             "parameter_bytes": parameter_bytes,
                             # how many copies of the weights the specialization's encoded (packed) form holds
                             "encoded_bytes_over_parameter_bytes": encoded_ratio,
                             # of the packed weights, what this process maps with huge pages (page_map)
                             "packed_weights_on_huge_pages_bytes": huge})
            print(f"\n{label}: exported in {export_s:.1f} s, loaded (specialized) in {load_s:.1f} s, cache entry "
                  f"{key[:12]}: " + ", ".join(f"{n} {b:,} B" for n, b in entry_files.items())
                  + (f"; encoded weights = {encoded_ratio:.2f} x the parameters ({parameter_bytes:,} B)"
                     if encoded_ratio else "") + (f"; mapped with huge pages: {huge / 2**20:.1f} MiB over {len(models)} loaded models" if huge else ""))
            for name, x in examples.items():
                definition = next(m for m in program.definition.methods if m.name == name)
                calls = [i for i in definition.instructions if isinstance(i, DelegateCall)]
                if len(calls) != 1 or len(definition.instructions) != 1:
                    raise SystemExit(f"{label}.{name}: expected one delegate call, got {definition.instructions}")
                function = program.definition.delegates[calls[0].delegate].manifest["function"]
                peers = {
                    "onecopy": common.OnecopyMethod(loaded[name]),
                    **{peer: common.OnecopyMethod(methods[name]) for peer, methods in forced.items()},
                    "raw IREE": common.RawIree(entry_dir, path, function, device=common.engine_device(loaded[name])),
                    "onnxruntime": common.OnnxRuntime(model, x, work / f"{label}-{name}.onnx"),
                    "torch eager": common.TorchEager(model),
                }
                reference = peers["torch eager"](x)
                diffs = {p: common.max_abs_diff(peers[p](x), reference) for p in PEERS if p != "torch eager"}
                snapshot = common.cpu_snapshot()
                stats = common.measure({p: (lambda f=peers[p], x=x: f(x)) for p in PEERS}, budget_s=budget)
                # Call by call, onecopy against the raw call waiting as onecopy's calls wait: onecopy's own cost
                # alone. On IREE's workers onecopy's caller waits as a batch thread (caller_wait), which moves a call
                # by more than that cost (either way); the plain raw call beside it shows by how much.
                close_peers = {"onecopy": peers["onecopy"], "raw IREE": peers["raw IREE"]}
                if common.engine_driver(loaded[name]) == "local-task" and caller_wait.enabled():
                    close_peers[SAME_WAIT] = common.RawIree(entry_dir, path, function, caller_wait=True,
                                                            device=common.engine_device(loaded[name]))
                close = common.measure_alternating({p: (lambda f=f, x=x: f(x)) for p, f in close_peers.items()},
                                                   budget_s=close_budget)
                floor = SAME_WAIT if SAME_WAIT in close else "raw IREE"
                others = common.foreign_cpu(snapshot)
                ratios = {p: common.paired_ratio(stats["onecopy"], stats[p]) for p in PEERS if p != "onecopy"}
                overhead_ratio = common.paired_ratio(close["onecopy"], close[floor])
                overhead_span = common.paired_interval(close["onecopy"], close[floor])
                added_us = common.paired_difference_ms(close["onecopy"], close[floor]) * 1e3
                wait_ratio = common.paired_ratio(close[floor], close["raw IREE"])
                median_ratios = {p: stats["onecopy"].median_ms / stats[p].median_ms for p in PEERS if p != "onecopy"}
                config = f"{describe(label, name, x)} ({common.engine_driver(loaded[name])})"
                tail = stats["onecopy"].p90_ms / stats["onecopy"].median_ms
                rows.append([config] + [common.fmt_ms(stats[p].median_ms) for p in PEERS]
                            + [common.fmt_ms(stats["onecopy"].p90_ms), f"{tail:.2f}"]
                            + [common.fmt_ratio(ratios[p]) for p in PEERS if p != "onecopy"]
                            + [f"{overhead_ratio:.3f}", f"{added_us:.0f}", f"{wait_ratio:.3f}",
                               f"{others['fraction']:.0%}"])
                results.append({
                    "config": config, "model": label, "method": name, "function": function,
                    "input_shape": list(x.shape), "median_ms": {p: stats[p].median_ms for p in PEERS},
                    "p90_ms": {p: stats[p].p90_ms for p in PEERS}, "onecopy_p90_over_p50": tail,
                    "driver": common.engine_driver(loaded[name]),
                    "p90_over_p50": {p: stats[p].p90_ms / stats[p].median_ms for p in ("onecopy", *EXECUTORS)},
                    "stats": stats, "ratios_onecopy_over": ratios, "ratios_of_medians_onecopy_over": median_ratios,
                    "other_processes_cpu": others,
                    "call_by_call": {"stats": close, "raw_compared": floor, "onecopy_over_raw_iree": overhead_ratio,
                                     "interval_95": overhead_span, "onecopy_adds_us": added_us,
                                     # the raw call waiting as onecopy's over the plain raw call (1.0: the same)
                                     "raw_wait_as_onecopy_over_plain_raw": wait_ratio,
                                     "onecopy_over_plain_raw_iree": common.paired_ratio(close["onecopy"],
                                                                                        close["raw IREE"])},
                    "max_abs_diff_vs_torch": diffs,
                    "onnxruntime_intra_op_threads": peers["onnxruntime"].intra_op_threads,
                    "onnx_exporter": peers["onnxruntime"].exporter,
                })
                targets.append(common.target(f"{config}: onecopy p90/p50", tail, "<=", TAIL, "issue target"))
                for peer, (threshold, only) in THRESHOLDS[label].items():
                    if only is not None and name != only:
                        continue
                    note = "issue target"
                    if peer == "raw IREE":  # the runtime overhead: onecopy and the engine alone, call by call
                        targets.append(common.target(f"{config}: onecopy/{peer}", overhead_ratio, "<=", threshold,
                                                     f"{note} (call by call)", overhead_span))
                        continue
                    targets.append(common.target(
                        f"{config}: onecopy/{peer}", ratios[peer], "<=", threshold, note,
                        common.paired_interval(stats["onecopy"], stats[peer]),
                    ))
                del peers
            program.close()
            for forced_program in forced_programs.values():
                forced_program.close()

        overhead = per_call_overhead(work, cache_dir, runtime, budget)

    headers = (["config"] + [f"{p} ms" for p in PEERS] + ["oc p90 ms", "p90/p50"]
               + [f"oc/{p}" for p in PEERS if p != "onecopy"]
               + ["oc/raw call by call", "oc adds us", "raw wait/plain", "others' CPU"])
    common.print_table(headers, rows, title="median time per call (interleaved rounds, after warm-up; the last "
                       "ratios and difference from onecopy and raw IREE alone, paired call by call: on IREE's "
                       "workers the raw call waits as onecopy's does, and 'raw wait/plain' is that raw call over "
                       "the plain raw call of the columns before)")
    for t in targets:
        if "raw IREE" in t["name"]:
            t["note"] += (f"; onecopy's own cost per call, measured on a tiny model in this run: "
                          f"{overhead['onecopy_minus_raw_us']:.0f} us")
    us = overhead["median_us"]
    print(f"\nper-call overhead on a tiny model ({overhead['model']}): onecopy {us['onecopy']:.1f} us, "
          f"raw IREE {us['raw IREE']:.1f} us -> onecopy adds {overhead['onecopy_minus_raw_us']:.1f} us")
    common.print_targets(targets)
    run.write({
        "what": "median ms per call, side by side; ratios are paired: onecopy's median over each peer's within each round, median over the rounds (ratios_of_medians: of the overall medians); the onecopy/raw IREE targets come from call_by_call (onecopy and raw IREE alone, one call each per round)",
        "iree_compile_flags": flags,
        "iree_compile_flags_source": "onecopy.delegate.targets.compiler_flags(host_cpu_target(), for_host=True); "
                                     "when a program's specialization_encoded_parameters is true, specialization "
                                     "also passed iree-compile's --iree-parameter-encoder-* flags",
        "programs": programs,
        "results": results,
        "per_call_overhead_tiny_model": overhead,
        "targets": targets,
        "all_issue_targets_met": all(t["met"] for t in targets if t["note"].startswith("issue target")),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
