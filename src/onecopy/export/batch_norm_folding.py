"""Eval-mode batch norms folded into the convolution before them, in a `torch.export` program.

Why: `openvino.convert_model` folds each such batch norm into its convolution's weights, so the OpenVINO IR's
weights would no longer be torch's bytes and the program file would hold a second copy of nearly every
convolution weight (ResNet-18: 44.7 of 46.7 MB, measured). Folding in torch first, for both delegates, gives IREE
and OpenVINO the same weights: OpenVINO then keeps them as they are (ResNet-18: 42 of 44 constants, all but 32
bytes, are parameters IREE reads too). Outputs move by float rounding only (ResNet-18: 9e-8).

A batch norm is folded when it is `aten.batch_norm` in eval mode reading a 2-D convolution used by nothing else,
whose weight (and bias, if any) and the batch norm's bias are parameters used by nothing else (folding rewrites
their values) and whose statistics are buffers. Others stay as they are.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.export import ExportedProgram

__all__ = ["fold_batch_norms"]

log = logging.getLogger("onecopy")
aten = torch.ops.aten


def fold_batch_norms(ep: ExportedProgram, method: str) -> ExportedProgram:
    """A copy of `ep` with its foldable batch norms folded (the caller's program and model are left as they are)."""
    ep = copy.deepcopy(ep)
    graph = ep.graph_module.graph
    state = ep.state_dict
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}

    def target(node, kind: str) -> str | None:
        spec = specs.get(node.name) if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None
        return spec.target if spec is not None and spec.kind.name == kind and spec.target in state else None

    folded = 0
    for bn in list(graph.nodes):
        if bn.op != "call_function" or bn.target is not aten.batch_norm.default or bn.args[5]:
            continue
        conv, gamma, beta, mean, var = bn.args[:5]
        eps = bn.args[7]
        if not (isinstance(conv, torch.fx.Node) and conv.target is aten.conv2d.default and len(conv.users) == 1):
            continue
        weight = conv.args[1]
        bias = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
        names = [target(weight, "PARAMETER"), target(gamma, "PARAMETER"), target(beta, "PARAMETER"),
                 target(mean, "BUFFER"), target(var, "BUFFER")]
        bias_name = target(bias, "PARAMETER") if bias is not None else ""
        if None in names or bias_name is None or len(weight.users) != 1 or len(beta.users) != 1 or (
                bias is not None and len(bias.users) != 1):
            continue
        w, g, b, m, v = (state[n].detach() for n in names)
        scale = g / torch.sqrt(v + eps)
        shift = (state[bias_name].detach() if bias is not None else torch.zeros_like(m)) - m
        state[names[0]] = torch.nn.Parameter((w * scale.reshape(-1, 1, 1, 1)).contiguous(), requires_grad=False)
        # The batch norm's bias parameter holds the folded bias: the convolution reads it as its own.
        state[names[2]] = torch.nn.Parameter((shift * scale + b).contiguous(), requires_grad=False)
        args = list(conv.args) + [None] * (3 - len(conv.args))
        args[2] = beta
        conv.args = tuple(args)
        conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
        bn.replace_all_uses_with(conv)
        graph.erase_node(bn)
        folded += 1
    if folded:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
        log.info("method %s: %d batch norms folded into their convolutions (both delegates read the same weights)",
                 method, folded)
    return ep
