"""Built-in models: the demo's and the benchmarks' reference, reproducible from seed 0."""

from __future__ import annotations

__all__ = ["builtin_model", "builtin_methods", "attention_block", "transformer_encoder", "tiny_llama"]

WIDTH = 1024
LAYERS = 8
METHOD_BATCH = {"forward": 1, "prefill": 16}


def _torch():
    import torch

    return torch


def builtin_model(width: int = WIDTH, layers: int = LAYERS):
    """8 x Linear(1024, 1024) fp32, each followed by ReLU, in eval mode, weights from seed 0."""
    torch = _torch()

    class BuiltinModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    torch.manual_seed(0)
    return BuiltinModel().eval()


def builtin_methods(model=None, batches: dict[str, int] | None = None, width: int = WIDTH):
    """The built-in model's methods as torch.export programs: {"forward": [1, W], "prefill": [16, W]}."""
    torch = _torch()
    model = model if model is not None else builtin_model(width)
    batches = batches if batches is not None else METHOD_BATCH
    return {
        name: torch.export.export(model, (torch.zeros(batch, width),)) for name, batch in batches.items()
    }


def attention_block(dim: int = 64, heads: int = 4, seed: int = 0):
    """A transformer layer (pre-norm self-attention + GELU MLP), in eval mode: the benchmarks' "real" model."""
    torch = _torch()

    class AttentionBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = heads
            self.norm1 = torch.nn.LayerNorm(dim)
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)
            self.norm2 = torch.nn.LayerNorm(dim)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.norm2(x))

    torch.manual_seed(seed)
    return AttentionBlock().eval()


def transformer_encoder(dim: int = 256, heads: int = 4, layers: int = 4, seed: int = 0):
    """torch's own `nn.TransformerEncoder` (post-norm layers, ReLU MLP of 4 x dim, no dropout), in eval mode: the
    small encoder `benchmarks/latency.py` measures at sequence length 128 (4 layers, d=256, 4 heads)."""
    torch = _torch()
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
    # enable_nested_tensor=False: the nested-tensor fast path is for padded batches, which a fixed shape is not.
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def tiny_llama(max_positions: int = 256, seed: int = 0):
    """A tiny random-weight `LlamaForCausalLM` (2 layers, hidden 64, 4 heads with 2 KV heads, vocab 128, fp32), in
    eval mode: the built-in language model of the demo, the tests and benchmarks/llm_decode.py. Needs transformers
    (`pip install 'onecopy[llm]'`)."""
    torch = _torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval()
