"""An op IREE cannot compile is found at export, not at the first load: it runs on a host kernel or fails there."""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import UnsupportedOperator
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, export_program
from onecopy.export import culprits as culprits_module
from onecopy.export.lowering import CompileFailed
from onecopy.delegate.targets import host_cpu_target
from onecopy.runtime import host_kernels
from tests.conftest import PACKAGINGS, eager


class GroupedConv(torch.nn.Module):
    """A dense 1x1 conv IREE compiles, then a grouped 3-D conv it cannot legalize (IREE 3.13)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = torch.nn.Conv3d(8, 8, 1)
        self.conv = torch.nn.Conv3d(8, 8, 3, groups=8)

    def forward(self, x):
        return torch.relu(self.conv(self.pre(x)))  # GROUPED_CONV_LINE


GROUPED_CONV_LINE = next(
    i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith("# GROUPED_CONV_LINE")
)


@pytest.fixture(scope="module")
def grouped_conv():
    torch.manual_seed(0)
    model = GroupedConv().eval()
    return model, torch.export.export(model, (torch.zeros(1, 8, 6, 6, 6),))


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    tensor = lambda a: None if a is None else torch.from_numpy(np.array(a))  # noqa: E731
    return torch.ops.aten.convolution.default(
        tensor(x), tensor(w), tensor(b), stride, padding, dilation, transposed, output_padding, groups
    ).numpy()


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_op_iree_cannot_compile_fails_the_export_naming_op_node_and_line(grouped_conv, packaging):
    _, ep = grouped_conv
    with pytest.raises(UnsupportedOperator) as caught:
        export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging))
    message = str(caught.value)
    assert message.startswith(
        "Method 'forward': IREE cannot compile operator 'aten.convolution.default' (node 'convolution_1' at "
    ), message
    assert f"{__file__}:{GROUPED_CONV_LINE} `return torch.relu(self.conv(self.pre(x)))  # GROUPED_CONV_LINE`)" in message
    assert "failed to legalize operation 'torch.aten.convolution'" in message
    assert "register_host_kernel('aten.convolution.default', fn)" in message


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_op_iree_cannot_compile_runs_on_its_host_kernel(grouped_conv, packaging, monkeypatch, caplog, rng):
    model, ep = grouped_conv
    monkeypatch.setitem(host_kernels._kernels, "aten.convolution.default", _convolution)
    with caplog.at_level(logging.WARNING, logger="onecopy"):
        program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging))
    assert any("node 'convolution_1'" in r.getMessage() and "runs on the host kernel" in r.getMessage()
               for r in caplog.records)
    instructions = program.definition.methods[0].instructions
    # Only the grouped conv moved: the dense one stays in the engine.
    assert [getattr(i, "op", "delegate") for i in instructions] == ["delegate", "aten.convolution.default", "delegate"]
    x = rng.standard_normal((1, 8, 6, 6, 6), dtype=np.float32)
    with Runtime().load_program(program.to_bytes()) as loaded:
        (got,) = loaded.load_method("forward").execute([x])
    np.testing.assert_allclose(got, eager(model, x)[0], rtol=1e-5, atol=1e-5)


def test_check_can_be_turned_off(grouped_conv):
    _, ep = grouped_conv
    program = export_program({"forward": ep}, compile_spec=CompileSpec(check_compiles=False))
    assert len(program.definition.methods[0].instructions) == 1


def test_check_compiles_must_be_a_bool():
    with pytest.raises(InvalidArgument, match="CompileSpec.check_compiles expects bool, got int"):
        CompileSpec(check_compiles=1)


class Chain(torch.nn.Module):
    def forward(self, x):
        return torch.sigmoid(torch.tanh(torch.relu(x) + 1) * 2) - 1


def test_a_failure_naming_no_op_is_bisected_to_its_op(monkeypatch):
    """Codegen failures name no torch op: the shortest failing prefix of the partition's ops ends at the culprit."""
    ep = torch.export.export(Chain(), (torch.zeros(2, 4),)).run_decompositions()
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    (tanh,) = [n for n in nodes if "tanh" in str(n.target)]
    trials = []

    def trial(chosen, partition, parameters, failure):
        trials.append(len(chosen))
        return "error: exceeded stack allocation limit" if tanh in chosen else None

    monkeypatch.setattr(culprits_module, "_trial", trial)

    class Part:
        method, index, weights, ranges = "forward", 0, {}, {}

    Part.nodes = nodes
    failure = CompileFailed("error: exceeded stack allocation limit", target=host_cpu_target(), for_host=True)
    (found,) = culprits_module.find_culprits([Part()], failure, {})
    assert found.node is tanh and found.method == "forward"
    assert len(trials) <= 2 + len(nodes).bit_length()  # the whole, log2 prefixes, the culprit alone


def test_reason_is_the_compilers_first_error_without_its_ir():
    text = ("IREE could not compile the bundle for x86_64: <eval_with_key>.18:6:0: error: failed to legalize "
            "operation 'torch.aten.convolution' that was explicitly marked illegal: %12 = \"torch.aten.convolution\"")
    assert culprits_module.reason(text) == (
        "failed to legalize operation 'torch.aten.convolution' that was explicitly marked illegal")


def test_failure_with_an_unbounded_dim_says_max_may_help(grouped_conv):
    model, _ = grouped_conv
    ep = torch.export.export(model, (torch.zeros(2, 8, 6, 6, 6),), dynamic_shapes=({0: torch.export.Dim("N")},))
    with pytest.raises(UnsupportedOperator, match=r"'aten.convolution.default'.*Dimension\(s\) N have no upper bound: "
                                                  r"torch.export.Dim\(..., max=...\) may let IREE compile it."):
        export_program({"forward": ep})
