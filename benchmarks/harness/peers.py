"""The peers onecopy is timed beside, each called with a numpy array and returning one: torch eager, ONNX Runtime
(the model exported with torch.onnx), a decoder LM's one-token step on ONNX Runtime, and a loaded onecopy Method;
`max_abs_diff` compares their outputs before anything is timed."""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["TorchEager", "OnnxRuntime", "OnnxRuntimeDecoder", "OnecopyMethod", "max_abs_diff"]


class TorchEager:
    """torch eager under torch.no_grad(); takes numpy like the other peers (torch.from_numpy: no copy)."""

    name = "torch eager"

    def __init__(self, model):
        import torch

        self._torch = torch
        self.model = model

    def __call__(self, x):
        torch = self._torch
        with torch.no_grad():
            return self.model(torch.from_numpy(x)).numpy()


class OnnxRuntime:
    """The model exported with torch.onnx.export and run by an InferenceSession on the default CPU execution
    provider with default threading (intra-op threads: one per physical core).

    The export uses torch's default (dynamo) exporter with static shapes; if it fails, the TorchScript exporter
    (dynamo=False). `exporter` says which one made the file.
    """

    name = "onnxruntime"

    def __init__(self, model, example, path: Path):
        import io
        import logging

        import onnxruntime as ort
        import torch

        # "torchvision is not installed. Skipping torchvision::nms": true and beside the point here.
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        self.exporter = "dynamo"
        with torch.no_grad():
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # the dynamo exporter narrates its steps
                    torch.onnx.export(model, (torch.from_numpy(example),), str(path), dynamo=True, verbose=False,
                                      input_names=["x"], output_names=["y"])
            except Exception as e:  # noqa: BLE001  (any exporter failure: fall back to the other exporter)
                print(f"(torch.onnx dynamo exporter failed: {type(e).__name__}; using dynamo=False)")
                self.exporter = "torchscript (dynamo=False)"
                torch.onnx.export(model, (torch.from_numpy(example),), str(path), dynamo=False,
                                  input_names=["x"], output_names=["y"], opset_version=17)
        self.path = path
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.intra_op_threads = self.session.get_session_options().intra_op_num_threads

    def __call__(self, x):
        return self.session.run(None, {"x": x})[0]


class OnnxRuntimeDecoder:
    """A decoder-only LM's one-token step run by ONNX Runtime the way ORT users run decoders: the KV cache as
    inputs and outputs (`past_key.i`/`past_value.i` in, `present_key.i`/`present_value.i` out), fed back each step.

    The exported module is a wrapper around `model` with a transformers `StaticCache` of `max_cache_len` built from
    its k/v inputs each call, so every k/v input and output is [1, kv_heads, max_cache_len, head_dim] (static: the
    same cache shape as onecopy's State); forward(input_ids [1, 1], cache_position [1], k/v...) -> (logits, k/v...).
    Exported with torch's dynamo exporter (`dynamo=False` as a fallback; `exporter` says which).

    `step_iobinding` (what the benchmark times): IOBinding with every input and output bound to preallocated
    buffers, two k/v sets used in turn (one step reads A and writes B, the next reads B and writes A), so nothing
    is allocated or copied between steps; the logits are copied out, as onecopy returns a fresh array.
    `step_run`: plain `InferenceSession.run` with numpy feeds, the outputs fed back. `tokens`: how many tokens a
    step takes (1: a decode step; more: a prefill of that many, input_ids [1, tokens], cache_position [tokens])."""

    def __init__(self, model, max_cache_len: int, path: Path, tokens: int = 1):
        import io
        import logging

        import numpy as np
        import onnxruntime as ort
        import torch
        from transformers import StaticCache

        config = model.config.get_text_config()
        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        class KVStep(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, cache_position, *kv):
                cache = StaticCache(config=self.model.config, max_cache_len=max_cache_len)
                for i, layer in enumerate(cache.layers):
                    keys, values = kv[2 * i].clone(), kv[2 * i + 1].clone()  # written in place by the update
                    layer.dtype, layer.device = keys.dtype, keys.device
                    layer.batch_size, layer.num_heads = keys.shape[:2]
                    layer.k_head_dim = layer.v_head_dim = keys.shape[-1]
                    layer.keys, layer.values = keys, values
                    layer.cumulative_length = cache_position[0].clone()  # where the update writes
                    layer.is_initialized = True
                out = self.model(input_ids=input_ids, cache_position=cache_position, past_key_values=cache,
                                 use_cache=True)
                return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])

        self.kv_names = [f"{n}.{i}" for i in range(layers) for n in ("past_key", "past_value")]
        self.input_names = ["input_ids", "cache_position", *self.kv_names]
        self.output_names = ["logits", *[n.replace("past", "present") for n in self.kv_names]]
        self.kv_shape = (1, kv_heads, max_cache_len, head_dim)
        self.tokens = tokens
        example = (torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens),
                   *[torch.zeros(self.kv_shape) for _ in self.kv_names])
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        wrapper = KVStep().eval()
        self.exporter = "dynamo"
        with torch.no_grad():
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    torch.onnx.export(wrapper, example, str(path), dynamo=True, verbose=False,
                                      input_names=self.input_names, output_names=self.output_names)
            except Exception as e:  # noqa: BLE001  (any exporter failure: fall back to the other exporter)
                print(f"(torch.onnx dynamo exporter failed: {type(e).__name__}: {e}; using dynamo=False)")
                self.exporter = "torchscript (dynamo=False)"
                torch.onnx.export(wrapper, example, str(path), dynamo=False, input_names=self.input_names,
                                  output_names=self.output_names, opset_version=17)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.intra_op_threads = self.session.get_session_options().intra_op_num_threads
        vocab = int(config.vocab_size)
        # IOBinding: the token and position are numpy arrays shared with their OrtValues, rewritten in place.
        self.ids, self.pos = np.zeros((1, tokens), np.int64), np.zeros(tokens, np.int64)
        self.logits = np.zeros((1, tokens, vocab), np.float32)
        sets = [[np.zeros(self.kv_shape, np.float32) for _ in self.kv_names] for _ in range(2)]
        value = ort.OrtValue.ortvalue_from_numpy
        self._kv_sets = sets
        self._bindings = []
        for src, dst in ((0, 1), (1, 0)):
            binding = self.session.io_binding()
            binding.bind_ortvalue_input("input_ids", value(self.ids))
            binding.bind_ortvalue_input("cache_position", value(self.pos))
            for name, arr in zip(self.kv_names, sets[src]):
                binding.bind_ortvalue_input(name, value(arr))
            binding.bind_ortvalue_output("logits", value(self.logits))
            for name, arr in zip(self.output_names[1:], sets[dst]):
                binding.bind_ortvalue_output(name, value(arr))
            self._bindings.append(binding)
        self.reset()

    def reset(self) -> None:
        """An empty cache for both ways of running."""
        import numpy as np

        for arrays in self._kv_sets:
            for a in arrays:
                a.fill(0)
        self._turn = 0
        self._feeds = [np.zeros(self.kv_shape, np.float32) for _ in self.kv_names]

    def step_iobinding(self, ids, position):
        self.ids[...] = ids
        self.pos[...] = range(position, position + self.tokens)
        self.session.run_with_iobinding(self._bindings[self._turn])
        self._turn ^= 1
        return self.logits.copy()

    def step_run(self, ids, position):
        import numpy as np

        positions = np.arange(position, position + self.tokens)
        outs = self.session.run(None, dict(zip(self.input_names, [ids, positions, *self._feeds])))
        self._feeds = outs[1:]
        return outs[0]


class OnecopyMethod:
    name = "onecopy"

    def __init__(self, method):
        self.method = method

    def __call__(self, x):
        return self.method.execute([x])[0]



def max_abs_diff(a, b) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
