"""Decode latency per token of a tiny random Llama (2 layers, d=64, seed 0), side by side in interleaved rounds,
at two cache sizes:

- onecopy: `decode` of an `export_llm` program, the KV cache a State kept in the engine;
- raw IREE: the same engine function called through iree.runtime, no onecopy in between;
- torch eager with transformers' StaticCache, default threads and 1 thread;
- ONNX Runtime with the KV cache as inputs and outputs (`common.OnnxRuntimeDecoder`: a static cache of the same
  max_cache_len, past k/v in, present k/v out, fed back each step), timed with IOBinding (preallocated buffers,
  two k/v sets in turn) and with plain `InferenceSession.run`.

Every peer's logits are checked against torch eager for a few steps before timing. The issue's targets: decode
<= 0.75x ONNX Runtime per token, <= 0.5x torch eager. Then, at each cache size, one prefill of a 32-token prompt
(the `prefill` method; ORT's [1, 32] step of the same wrapper; torch eager), checked against torch and timed the
same way. Last, a step's cost with an 8 vs 128 MiB cache (a step must not cost more with a larger cache: the
update runs in place).

    python benchmarks/llm_decode.py [--rounds 30] [--calls 20] [--sizes 64,2048]
    python benchmarks/llm_decode.py --model smollm-135m --sizes 512 --rounds 10 --calls 5

`--model smollm-135m`: the same comparisons on a random Llama of SmolLM-135M's shape (30 layers, d=576, 9 heads
with 3 KV heads, MLP 1536, vocab 49152, tied embeddings: 134.5 M parameters, 538 MB in fp32), where decode
streams the weights from memory each token rather than from cache: what a user's real model costs. Its results
go to results/llm_decode_smollm-135m.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import common

PREFILL_TOKENS = 32  # one prefill call: a 32-token prompt
MODELS = ("tiny", "smollm-135m")


def _model(name: str):
    """The model timed: the demo's tiny Llama, or a random Llama of SmolLM-135M's shape (seed 0)."""
    from onecopy.models import tiny_llama

    if name == "tiny":
        return tiny_llama(max_positions=4096)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


class _Step(torch.nn.Module):
    """One Linear(1024) and an index_copy_ of its result into a cache of `rows` x 1024 (f32)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.w = torch.nn.Linear(1024, 1024, bias=False)
        self.register_buffer("cache", torch.zeros(rows, 1024))

    def forward(self, x, pos):
        y = self.w(x)
        self.cache.index_copy_(0, pos, y)
        return y.sum(-1)


def update_scaling(sizes=(2048, 32768)) -> list[dict]:
    """A step's cost with an 8 MiB and a 128 MiB cache, same weights: the update runs in place, so ~equal."""
    from onecopy import Runtime
    from onecopy.export import CompileSpec, export_program

    rows = []
    for n in sizes:
        torch.manual_seed(0)
        ep = torch.export.export(_Step(n), (torch.zeros(1, 1024), torch.tensor([0])))
        program = export_program({"step": ep}, compile_spec=CompileSpec(packaging="mlir"))
        with Runtime().load_program(program.to_bytes()) as prog:
            step, state = prog.load_method("step"), prog.create_state()
            x = np.ones((1, 1024), np.float32)
            for i in range(20):
                step.execute([x, np.array([i])], state=state)
            blocks = []
            for _ in range(7):
                start = time.perf_counter()
                for i in range(50):
                    step.execute([x, np.array([(i * 7) % n])], state=state)
                blocks.append((time.perf_counter() - start) / 50 * 1e3)
        mib = n * 1024 * 4 / 2**20
        rows.append({"cache_mib": mib, "ms_per_step": round(statistics.median(blocks), 4)})
        print(f"in-place update, cache {mib:5.0f} MiB: {statistics.median(blocks):.3f} ms/step")
    return rows


def _one_thread(run):
    """`run` with torch on one intra-op thread: on 2 shared cores torch's default (2) ran 5-10x slower when anything
    else was running, so both are reported."""

    def run_1t():
        default_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run()
        finally:
            torch.set_num_threads(default_threads)

    return run_1t


def prefill_row(model, prog, eager, size: int, work: Path, rounds: int) -> dict:
    """One prefill of PREFILL_TOKENS tokens from position 0 (the prompt's cost before the first token), onecopy vs
    torch eager vs ONNX Runtime (the cache as inputs/outputs, a [1, PREFILL_TOKENS] step), each checked against
    torch on a fresh cache first."""
    from transformers import StaticCache

    prefill, state = prog.load_method("prefill"), prog.create_state()
    ort = common.OnnxRuntimeDecoder(model, size, work / f"prefill{size}.onnx", tokens=PREFILL_TOKENS)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, PREFILL_TOKENS)).astype(np.int64)
    positions, tid = np.arange(PREFILL_TOKENS), torch.from_numpy(ids)
    with torch.no_grad():
        want = model(input_ids=tid, cache_position=torch.from_numpy(positions), use_cache=True,
                     past_key_values=StaticCache(config=model.config, max_cache_len=size)).logits.numpy()
    got = {"onecopy": prefill.execute([ids, positions], state=state)[0],
           "onnxruntime IOBinding": ort.step_iobinding(ids, 0), "onnxruntime run": ort.step_run(ids, 0)}
    diffs = {name: common.max_abs_diff(value, want) for name, value in got.items()}
    if max(diffs.values()) > 1e-4:
        raise SystemExit(f"a peer's prefill computes something else than torch: {diffs}")
    def run_torch():
        with torch.no_grad():
            eager.model(input_ids=tid, cache_position=torch.from_numpy(positions))

    def run_ort_run():
        ort.reset()  # an empty cache each time, as the other peers' prefill writes positions 0.. again
        ort.step_run(ids, 0)

    peers = {"onecopy": lambda: prefill.execute([ids, positions], state=state), "torch": run_torch,
             "torch 1 thread": _one_thread(run_torch), "onnxruntime IOBinding": lambda: ort.step_iobinding(ids, 0),
             "onnxruntime run": run_ort_run}
    times = common.measure_blocks(peers, 1, rounds=rounds)
    state.close()
    ort_best = max(("onnxruntime IOBinding", "onnxruntime run"), key=lambda m: _paired(times, "onecopy", m))
    return {"tokens": PREFILL_TOKENS, "ms": {k: round(statistics.median(v), 4) for k, v in times.items()},
            "max_abs_diff_logits_vs_torch": diffs, "ort_best_mode": ort_best,
            "onecopy_over": {peer: _paired(times, "onecopy", peer) for peer in peers if peer != "onecopy"},
            "onecopy_over_ort_interval_95": _interval(times, "onecopy", ort_best)}


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    return round(statistics.median(x / y for x, y in zip(times[a], times[b])), 3)


def _interval(times: dict[str, list[float]], a: str, b: str, resamples: int = 2000) -> list[float]:
    """95% bootstrap interval of the paired ratio (rounds resampled, seeded)."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [round(meds[int(0.025 * resamples)], 3), round(meds[int(0.975 * resamples) - 1], 3)]


def _target(name: str, times: dict[str, list[float]], peer: str, threshold: float) -> dict:
    value, (low, high) = _paired(times, "onecopy", peer), _interval(times, "onecopy", peer)
    verdict = "met" if value <= threshold else "not met"
    if low <= threshold <= high:
        verdict += " (unresolved)"
    return {"name": name, "peer": peer, "value": value, "interval_95": [low, high], "threshold": threshold,
            "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--sizes", default="64,2048")
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="first wait (up to SECONDS) for other processes to leave the CPUs idle")
    args = parser.parse_args()
    if args.wait_quiet:
        common.wait_quiet(args.wait_quiet)
    cpu_start = common.cpu_snapshot()
    from transformers import StaticCache
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from onecopy import Runtime
    from onecopy.llm import export_llm
    machine = common.machine_info()
    model = _model(args.model)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {parameters / 1e6:.1f} M parameters")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ONECOPY_CACHE_DIR"] = str(Path(tmp) / "cache")
        for size in (int(s) for s in args.sizes.split(",")):
            path = export_llm(model, max_cache_len=size, prefill_tokens=PREFILL_TOKENS).save(
                Path(tmp) / f"llm{size}.onecopy")
            prog = Runtime(cache_dir=Path(tmp) / "cache").load_program(path)
            decode = prog.load_method("decode")
            state = prog.create_state()
            model.generation_config.cache_implementation = "static"
            eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=size)
            ort = common.OnnxRuntimeDecoder(model, size, Path(tmp) / f"llm{size}.onnx")

            # Every peer computes the same decode: a few steps from an empty cache against torch eager with a
            # fresh StaticCache of the same length, before anything is timed.
            reference_cache = StaticCache(config=model.config, max_cache_len=size)
            check_state = prog.create_state()
            diffs = {"onecopy": 0.0, "onnxruntime IOBinding": 0.0, "onnxruntime run": 0.0}
            for p, token in enumerate([7, 3, 99, 12, 5, 42]):
                with torch.no_grad():
                    want = model(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([p]),
                                 past_key_values=reference_cache, use_cache=True).logits.numpy()
                ids_p = np.array([[token]], np.int64)
                got = {"onecopy": decode.execute([ids_p, np.array([p])], state=check_state)[0],
                       "onnxruntime IOBinding": ort.step_iobinding(ids_p, p),
                       "onnxruntime run": ort.step_run(ids_p, p)}
                for name, value in got.items():
                    diffs[name] = max(diffs[name], common.max_abs_diff(value, want))
            ort.reset()
            print(f"onnxruntime peer: static KV cache of {size} tokens as inputs/outputs, exporter {ort.exporter}, "
                  f"intra-op threads {ort.intra_op_threads or 'default'}; timed with IOBinding and with run()")
            print(f"max_cache_len {size}: max |logits - torch| over 6 decode steps: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
            if max(diffs.values()) > 1e-4:
                raise SystemExit(f"a peer computes something else than torch: {diffs}")

            ids = np.array([[7]], np.int64)
            tid = torch.from_numpy(ids)
            positions = [p % size for p in range(args.calls)]

            def run_onecopy():
                for p in positions:
                    decode.execute([ids, np.array([p])], state=state)

            def run_torch():
                with torch.no_grad():
                    for p in positions:
                        # the inner module: the outer wrapper's forward drops cache_position (transformers 5.23)
                        eager.model(input_ids=tid, cache_position=torch.tensor([p]))

            def run_ort_iobinding():
                for p in positions:
                    ort.step_iobinding(ids, p)

            def run_ort_run():
                for p in positions:
                    ort.step_run(ids, p)

            # The same engine function called raw, in a context of its own (another State's): what onecopy adds.
            whole = decode._whole_call
            handle = decode._delegates[whole.delegate]
            function, raw_state = handle._function, handle.create_state()
            arg_order = [decode._definition.inputs.index(v) for v in whole.inputs]
            rt = function.rt

            def run_raw():
                for p in positions:
                    arrays = [ids, np.array([p])]
                    args = rt.VmVariantList(2)
                    for i in arg_order:
                        args.push_ref(function.copy_in(arrays[i]))
                    results = rt.VmVariantList(1)
                    raw_state.context.invoke(function.vm_function, args, results)
                    view = results.get_as_object(0, rt.HalBufferView)
                    np.array(view.map().asarray(tuple(view.shape), np.dtype(np.float32)))

            peers = {"onecopy": run_onecopy, "raw IREE": run_raw, "torch": run_torch,
                     "torch 1 thread": _one_thread(run_torch), "onnxruntime IOBinding": run_ort_iobinding,
                     "onnxruntime run": run_ort_run}
            times = common.measure_blocks(peers, args.calls, rounds=args.rounds)
            medians = {name: statistics.median(t) for name, t in times.items()}
            # ORT's best configuration: the mode onecopy compares worst with (paired by round).
            ort_best = max(("onnxruntime IOBinding", "onnxruntime run"), key=lambda m: _paired(times, "onecopy", m))
            ratios = {"onecopy_over_ort": _paired(times, "onecopy", ort_best),
                      "onecopy_over_ort_iobinding": _paired(times, "onecopy", "onnxruntime IOBinding"),
                      "onecopy_over_ort_run": _paired(times, "onecopy", "onnxruntime run"),
                      "onecopy_over_torch": _paired(times, "onecopy", "torch"),
                      "onecopy_over_torch_1_thread": _paired(times, "onecopy", "torch 1 thread"),
                      "onecopy_over_raw_iree": _paired(times, "onecopy", "raw IREE")}
            cache_mib = sum(state.read(n).nbytes for n in state.names()) / 2**20
            targets = [
                _target("decode per token, onecopy / ONNX Runtime (its best mode)", times, ort_best, 0.75),
                _target("decode per token, onecopy / torch eager (default threads)", times, "torch", 0.5),
                _target("decode per token, onecopy / torch eager 1 thread (information)", times, "torch 1 thread", 0.5),
            ]
            prefill = prefill_row(model, prog, eager, size, Path(tmp), args.rounds)
            rows.append({"max_cache_len": size, "cache_mib": round(cache_mib, 3),
                         "ms_per_token": {k: round(v, 4) for k, v in medians.items()},
                         "max_abs_diff_logits_vs_torch": diffs, "ort_best_mode": ort_best, **ratios,
                         "targets": targets, "prefill": prefill})
            common.print_table(
                ["peer", "ms/token", "onecopy ÷ peer (paired)"],
                [[name, f"{medians[name]:.3f}", "" if name == "onecopy" else f"{_paired(times, 'onecopy', name):.3f}"]
                 for name in peers],
                title=f"max_cache_len {size} ({cache_mib:.2f} MiB cache), {args.rounds} rounds x {args.calls} tokens")
            for t in targets:
                print(f"  {t['name']} [{t['peer']}]: {t['value']:.3f} [{t['interval_95'][0]:.3f}-"
                      f"{t['interval_95'][1]:.3f}] (target <= {t['threshold']}: {t['verdict']})")
            common.print_table(
                ["peer", "ms per prefill", "onecopy ÷ peer (paired)"],
                [[name, f"{ms:.3f}", "" if name == "onecopy" else f"{prefill['onecopy_over'][name]:.3f}"]
                 for name, ms in prefill["ms"].items()],
                title=f"prefill of {PREFILL_TOKENS} tokens, max_cache_len {size}, {args.rounds} rounds "
                      f"(max |logits - torch| {max(prefill['max_abs_diff_logits_vs_torch'].values()):.1e})")
            prog.close()
    scaling = update_scaling()
    machine["load_average_end"] = list(os.getloadavg())
    others = common.foreign_cpu(cpu_start)
    print(f"other processes used {others['fraction']:.0%} of the CPUs during the run")
    name = "llm_decode.json" if args.model == "tiny" else f"llm_decode_{args.model}.json"
    out = Path(__file__).parent / "results" / name
    out.write_text(json.dumps({
        "machine": machine, "model": args.model, "parameters": parameters, "rounds": args.rounds,
        "calls_per_block": args.calls,
        "onnxruntime_peer": {
            "cache": "static: k/v inputs and outputs of max_cache_len tokens (StaticCache), fed back each step",
            "exporter": ort.exporter, "intra_op_threads": ort.intra_op_threads or "default (one per physical core)",
            "timed_modes": {"onnxruntime IOBinding": "run_with_iobinding, all inputs/outputs bound to preallocated "
                                                     "buffers, two k/v sets in turn (no copy between steps)",
                            "onnxruntime run": "InferenceSession.run with numpy feeds, outputs fed back"}},
        "other_processes_cpu": others, "rows": rows, "update_vs_cache_size": scaling}, indent=2, default=str))
    print("wrote", out)

if __name__ == "__main__":
    main()
