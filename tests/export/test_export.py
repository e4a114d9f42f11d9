import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import ExportError, InvalidArgument, UnsupportedOperator
from onecopy.export import CompileSpec, Partitioner, export_program
from onecopy.program import read_program
from onecopy.runtime import register_host_kernel
from tests.conftest import PACKAGINGS, AttentionBlock, TwoInTwoOut, accumulator_methods, eager


def run_all(program_bytes_or_path, inputs_by_method):
    with Runtime().load_program(program_bytes_or_path) as program:
        return {name: program.load_method(name).execute(inputs) for name, inputs in inputs_by_method.items()}


def test_builtin_model_matches_torch_eager(builtin, builtin_program, rng):
    x1 = rng.standard_normal((1, 1024), dtype=np.float32)
    x16 = rng.standard_normal((16, 1024), dtype=np.float32)
    results = run_all(builtin_program, {"forward": [x1], "prefill": [x16]})
    np.testing.assert_allclose(results["forward"][0], eager(builtin, x1)[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results["prefill"][0], eager(builtin, x16)[0], rtol=1e-4, atol=1e-5)


def test_builtin_program_stores_each_weight_once(builtin_program):
    loaded = read_program(builtin_program)
    try:
        params = {s.sha256: s.length for s in loaded.definition.segments if s.key.startswith("param/")}
        assert len(params) == 16  # 8 weights + 8 biases, although two methods use them
        assert sum(params.values()) == 8 * (1024 * 1024 + 1024) * 4
    finally:
        loaded.close()


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_graph_break_runs_skipped_ops_on_the_host(small_model, small_methods, packaging, rng):
    program = export_program(
        small_methods,
        partitioner=Partitioner(skip_ops=("aten.relu.default",)),
        compile_spec=CompileSpec(packaging=packaging),
    )
    forward = next(m for m in program.definition.methods if m.name == "forward")
    kinds = [type(i).__name__ for i in forward.instructions]
    assert kinds == ["DelegateCall", "HostOp"] * 3
    assert {i.op for i in forward.instructions if type(i).__name__ == "HostOp"} == {"aten.relu.default"}
    x = rng.standard_normal((1, 64), dtype=np.float32)
    x16 = rng.standard_normal((16, 64), dtype=np.float32)
    results = run_all(program.to_bytes(), {"forward": [x], "prefill": [x16]})
    np.testing.assert_allclose(results["forward"][0], eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["prefill"][0], eager(small_model, x16)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_two_inputs_and_two_outputs(packaging, rng):
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    x = rng.standard_normal((4, 32), dtype=np.float32)
    y = rng.standard_normal((4, 8), dtype=np.float32)
    ep = torch.export.export(model, (torch.from_numpy(x), torch.from_numpy(y)))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging))
    out = run_all(program.to_bytes(), {"forward": [x, y]})["forward"]
    expected = eager(model, x, y)
    assert len(out) == 2
    for got, want in zip(out, expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_attention_block_matches_torch_eager(rng):
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    x = rng.standard_normal((2, 16, 64), dtype=np.float32)
    ep = torch.export.export(model, (torch.from_numpy(x),))
    program = export_program({"forward": ep})
    (got,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    np.testing.assert_allclose(got, eager(model, x)[0], rtol=1e-4, atol=1e-5)


def test_graph_break_inside_attention_uses_the_host_softmax(rng):
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    x = rng.standard_normal((1, 8, 64), dtype=np.float32)
    ep = torch.export.export(model, (torch.from_numpy(x),))
    program = export_program({"forward": ep}, partitioner=Partitioner(skip_ops=("aten._softmax.default",)))
    ops = [getattr(i, "op", None) for i in program.definition.methods[0].instructions]
    assert ops.count("aten._softmax.default") == 1
    (got,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    np.testing.assert_allclose(got, eager(model, x)[0], rtol=1e-4, atol=1e-5)


class CustomScale(torch.nn.Module):
    def forward(self, x):
        return torch.ops.onecopy_test.scale(torch.relu(x), 3.0) + 1


@pytest.fixture(scope="module")
def custom_op():
    lib = torch.library.Library("onecopy_test", "DEF")
    lib.define("scale(Tensor x, float factor) -> Tensor")
    lib.impl("scale", lambda x, factor: x * factor, "CompositeExplicitAutograd")
    lib.impl("scale", lambda x, factor: torch.empty_like(x), "Meta")
    yield "onecopy_test.scale.default"
    lib._destroy()


def test_op_iree_cannot_import_without_host_kernel_fails_naming_it(custom_op):
    ep = torch.export.export(CustomScale(), (torch.zeros(2, 4),))
    with pytest.raises(UnsupportedOperator, match=r"operator 'onecopy_test.scale.default' \(node 'scale'\) can run neither in IREE nor on the host \(IREE cannot import it.*register_host_kernel\('onecopy_test.scale.default', fn\)"):
        export_program({"forward": ep})


def test_op_iree_cannot_import_runs_on_a_registered_host_kernel(custom_op, rng):
    register_host_kernel(custom_op, lambda x, factor: x * np.float32(factor), replace=True)
    ep = torch.export.export(CustomScale(), (torch.zeros(2, 4),))
    program = export_program({"forward": ep})
    ops = [getattr(i, "op", "delegate") for i in program.definition.methods[0].instructions]
    assert ops == ["delegate", custom_op, "delegate"]
    x = rng.standard_normal((2, 4), dtype=np.float32)
    (got,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    np.testing.assert_allclose(got, np.maximum(x, 0) * 3 + 1, rtol=1e-6)


def test_skipped_op_without_host_kernel_fails_at_export(small_methods):
    with pytest.raises(UnsupportedOperator, match=r"operator 'aten.addmm.default' .*it is in skip_ops.* or remove it from skip_ops"):
        export_program(small_methods, partitioner=Partitioner(skip_ops=("aten.addmm.default",)))


def test_weights_used_by_host_ops_are_read_from_named_data(rng):
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.arange(8, dtype=torch.float32))

        def forward(self, x):
            return torch.relu(x * 2) + self.bias

    ep = torch.export.export(Bias().eval(), (torch.zeros(3, 8),))
    program = export_program({"forward": ep}, partitioner=Partitioner(skip_ops=("aten.add.Tensor",)))
    method = program.definition.methods[0]
    assert len(method.constants) == 1
    x = rng.standard_normal((3, 8), dtype=np.float32)
    (got,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    np.testing.assert_allclose(got, np.maximum(x * 2, 0) + np.arange(8), rtol=1e-6)


def test_a_mutated_buffer_is_program_state():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            return x + self.count

    ep = torch.export.export(Counter(), (torch.zeros(2),))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging="mlir"))
    assert [s.name for s in program.definition.states] == ["count"]  # tests/runtime/test_state.py runs them
    assert program.definition.methods[0].states == ["count"]


@pytest.mark.parametrize(
    "methods, message",
    [
        ({}, "non-empty dict"),
        ([1], "non-empty dict"),
        ({"forward": object()}, "Method 'forward' must be a torch.export.ExportedProgram, got object"),
        ({"not a name": None}, "must be a Python identifier"),
    ],
)
def test_bad_methods_are_refused(methods, message):
    with pytest.raises(InvalidArgument, match=message):
        export_program(methods)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"packaging": "inline"}, "Unsupported packaging 'inline'; expected mlir or vmfb."),
        ({"compute_units": "npu"}, "unknown compute units 'npu'"),
        ({"packaging": "vmfb", "targets": ("sparc",)}, "unknown target\\(s\\) 'sparc'"),
        ({"packaging": "mlir", "targets": ("x86_64",)}, "targets apply to packaging='vmfb' only"),
        ({"packaging": "vmfb", "targets": "x86_64"}, "targets is a tuple of target names"),
        ({"packaging": "vmfb", "targets": ("x86_64", "x86_64")}, "name a target twice"),
        ({"packaging": "vmfb", "compute_units": "gpu", "targets": ("x86_64",)}, "compute units 'gpu' but targets"),
        ({"packaging": "vmfb", "precisions": ("bf16",)}, r"precisions \('bf16',\) must start with 'fp32'"),
        ({"packaging": "vmfb", "precisions": ("fp32", "fp32")}, "name each precision once"),
        ({"packaging": "vmfb", "precisions": ("fp32", "f8")}, r"unknown precision\(s\) 'f8'; known: fp32, bf16"),
        ({"packaging": "vmfb", "precisions": "bf16"}, "precisions is a tuple of precision names"),
        ({"packaging": "mlir", "precisions": ("fp32", "bf16")}, "precisions apply to packaging='vmfb' only"),
        ({"packaging": "vmfb", "compute_units": "all", "targets": ("x86_64", "vulkan"), "precisions": ("fp32", "bf16")},
         "precision 'bf16' is compiled ahead of time for CPU targets only .*not vulkan"),
    ],
)
def test_compile_spec_errors(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        CompileSpec(**kwargs)


def test_compile_spec_defaults_vmfb_to_this_machine():
    assert CompileSpec(packaging="vmfb").targets in {("x86_64",), ("aarch64",)}


def test_partitioner_errors(small_methods):
    with pytest.raises(InvalidArgument, match="skip_ops is a tuple of op names"):
        Partitioner(skip_ops="aten.relu.default")
    with pytest.raises(InvalidArgument, match="multifunction expects bool, got int"):
        Partitioner(multifunction=1)
    with pytest.raises(InvalidArgument, match="partitioner must be an onecopy.export.Partitioner or a dict"):
        export_program(small_methods, partitioner="nope")
    with pytest.raises(InvalidArgument, match=r"compile_spec\['prefill'\] must be an onecopy.export.CompileSpec, got str"):
        export_program(small_methods, compile_spec={"forward": CompileSpec(), "prefill": "vmfb"})
    with pytest.raises(InvalidArgument, match=r"partitioner names methods \['forward'\], but the program's methods are \['forward', 'prefill'\]"):
        export_program(small_methods, partitioner={"forward": Partitioner()})


def test_two_exports_of_one_model_have_the_same_export_hash(accumulator):
    # A re-export must find the specialization cache's entry for the same model: the hash is its identity.
    def hashes():
        program = export_program(accumulator_methods(accumulator), partitioner=Partitioner(multifunction=True),
                                 compile_spec=CompileSpec(packaging="mlir", check_compiles=False))
        return [d.manifest["export_hash"] for d in program.definition.delegates]

    assert hashes() == hashes()


def test_two_exports_of_one_graph_broken_model_store_the_same_bundles(small_methods):
    def bundles():
        program = export_program(small_methods, partitioner=Partitioner(skip_ops=("aten.relu.default",)),
                                 compile_spec=CompileSpec(packaging="mlir", check_compiles=False))
        data = dict(program.data.items())
        return [bytes(data[d.manifest["bundle"]["portable"]].data) for d in program.definition.delegates]

    first = bundles()
    assert len(first) == 6 and first == bundles()


class Precise(torch.nn.Module):
    """float64 in and out, with a step float32 would lose: 1e-12 added to values near 1."""

    def forward(self, x):
        return (x + 1e-12) * 2 - 2


@pytest.mark.parametrize("packaging", PACKAGINGS)
def test_float64_inputs_and_outputs_compute_in_float64(packaging, rng):
    x = np.ones(8) + rng.standard_normal(8) * 1e-9
    ep = torch.export.export(Precise(), (torch.from_numpy(x),))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(packaging=packaging))
    (y,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, eager(Precise(), x)[0], rtol=0, atol=1e-15)  # float32 would be off by ~1e-7


class PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


class FlagState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4, dtype=torch.bool))

    def forward(self, x):
        self.seen.logical_or_(x > 0)
        return self.seen.float()


def test_a_bool_state_is_refused_at_export_with_what_to_keep_instead():
    ep = torch.export.export(FlagState(), (torch.zeros(4),))
    with pytest.raises(ExportError, match=r"State 'seen' is bool, which the engine cannot keep between calls\. Keep "
                                          r"it as an integer buffer"):
        export_program({"forward": ep})


class HalfState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, x):
        self.total.add_(x.to(torch.bfloat16))
        return self.total.float()


@pytest.mark.parametrize(("model", "example", "named"), [
    (PlusOne, torch.zeros(4, dtype=torch.bfloat16), r"Method 'forward', input 'x': 'x' is bfloat16"),
    (HalfState, torch.zeros(4), r"State 'total' is bfloat16"),
])
def test_a_bfloat16_tensor_the_runtime_would_hand_over_is_refused_at_export(model, example, named):
    """numpy has no bfloat16: such a program could never load, so no file is written."""
    ep = torch.export.export(model(), (example,))
    with pytest.raises(ExportError, match=named + r", which the runtime cannot hand over: numpy has no such dtype .*"
                                          r"load it with precision='bf16'"):
        export_program({"forward": ep})


class Positives(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0)


def test_a_size_the_data_decides_is_refused_at_export_naming_the_op():
    ep = torch.export.export(Positives(), (torch.randn(5),))
    with pytest.raises(ExportError, match=r"Method 'forward': 'nonzero' \(nonzero.default\) has a size that depends "
                                          r"on the data \(\[u\d+, 1\]\).*torch.where\(mask, x, 0\)"):
        export_program({"forward": ep})


class ScaledBySum(torch.nn.Module):
    def forward(self, x):
        return x * (x.sum() + 1.0).item()


@pytest.mark.parametrize("skip_ops", [(), ("aten.sum.default",)])
def test_a_scalar_read_from_the_data_is_computed_where_its_tensor_is(skip_ops, rng):
    """`t.item()` of a tensor the method computes is a SymFloat node, which a partition recomputes as it does a
    size: it was copied ahead of the tensor it reads (KeyError: 'sum_1'), and its range [-oo, oo] failed
    int() (TypeError). On the host (a graph break) its tensor is the partition's input."""
    ep = torch.export.export(ScaledBySum(), (torch.ones(4),))
    program = export_program({"forward": ep}, partitioner=Partitioner(skip_ops=skip_ops))
    x = rng.standard_normal(4, dtype=np.float32)
    (got,) = run_all(program.to_bytes(), {"forward": [x]})["forward"]
    np.testing.assert_allclose(got, eager(ScaledBySum(), x)[0], rtol=1e-5, atol=1e-6)


class ReturnsItsLength(torch.nn.Module):
    def forward(self, x):
        return x + 1, x.shape[0]


def test_a_number_returned_as_an_output_is_refused_naming_it():
    """A SymInt output (x.shape[0] of a dynamic dimension) failed as "node 'sym_size_int_1' is used before it is
    computed"."""
    ep = torch.export.export(ReturnsItsLength(), (torch.zeros(3, 4),),
                             dynamic_shapes=({0: torch.export.Dim("T")},))
    with pytest.raises(ExportError, match=r"Method 'forward': output 1 is a number \(T\), not a tensor; a method "
                                          r"returns tensors only. Return it as a tensor"):
        export_program({"forward": ep})
