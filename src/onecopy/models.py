"""Built-in models: the demo's and the benchmarks' reference, reproducible from seed 0."""

from __future__ import annotations

__all__ = ["builtin_model", "builtin_methods"]

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
