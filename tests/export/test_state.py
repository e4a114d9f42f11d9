"""Export of buffers a method updates in place: program state, shared by name across methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onecopy import ExportError, Runtime
from onecopy.export import CompileSpec, Partitioner, export_program
from tests.conftest import Accumulator, accumulator_methods


@pytest.fixture(scope="session")
def portable(accumulator):
    return export_program(accumulator_methods(accumulator), partitioner=Partitioner(multifunction=True),
                          compile_spec=CompileSpec(packaging="mlir"))


def test_updated_buffers_become_named_typed_states_shared_by_methods(portable):
    states = {s.name: s for s in portable.definition.states}
    assert sorted(states) == ["cache", "steps", "total"]
    assert (states["cache"].spec.shape, states["cache"].spec.dtype) == ([8, 16], "float32")
    assert (states["steps"].spec.shape, states["steps"].spec.dtype) == ([], "int64")
    for method in portable.definition.methods:
        assert sorted(method.states) == ["cache", "steps", "total"]
        assert len(method.inputs) == 2 and len(method.outputs) == 2  # the user's only
    manifests = [d.manifest for d in portable.definition.delegates]
    assert manifests[0]["states"] == manifests[1]["states"]  # one module, one set of globals


def test_zero_states_store_no_bytes_and_others_store_their_initial_value_once(portable):
    states = {s.name: s for s in portable.definition.states}
    assert states["cache"].initial is None and states["steps"].initial is None
    key = states["total"].initial
    assert key is not None
    assert bytes(dict(portable.data.items())[key].data) == torch.ones(16).numpy().tobytes()
    sizes = [blob.data.nbytes for blob in portable.data.unique_blobs()]
    assert 8 * 16 * 4 not in sizes  # no segment the size of the zero cache


class Resized(Accumulator):
    def __init__(self) -> None:
        super().__init__(rows=4)


def test_one_state_with_two_shapes_is_an_export_error():
    methods = {"prefill": torch.export.export(Accumulator(), (torch.zeros(2, 16), torch.tensor([0, 1]))),
               "decode": torch.export.export(Resized(), (torch.zeros(1, 16), torch.tensor([2])))}
    with pytest.raises(ExportError, match="Methods 'prefill' and 'decode' both update buffer 'cache' "
                                          "\\(shared state 'cache'\\) but with different shapes"):
        export_program(methods, compile_spec=CompileSpec(packaging="mlir"))


def test_share_state_false_keeps_a_methods_state_its_own(accumulator):
    methods = accumulator_methods(accumulator)
    program = export_program(
        methods, compile_spec=CompileSpec(packaging="mlir"),
        partitioner={"prefill": Partitioner(), "decode": Partitioner(share_state=False)})
    names = sorted(s.name for s in program.definition.states)
    assert names == ["cache", "decode.cache", "decode.steps", "decode.total", "steps", "total"]


class ReadsStateOnTheHost(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x, pos):
        before = torch.tanh(self.cache)  # tanh on the host would need the cache in Python
        self.cache.index_copy_(0, pos, x)
        return before.sum(0) + self.cache.sum(0)


def test_a_host_op_reading_state_is_refused():
    ep = torch.export.export(ReadsStateOnTheHost(), (torch.zeros(1, 8), torch.tensor([0])))
    with pytest.raises(ExportError, match="host op 'aten.tanh.default' .* reads state 'cache', which only the "
                                          "engine holds"):
        export_program({"decode": ep}, compile_spec=CompileSpec(packaging="mlir"),
                       partitioner=Partitioner(skip_ops=("aten.tanh.default",)))


class UpdatesItsInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


def test_updating_a_user_input_in_place_is_refused():
    ep = torch.export.export(UpdatesItsInput(), (torch.zeros(4),))
    with pytest.raises(ExportError, match="updates its input\\(s\\) x in place.*register_buffer"):
        export_program({"forward": ep}, compile_spec=CompileSpec(packaging="mlir"))


def test_partitioner_share_state_must_be_bool():
    from onecopy import InvalidArgument

    with pytest.raises(InvalidArgument, match="share_state expects bool, got int"):
        Partitioner(share_state=1)


class CountsUp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(4))

    def forward(self, x):
        self.scale.add_(1.0)
        return x * self.scale


class Scales(torch.nn.Module):
    """Another model with a buffer of the same name, only read: its own constant, not CountsUp's state."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full(shape, 3.0))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("shape", [(4,), (1,)], ids=["same-shape", "other-shape"])
def test_a_buffer_of_another_module_named_as_a_state_is_not_read_as_that_state(shape):
    x = torch.ones(4)
    methods = {"count": torch.export.export(CountsUp(), (x,)), "scale": torch.export.export(Scales(shape), (x,))}
    # Unchecked, 'scale' read CountsUp's state (1.0 after one count) instead of its own 3.0: a wrong answer.
    with pytest.raises(ExportError, match="Method 'scale' reads buffer 'scale', which method 'count' updates .* "
                                          "Partitioner\\(share_state=False\\)"):
        export_program(methods, compile_spec=CompileSpec(packaging="mlir"))
    program = export_program(methods, compile_spec=CompileSpec(packaging="mlir"),
                             partitioner={"count": Partitioner(), "scale": Partitioner(share_state=False)})
    with Runtime().load_program(program.to_bytes()) as prog:
        prog.load_method("count").execute([np.ones(4, np.float32)])
        (got,) = prog.load_method("scale").execute([np.ones(4, np.float32)])
        np.testing.assert_array_equal(got, np.full(4, 3.0, np.float32))


class Peeks(torch.nn.Module):
    def __init__(self, counter: CountsUp) -> None:
        super().__init__()
        self.counter = counter

    def forward(self, x):
        return x * self.counter.scale


def test_a_method_reading_a_state_of_the_same_module_reads_it_as_updated():
    class Both(torch.nn.Module):
        def __init__(self, counter: CountsUp) -> None:
            super().__init__()
            self.counter = counter

        def forward(self, x):
            return self.counter(x)

    counter, x = CountsUp(), torch.ones(4)
    methods = {"count": torch.export.export(Both(counter), (x,)),
               "peek": torch.export.export(Peeks(counter), (x,))}
    with Runtime().load_program(export_program(methods, compile_spec=CompileSpec(packaging="mlir")).to_bytes()) as prog:
        for _ in range(2):
            prog.load_method("count").execute([np.ones(4, np.float32)])
        (got,) = prog.load_method("peek").execute([np.ones(4, np.float32)])
        np.testing.assert_array_equal(got, np.full(4, 2.0, np.float32))
