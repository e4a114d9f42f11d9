"""Decode latency per token of a tiny random Llama: onecopy (KV cache kept in the engine) vs torch eager with
transformers' StaticCache, side by side in interleaved rounds, at two cache sizes (a step must not cost more
with a larger cache: the update runs in place).

    python benchmarks/llm_decode.py [--rounds 30] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--sizes", default="64,2048")
    args = parser.parse_args()
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from onecopy import Runtime
    from onecopy.llm import export_llm

    model = tiny_llama()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ONECOPY_CACHE_DIR"] = str(Path(tmp) / "cache")
        for size in (int(s) for s in args.sizes.split(",")):
            path = export_llm(model, max_cache_len=size, prefill_tokens=8).save(Path(tmp) / f"llm{size}.onecopy")
            prog = Runtime(cache_dir=Path(tmp) / "cache").load_program(path)
            decode = prog.load_method("decode")
            state = prog.create_state()
            model.generation_config.cache_implementation = "static"
            eager = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=size)
            ids = np.array([[7]], np.int64)
            tid = torch.from_numpy(ids)
            positions = [p % size for p in range(args.calls)]

            def run_onecopy():
                for p in positions:
                    decode.execute([ids, np.array([p])], state=state)

            default_threads = torch.get_num_threads()

            def run_torch_1t():
                # One intra-op thread: on 2 shared cores torch's default (2) ran 5-10x slower when anything else
                # was running, so both are reported.
                torch.set_num_threads(1)
                try:
                    run_torch()
                finally:
                    torch.set_num_threads(default_threads)

            def run_torch():
                with torch.no_grad():
                    for p in positions:
                        # the inner module: the outer wrapper's forward drops cache_position (transformers 5.23)
                        eager.model(input_ids=tid, cache_position=torch.tensor([p]))

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

            peers = {"onecopy": run_onecopy, "raw IREE": run_raw, "torch": run_torch, "torch 1 thread": run_torch_1t}
            times = {name: [] for name in peers}
            for fn in peers.values():  # warm-up
                fn()
            rng = random.Random(0)
            for _ in range(args.rounds):
                order = list(peers)
                rng.shuffle(order)
                for name in order:
                    time.sleep(0.005)
                    start = time.perf_counter()
                    peers[name]()
                    times[name].append((time.perf_counter() - start) / args.calls * 1e3)
            medians = {name: statistics.median(t) for name, t in times.items()}
            paired = statistics.median(a / b for a, b in zip(times["onecopy"], times["torch"]))
            paired_1t = statistics.median(a / b for a, b in zip(times["onecopy"], times["torch 1 thread"]))
            over_raw = statistics.median(a / b for a, b in zip(times["onecopy"], times["raw IREE"]))
            cache_mib = sum(state.read(n).nbytes for n in state.names()) / 2**20
            rows.append({"max_cache_len": size, "cache_mib": round(cache_mib, 3),
                         "ms_per_token": {k: round(v, 4) for k, v in medians.items()},
                         "onecopy_over_torch": round(paired, 3), "onecopy_over_torch_1_thread": round(paired_1t, 3),
                         "onecopy_over_raw_iree": round(over_raw, 3)})
            print(f"max_cache_len {size:5d} ({cache_mib:6.2f} MiB cache): onecopy {medians['onecopy']:.3f} ms/token, "
                  f"raw IREE {medians['raw IREE']:.3f}, torch eager {medians['torch']:.3f} (1 thread "
                  f"{medians['torch 1 thread']:.3f}); onecopy / torch {paired:.3f} (1 thread {paired_1t:.3f}), "
                  f"onecopy / raw IREE {over_raw:.3f} (paired by round)")
            prog.close()
    scaling = update_scaling()
    out = Path(__file__).parent / "results" / "llm_decode.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                               "load_avg": os.getloadavg(), "torch": torch.__version__, "rows": rows,
                               "update_vs_cache_size": scaling}, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
