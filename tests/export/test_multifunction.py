import numpy as np
import pytest
import torch

import onecopy.export.lowering as lowering
from onecopy import Runtime
from onecopy.errors import ExecutionError, ExportError, InvalidArgument
from onecopy.export import CompileSpec, Partitioner, export_program
from onecopy.models import builtin_methods
from tests.conftest import PACKAGINGS, AttentionBlock, eager

MF = Partitioner(multifunction=True)
BREAK = ("aten.relu.default",)


def manifests(program):
    return [d.manifest for d in program.definition.delegates]


def functions(program):
    return [m["function"] for m in manifests(program)]


def test_partitioner_and_compile_spec_round_trip():
    p = Partitioner(multifunction=True, skip_ops=["aten.relu.default"])
    assert p == Partitioner(multifunction=True, skip_ops=("aten.relu.default",))
    assert p.skip_ops == ("aten.relu.default",) and p.multifunction is True
    spec = CompileSpec(packaging="vmfb", compute_units="cpu", targets=["x86_64", "aarch64"])
    assert spec == CompileSpec(packaging="vmfb", compute_units="cpu", targets=("x86_64", "aarch64"))
    assert Partitioner().multifunction is False


def test_two_methods_share_one_bundle_and_each_weight_once(small_methods):
    program = export_program(small_methods, partitioner=MF)
    (forward, prefill) = manifests(program)
    assert functions(program) == ["forward_0", "prefill_0"]
    assert forward["export_hash"] == prefill["export_hash"]
    assert forward["bundle"] == prefill["bundle"]
    assert forward["multifunction"] is True and prefill["multifunction"] is True
    assert forward["parameters"] == prefill["parameters"]
    params = [k for k in program.data.keys() if k.startswith("param/")]
    assert len(params) == 6  # 3 weights + 3 biases, once
    bundles = [k for k in program.data.keys() if k.startswith("bundle/")]
    assert len(bundles) == 1


def test_combined_program_is_about_the_size_of_one_method(small_methods):
    combined = len(export_program(small_methods, partitioner=MF).to_bytes())
    single = len(export_program({"forward": small_methods["forward"]}, partitioner=MF).to_bytes())
    assert combined <= single * 1.15


def test_graph_break_adds_functions_to_the_one_bundle(small_methods):
    program = export_program(small_methods, partitioner=Partitioner(multifunction=True, skip_ops=BREAK))
    names = functions(program)
    assert names == [f"forward_{i}" for i in range(3)] + [f"prefill_{i}" for i in range(3)]
    assert len({m["export_hash"] for m in manifests(program)}) == 1


def test_option_off_gives_one_main_module_per_delegate(small_methods):
    program = export_program(small_methods)
    assert functions(program) == ["main", "main"]
    assert len({m["export_hash"] for m in manifests(program)}) == 2
    assert all("multifunction" not in m for m in manifests(program))


def test_multifunction_set_on_only_some_methods_is_refused(small_methods):
    with pytest.raises(ExportError, match=r"multifunction=True\) is set for methods forward but not for prefill.*Set it for every method, or for none"):
        export_program(small_methods, partitioner={"forward": MF, "prefill": Partitioner()})


@pytest.mark.parametrize(
    "other, field",
    [
        (CompileSpec(packaging="vmfb"), "packaging"),
        (CompileSpec(compute_units="all"), "compute_units"),
    ],
)
def test_mismatched_compile_specs_are_refused(small_methods, other, field):
    with pytest.raises(ExportError, match=rf"Methods 'forward' and 'prefill' have compile specs differing in {field}.*Give them the same CompileSpec"):
        export_program(small_methods, partitioner=MF, compile_spec={"forward": CompileSpec(), "prefill": other})


def test_mismatched_targets_are_refused(small_methods):
    with pytest.raises(ExportError, match=r"differing in targets \(\('x86_64',\) vs \('x86_64', 'aarch64'\)\)"):
        export_program(small_methods, partitioner=MF, compile_spec={
            "forward": CompileSpec(packaging="vmfb", targets=("x86_64",)),
            "prefill": CompileSpec(packaging="vmfb", targets=("x86_64", "aarch64")),
        })


def test_without_multifunction_methods_may_have_their_own_compile_specs(small_methods):
    program = export_program(small_methods, compile_spec={"forward": CompileSpec(), "prefill": CompileSpec(packaging="vmfb")})
    assert [m["packaging"] for m in manifests(program)] == ["mlir", "vmfb"]


def test_vmfb_compiles_once_per_target_and_shares_parameters(small_methods, monkeypatch):
    calls = []
    real = lowering.compile_with_encoder
    monkeypatch.setattr(lowering, "compile_with_encoder", lambda source, target, **kw: calls.append(target.name) or real(source, target, **kw))
    program = export_program(small_methods, partitioner=MF, compile_spec=CompileSpec(packaging="vmfb", targets=("x86_64", "aarch64")))
    assert sorted(calls) == ["aarch64", "x86_64"]
    (manifest, second) = manifests(program)
    assert set(manifest["bundle"]) == {"x86_64", "aarch64"}
    assert len([k for k in program.data.keys() if k.startswith("param/")]) == 6
    # Each CPU target, this machine's or not, gets its parameter encoder, compiled for that target (ELF e_machine
    # 62 = x86_64, 183 = aarch64), once for the module that both functions share.
    assert set(manifest["encoders"]) == {"x86_64", "aarch64"} and second["encoders"] == manifest["encoders"]
    blobs = dict(program.data.items())
    for target, machine in (("x86_64", 62), ("aarch64", 183)):
        encoder = bytes(blobs[manifest["encoders"][target]].data)
        elf = encoder.find(b"\x7fELF")
        assert elf >= 0 and int.from_bytes(encoder[elf + 18 : elf + 20], "little") == machine


@pytest.mark.parametrize("packaging", PACKAGINGS)
@pytest.mark.parametrize("skip_ops", [(), BREAK], ids=["whole", "graph-break"])
def test_every_method_matches_torch_eager(small_model, small_methods, packaging, skip_ops, rng):
    program = export_program(small_methods, partitioner=Partitioner(multifunction=True, skip_ops=skip_ops),
                             compile_spec=CompileSpec(packaging=packaging))
    with Runtime().load_program(program.to_bytes()) as loaded:
        for name, batch in (("forward", 1), ("prefill", 16)):
            x = rng.standard_normal((batch, 64), dtype=np.float32)
            (y,) = loaded.load_method(name).execute([x])
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


def test_four_methods_share_one_module(small_model, rng):
    methods = builtin_methods(small_model, batches={"forward": 1, "b4": 4, "prefill": 16, "b64": 64}, width=64)
    program = export_program(methods, partitioner=MF)
    assert functions(program) == ["forward_0", "b4_0", "prefill_0", "b64_0"]
    with Runtime().load_program(program.to_bytes()) as loaded:
        x = rng.standard_normal((64, 64), dtype=np.float32)
        (y,) = loaded.load_method("b64").execute([x])
    np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packaging", PACKAGINGS)
@pytest.mark.parametrize("multifunction", [False, True])
def test_dynamic_dimension_serves_two_sizes(packaging, multifunction, rng):
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    seq = torch.export.Dim("seq", min=2, max=256)
    ep = torch.export.export(model, (torch.zeros(1, 16, 64),), dynamic_shapes=({1: seq},))
    decode = torch.export.export(model, (torch.zeros(1, 1, 64),))
    program = export_program({"prefill": ep, "decode": decode}, partitioner=Partitioner(multifunction=multifunction),
                             compile_spec=CompileSpec(packaging=packaging))
    spec = program.definition.methods[0].input_specs[0]
    assert spec.shape[0] == 1 and isinstance(spec.shape[1], str) and spec.shape[2] == 64
    with Runtime().load_program(program.to_bytes()) as loaded:
        prefill = loaded.load_method("prefill")
        for t in (5, 40, 5):  # the second 5 matches a checked call: no checks, same results
            x = rng.standard_normal((1, t, 64), dtype=np.float32)
            (y,) = prefill.execute([x])
            assert y.shape == (1, t, 64)
            np.testing.assert_allclose(y, eager(model, x)[0], rtol=1e-4, atol=1e-5)
        x = rng.standard_normal((1, 1, 64), dtype=np.float32)
        np.testing.assert_allclose(loaded.load_method("decode").execute([x])[0], eager(model, x)[0], rtol=1e-4, atol=1e-5)


def test_dynamic_input_of_a_size_outside_its_range_is_refused(rng):
    torch.manual_seed(0)
    model = AttentionBlock().eval()
    ep = torch.export.export(model, (torch.zeros(1, 16, 64),), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=64)},))
    program = export_program({"forward": ep})
    with Runtime().load_program(program.to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        forward.execute([rng.standard_normal((1, 64, 64), dtype=np.float32)])  # in range: a checked call
        with pytest.raises(ExecutionError, match=r"Input 0 of method 'forward' has size 65 at dimension 1 \('seq'\), outside its exported range \[2, 64\]"):
            forward.execute([rng.standard_normal((1, 65, 64), dtype=np.float32)])


def test_enumerated_shapes_for_one_method_are_refused_with_the_alternatives(small_methods):
    with pytest.raises(InvalidArgument, match=r"Method 'forward' was given 2 exported programs \(enumerated shapes\).*export each shape as a method of its own.*torch.export.Dim"):
        export_program({"forward": [small_methods["forward"], small_methods["prefill"]]}, partitioner=MF)


def test_a_shape_the_method_was_not_exported_for_is_refused(small_methods, rng):
    program = export_program(small_methods, partitioner=MF)
    with Runtime().load_program(program.to_bytes()) as loaded:
        with pytest.raises(ExecutionError, match=r"Input 0 of method 'forward' has shape \[4, 64\]; expected \[1, 64\]"):
            loaded.load_method("forward").execute([rng.standard_normal((4, 64), dtype=np.float32)])
