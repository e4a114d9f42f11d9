"""Batch norms folded into convolutions before export with an OpenVINO delegate."""

from __future__ import annotations

import torch

from onecopy.export.batch_norm_folding import fold_batch_norms
from tests.conftest import SmallConvNet


def _ops(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_a_folded_program_computes_the_same_and_leaves_the_callers_untouched(conv_net):
    x = torch.randn(2, 3, 16, 16)
    ep = torch.export.export(conv_net, (x,))
    weight = ep.state_dict["conv.weight"].clone()
    folded = fold_batch_norms(ep, "forward")
    assert torch.ops.aten.batch_norm.default not in _ops(folded)
    assert torch.ops.aten.batch_norm.default in _ops(ep)
    assert torch.equal(ep.state_dict["conv.weight"], weight) and torch.equal(conv_net.conv.weight, weight)
    with torch.no_grad():
        torch.testing.assert_close(folded.module()(x), conv_net(x), rtol=1e-5, atol=1e-6)


def test_a_conv_whose_weight_is_shared_is_not_folded():
    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = SmallConvNet().eval()

        def forward(self, x):
            other = torch.nn.functional.conv2d(x, self.net.conv.weight, padding=1)
            return self.net(x), other

    model = Shared().eval()
    folded = fold_batch_norms(torch.export.export(model, (torch.randn(1, 3, 8, 8),)), "forward")
    assert torch.ops.aten.batch_norm.default in _ops(folded)


def test_a_batch_norm_in_training_mode_is_not_folded():
    model = SmallConvNet().train()
    folded = fold_batch_norms(torch.export.export(model, (torch.randn(2, 3, 8, 8),)), "forward")
    assert any("batch_norm" in str(t) for t in _ops(folded))
