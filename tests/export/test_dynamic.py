"""Dynamic dimensions as torch.export makes them: unbounded Dims, sliced examples, sizes across graph breaks."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import ExecutionError
from onecopy.export import CompileSpec, Partitioner, export_program
from tests.conftest import PACKAGINGS, eager


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Doubled(torch.nn.Module):
    """A host op between two partitions whose size is an expression of T (2*T)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.a(torch.relu(torch.cat([x, x * 2])))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return Mlp().eval()


def run_at_sizes(program, model, sizes, rng, width=16):
    with Runtime().load_program(program.to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        for t in sizes:
            x = rng.standard_normal((t, width), dtype=np.float32)
            (y,) = forward.execute([x])
            np.testing.assert_allclose(y, eager(model, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_unbounded_dim_serves_two_sizes(mlp, packaging, rng):
    ep = torch.export.export(mlp, (torch.zeros(4, 16),), dynamic_shapes=({0: torch.export.Dim("T")},))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging))
    method = program.definition.methods[0]
    assert method.input_specs[0].shape == ["T", 16]  # the user's name for it, not torch's s31
    assert method.symbols == {"T": [0, None]}
    run_at_sizes(program, mlp, (3, 37), rng)


def test_unbounded_dim_keeps_its_lower_bound(mlp, rng):
    ep = torch.export.export(mlp, (torch.zeros(4, 16),), dynamic_shapes=({0: torch.export.Dim("T", min=3)},))
    program = export_program({"forward": ep})
    assert program.definition.methods[0].symbols == {"T": [3, None]}
    with Runtime().load_program(program.to_bytes()) as loaded:
        with pytest.raises(ExecutionError, match=r"size 2 at dimension 0 \('T'\), outside its exported range \[3, inf\]"):
            loaded.load_method("forward").execute([np.zeros((2, 16), np.float32)])


@pytest.mark.parametrize("example", [
    pytest.param(lambda: torch.zeros(4, 16)[:, :], id="sliced-view"),
    pytest.param(lambda: torch.zeros(4, 32)[:, ::2], id="non-contiguous"),
])
def test_sliced_example_input_exports(mlp, example, rng):
    ep = torch.export.export(mlp, (example(),))
    program = export_program({"forward": ep})
    assert program.definition.methods[0].input_specs[0].shape == [4, 16]
    run_at_sizes(program, mlp, (4,), rng)


def test_expression_size_across_a_graph_break_stays_dynamic(rng):
    # The second partition takes the host relu's result of size 2*T: exported static, it ran only at T = 4.
    torch.manual_seed(0)
    model = Doubled().eval()
    ep = torch.export.export(model, (torch.zeros(4, 16),), dynamic_shapes=({0: torch.export.Dim("T", max=64)},))
    program = export_program({"forward": ep}, partitioner=Partitioner(skip_ops=("aten.relu.default",)))
    method = program.definition.methods[0]
    assert [type(i).__name__ for i in method.instructions] == ["DelegateCall", "HostOp", "DelegateCall"]
    assert method.output_specs[0].shape == ["2*T", 16]
    run_at_sizes(program, model, (4, 5), rng)


def test_unnamed_dynamic_dimension_is_named_by_its_input(mlp):
    ep = torch.export.export(mlp, (torch.zeros(4, 16),), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    program = export_program({"forward": ep})
    assert program.definition.methods[0].input_specs[0].shape == ["x.shape[0]", 16]
