"""The demo's LLM rows: a tiny random-weight Llama exported as prefill + decode, its KV cache kept in the engine as
a State. Greedy decode beside torch eager with transformers' static cache (same tokens, checked), the bytes one
decode step copies, and the memory of 4 States over 1 in a fresh process. Without transformers: skipped."""

from __future__ import annotations

from pathlib import Path

from onecopy.demo.children import decode_one, run_child
from onecopy.demo.config import LLM_CACHE_TOKENS, LLM_HINT, LLM_PREFILL_TOKENS, DemoConfig
from onecopy.demo.progress import Steps

__all__ = ["llm_missing", "measure_llm", "measure_llm_rows"]


def llm_missing() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("transformers") is not None else "not installed: transformers"


def measure_llm(out: Path, cache_dir: Path, config: DemoConfig, steps: Steps) -> dict:
    import numpy as np
    import torch

    from onecopy import Runtime
    from onecopy.llm import export_llm
    from onecopy.measure import interleaved, paired_ratio

    steps.start(f"LLM: exporting a tiny random-weight Llama as prefill + decode (cache {LLM_CACHE_TOKENS} tokens)")
    from onecopy.models import tiny_llama

    model = tiny_llama()
    program = export_llm(model, max_cache_len=LLM_CACHE_TOKENS, prefill_tokens=LLM_PREFILL_TOKENS)
    path = program.save(out / "llm.onecopy")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps.done()

    # Before this process loads the program: its mapping would take a share of the child's PSS.
    steps.start("LLM memory: 1 and 4 States of one program (fresh process; its first load compiles the program)")
    states_memory = run_child("memory-llm", str(path), str(cache_dir))
    steps.done()

    steps.start("LLM decode: onecopy (State in the engine) vs torch eager (static cache), interleaved rounds")
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, LLM_PREFILL_TOKENS, dtype=np.int64)
    n = config.llm_tokens
    with Runtime(cache_dir=cache_dir).load_program(path) as prog:
        prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
        state = prog.create_state()
        state_bytes = {name: int(state.read(name).nbytes) for name in state.names()}
        (logits,) = prefill.execute([prompt.reshape(1, -1), np.arange(LLM_PREFILL_TOKENS)], state=state)
        first_onecopy = int(np.argmax(logits[0, -1]))

        def onecopy_decode() -> list[int]:
            # n greedy steps after the prompt; each call writes the same cache slots again (the cache position,
            # not a counter, says where), so every call decodes the same tokens
            tokens, token = [], first_onecopy
            for i in range(n):
                logits = decode_one(decode, state, token, LLM_PREFILL_TOKENS + i)
                token = int(np.argmax(logits[0, -1]))
                tokens.append(token)
            return tokens

        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        generation = model.generation_config
        previous, generation.cache_implementation = generation.cache_implementation, "static"
        try:
            eager = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=LLM_CACHE_TOKENS)
        finally:
            generation.cache_implementation = previous
        with torch.no_grad():
            eager_logits = eager(input_ids=torch.from_numpy(prompt).reshape(1, -1),
                                 cache_position=torch.arange(LLM_PREFILL_TOKENS))
        first_torch = int(eager_logits[0, -1].argmax())

        def torch_decode() -> list[int]:
            tokens, token = [], first_torch
            with torch.no_grad():
                for i in range(n):
                    logits = eager(input_ids=torch.tensor([[token]]),
                                   cache_position=torch.tensor([LLM_PREFILL_TOKENS + i]))
                    token = int(logits[0, -1].argmax())
                    tokens.append(token)
            return tokens

        ours, theirs = [first_onecopy, *onecopy_decode()], [first_torch, *torch_decode()]
        timings = interleaved({"onecopy": onecopy_decode, "torch": torch_decode}, rounds=config.llm_rounds, inner=1,
                              warmup=1)
        # One decode step's copies, measured: what crossed between Python and the engine.
        ids, position = np.array([[ours[-1]]], np.int64), np.array([LLM_PREFILL_TOKENS + n])
        (logits,) = decode.execute([ids, position], state=state)
        stats = decode.last_copy_stats
        io_bytes = ids.nbytes + position.nbytes + logits.nbytes
        state.close()
    cache_bytes = sum(b for name, b in state_bytes.items() if "cache" in name)
    extra = {key: states_memory["4"][key] - states_memory["1"][key] for key in states_memory["4"]}
    return {
        "model": "Llama, random weights (seed 0): 2 layers, hidden 64, 4 heads (2 KV), vocab 128, fp32",
        "max_cache_len": LLM_CACHE_TOKENS, "prefill_tokens": LLM_PREFILL_TOKENS, "decode_tokens": n,
        "weight_bytes": weight_bytes,
        "decode_tokens_per_s": {peer: n / (t.median_ms / 1e3) for peer, t in timings.items()},
        "decode_ms_per_token": {peer: t.median_ms / n for peer, t in timings.items()},
        "onecopy_over": {"torch": paired_ratio(timings["onecopy"], timings["torch"])},
        "greedy_tokens_equal": ours == theirs,
        "tokens": {"onecopy": ours, "torch": theirs},
        "copy_per_decode_step": {
            "state_bytes": sum(state_bytes.values()), "cache_bytes": cache_bytes,
            "copied_in": stats.copied_in, "copied_out": stats.copied_out,
            "token_position_logits_bytes": io_bytes,
            # what was copied beyond the step's own token, position and logits: the cache, if it crossed
            "state_bytes_copied": max(0, stats.copied - io_bytes),
        },
        "states_memory": {
            "state_bytes_per_state": sum(state_bytes.values()), "cache_bytes_per_state": cache_bytes,
            "growth_bytes": states_memory, "three_more_states_bytes": extra,
            "three_more_over_cache": extra["pss"] / (3 * cache_bytes),
            # what each extra State costs beyond its cache (the engine's context for it), from the PSS growth
            "beyond_cache_per_state_bytes": (extra["pss"] - 3 * cache_bytes) / 3,
        },
    }


def measure_llm_rows(out: Path, cache_dir: Path, config: DemoConfig, steps: Steps, console) -> dict:
    """The LLM rows, or why there are none: without transformers they are skipped, and a failure here says so in
    one line and leaves the rest of the demo's figures standing."""
    missing = llm_missing()
    if missing is not None:
        steps.done(3)
        return {"skipped": missing, "hint": LLM_HINT}
    try:
        return measure_llm(out, cache_dir, config, steps)
    except Exception as e:  # noqa: BLE001  (any failure of this section: reported, the rest of the demo stands)
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        console.print(f"the LLM rows failed: {message}", markup=False, highlight=False)
        steps.done(3)
        return {"error": message}
