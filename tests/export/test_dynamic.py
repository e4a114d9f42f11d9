"""Dynamic dimensions as torch.export makes them: unbounded Dims, sliced examples, sizes across graph breaks."""

import re

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


class CatAndSlice(torch.nn.Module):
    """Outputs whose sizes are expressions of T: 2*T rows and T - 1 rows."""

    def forward(self, x):
        return torch.cat([x, x]) * 2, x[1:] + 1


@pytest.fixture(scope="module")
def unplanned_dynamic():
    ep = torch.export.export(CatAndSlice(), (torch.zeros(4, 8),),
                             dynamic_shapes=({0: torch.export.Dim("T", min=3, max=64)},))
    with Runtime().load_program(export_program({"forward": ep}, memory_planned_outputs=False).to_bytes()) as loaded:
        yield loaded.load_method("forward")


def test_dynamic_outputs_storage_sized_from_the_inputs(unplanned_dynamic, rng):
    forward = unplanned_dynamic
    assert [o.shape for o in forward.method_meta.outputs] == [("2*T", 8), ("T - 1", 8)]
    x = rng.standard_normal((5, 8), dtype=np.float32)
    outs = [np.empty((10, 8), np.float32), np.empty((4, 8), np.float32)]
    results = forward.execute([x], outs)
    assert results[0] is outs[0] and results[1] is outs[1]
    np.testing.assert_array_equal(outs[0], np.concatenate([x, x]) * 2)
    np.testing.assert_array_equal(outs[1], x[1:] + 1)


@pytest.mark.parametrize("shapes, bad, message", [
    ([(9, 8), (4, 8)], 0, r"Output 0 of method 'forward' has shape \[9, 8\]; this call's inputs make it \[10, 8\] "
                          r"\('2\*T' = 10\)"),
    # One row too many: the engine would write 4 rows and return the fifth as it was.
    ([(10, 8), (5, 8)], 1, r"Output 1 of method 'forward' has shape \[5, 8\]; this call's inputs make it \[4, 8\]"),
])
def test_dynamic_output_storage_of_another_size_is_refused_before_running(unplanned_dynamic, rng, shapes, bad,
                                                                           message):
    x = rng.standard_normal((5, 8), dtype=np.float32)
    outs = [np.full(s, 7.0, np.float32) for s in shapes]
    with pytest.raises(ExecutionError, match=message):
        unplanned_dynamic.execute([x], outs)
    assert all((o == 7.0).all() for o in outs)  # nothing written


def test_memory_planned_dynamic_output_storage_is_checked_against_the_inputs(mlp, rng):
    ep = torch.export.export(mlp, (torch.zeros(4, 16),), dynamic_shapes=({0: torch.export.Dim("T", max=64)},))
    with Runtime().load_program(export_program({"forward": ep}).to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        x = rng.standard_normal((5, 16), dtype=np.float32)
        with pytest.raises(ExecutionError, match=r"Output 0 of method 'forward' has shape \[6, 4\]; this call's "
                                                 r"inputs make it \[5, 4\] \('T' = 5\)"):
            forward.execute([x], [np.empty((6, 4), np.float32)])
        out = np.empty((5, 4), np.float32)
        assert forward.execute([x], [out])[0] is out
        np.testing.assert_allclose(out, eager(mlp, x)[0], rtol=1e-5, atol=1e-6)


class PairedRows(torch.nn.Module):
    """y has 2*T rows, x has T: each x row added to two y rows."""

    def forward(self, x, y):
        return x.repeat(2, 1) + y


class FoldedPairs(torch.nn.Module):
    """One input of 2*T rows (T named by no input of its own), folded in pairs."""

    def forward(self, y):
        return y.reshape(-1, 2, 4).sum(1)


@pytest.fixture(scope="module")
def paired_rows():
    t = torch.export.Dim("T", min=1, max=32)
    ep = torch.export.export(PairedRows(), (torch.zeros(3, 4), torch.zeros(6, 4)),
                             dynamic_shapes={"x": {0: t}, "y": {0: 2 * t}})
    return Runtime().load_program(export_program({"forward": ep}).to_bytes())


@pytest.mark.parametrize("rows", [5, 7])
def test_an_input_sized_by_an_expression_of_another_inputs_dim_is_checked(paired_rows, rng, rows):
    """y must have 2*T rows: with fewer the engine would read past its end, with more read it in part."""
    forward = paired_rows.load_method("forward")
    x = rng.standard_normal((3, 4), dtype=np.float32)
    assert [m.shape for m in forward.method_meta.inputs] == [("T", 4), ("2*T", 4)]
    with pytest.raises(ExecutionError, match=rf"Input 1 of method 'forward' has size {rows} at dimension 0; it must "
                                             r"be '2\*T' = 6 \('T' = 3, from this call's inputs\)"):
        forward.execute([x, rng.standard_normal((rows, 4), dtype=np.float32)])
    for t in (3, 5):  # the right sizes run, the checked path and the repeated one
        x, y = rng.standard_normal((t, 4), dtype=np.float32), rng.standard_normal((2 * t, 4), dtype=np.float32)
        for _ in range(2):
            np.testing.assert_allclose(forward.execute([x, y])[0], eager(PairedRows(), x, y)[0], rtol=1e-6)


def test_an_expression_dim_whose_symbol_no_input_names_binds_it_or_refuses(rng):
    t = torch.export.Dim("T", min=1, max=16)
    ep = torch.export.export(FoldedPairs(), (torch.zeros(6, 4),), dynamic_shapes={"y": {0: 2 * t}})
    with Runtime().load_program(export_program({"forward": ep}).to_bytes()) as program:
        forward = program.load_method("forward")
        y = rng.standard_normal((8, 4), dtype=np.float32)
        np.testing.assert_allclose(forward.execute([y])[0], eager(FoldedPairs(), y)[0], rtol=1e-6)
        (expression,) = [d for d in forward.method_meta.inputs[0].shape if isinstance(d, str)]
        (symbol,) = re.findall(r"[A-Za-z_]\w*", expression)  # torch names it ("s47"), not the Dim
        for rows in (5, 34):  # odd; beyond the range
            with pytest.raises(ExecutionError, match=rf"has size {rows} at dimension 0 \('2\*{symbol}'\): no value of "
                                                     rf"'{symbol}' in its exported range \[\d+, 16\] gives that size"):
                forward.execute([rng.standard_normal((rows, 4), dtype=np.float32)])
