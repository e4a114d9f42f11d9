"""Indices the engine reads or writes at: inputs that index a table are checked before each call, and every index
is kept in range inside the engine (IREE checks none: an embedding fed 10**9 crashed the process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import ExecutionError
from onecopy.export import export_program
from onecopy.export.index_guard import guard_indices


class Lookups(torch.nn.Module):
    """Token ids into an embedding, row indices into a table: read directly (`index_select`), computed
    (`table[rows * 2]`) and negative where torch allows it (`table[-rows]`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 8)
        self.table = torch.nn.Parameter(torch.randn(30, 4))

    def forward(self, ids, rows):
        return (self.embedding(ids).sum(-1), torch.index_select(self.table, 0, rows), self.table[rows * 2],
                self.table[-rows])


IDS, ROWS = np.array([[1, 2, 3], [4, 5, 49]]), np.array([0, 3])


@pytest.fixture(scope="module")
def lookups():
    model = Lookups().eval()
    program = export_program({"forward": torch.export.export(model, (torch.from_numpy(IDS), torch.from_numpy(ROWS)))})
    with Runtime().load_program(program.to_bytes()) as loaded:
        yield model, program, loaded.load_method("forward")


def _eager(model, ids, rows):
    with torch.no_grad():
        return [t.numpy() for t in model(torch.from_numpy(ids), torch.from_numpy(rows))]


def test_inputs_that_index_a_table_record_its_bounds(lookups):
    _, program, _ = lookups
    # rows: index_select takes [0, 29]; table[-rows] is computed (a negation), so it adds nothing
    assert program.definition.methods[0].input_bounds == {0: [0, 49], 1: [0, 29]}


@pytest.mark.parametrize("bad", [50, 10**9, -1])
def test_an_index_outside_its_table_is_refused_on_every_call_path(lookups, bad):
    model, _, forward = lookups
    for _ in range(2):  # the checked call, then the kept one
        for got, want in zip(forward.execute([IDS, ROWS]), _eager(model, IDS, ROWS)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ids = IDS.copy()
    ids[1, 2] = bad
    message = rf"Input 0 of method 'forward' holds {bad}, outside \[0, 49\].*table of 50 entries"
    with pytest.raises(ExecutionError, match=message):
        forward.execute([ids, ROWS])
    with pytest.raises(ExecutionError, match=message):
        forward.execute([ids, ROWS], outputs=[np.zeros(r.shape, r.dtype) for r in _eager(model, IDS, ROWS)])
    given = IDS.copy()
    prepared = forward.prepare([given, ROWS])
    prepared.run()
    given[0, 0] = bad  # a prepared call reads what its arrays hold at each run
    with pytest.raises(ExecutionError, match=message):
        prepared.run()


def test_an_index_computed_past_its_table_reads_a_row_of_it_not_foreign_memory(lookups):
    """rows = 20 passes the input check (index_select's table has 30 rows), but table[rows * 2] reads row 40 of
    30: eager raises; the engine wraps it to row 10, a row of the table, and does not crash."""
    model, _, forward = lookups
    rows = np.array([20, 1])
    got = forward.execute([IDS, rows])
    table = model.table.detach().numpy()
    np.testing.assert_allclose(got[2], table[(rows * 2) % 30], rtol=1e-6)
    np.testing.assert_allclose(got[3], table[-rows], rtol=1e-6)  # negative indices: torch's meaning


def test_index_writes_and_reads_are_wrapped_by_the_indexed_dimension():
    class Scatter(torch.nn.Module):
        def forward(self, x, i, v):
            return x.index_put((i,), v), torch.gather(x, 1, i.unsqueeze(0).expand(4, -1)), x[:, i]

    ep = torch.export.export(Scatter(), (torch.zeros(4, 6), torch.tensor([1, 2]), torch.ones(2, 6)))
    graph = ep.graph_module.graph
    assert guard_indices(graph) == 3
    wrapped = [n for n in graph.nodes if n.target == torch.ops.aten.remainder.Scalar]
    assert sorted(n.args[1] for n in wrapped) == [4, 6, 6]  # index_put: x's rows; gather and x[:, i]: columns
