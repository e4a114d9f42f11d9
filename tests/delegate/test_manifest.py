import numpy as np
import pytest

from onecopy import Runtime
from onecopy.delegate import parse_manifest
from onecopy.delegate.targets import host_cpu_target
from onecopy.errors import DelegateError
from tests.conftest import eager, vmfb_without_encoders, with_manifest

HOST = host_cpu_target().name


def load_forward(program_bytes):
    with Runtime().load_program(program_bytes) as program:
        program.load_method("forward")


def test_manifest_of_an_export_is_complete(small_program):
    manifest = parse_manifest(small_program.definition.delegates[0].manifest, "test")
    assert manifest.packaging == "mlir"
    assert manifest.function == "main"
    assert manifest.multifunction is False
    assert "multifunction" not in small_program.definition.delegates[0].manifest
    assert list(manifest.bundle) == ["portable"]
    assert len(manifest.export_hash) == 64
    assert manifest.input_names == ["x"]
    assert manifest.compute_units == "cpu"
    assert len(manifest.parameters) == 6


def test_the_backend_describes_a_delegate_through_its_manifest_schema(small_program):
    from onecopy.runtime.backend import DelegateSummary, delegate_summary, get_backend

    definition = small_program.definition
    manifest = parse_manifest(definition.delegates[0].manifest, "test")
    assert delegate_summary(0, definition) == DelegateSummary("main", "mlir", manifest.export_hash)
    with pytest.raises(DelegateError, match=r"delegate 0: invalid manifest: .*packaging"):
        get_backend("IreeBackend").describe({**definition.delegates[0].manifest, "packaging": 3}, "delegate 0")


def test_unknown_packaging_is_refused(small_program):
    with pytest.raises(
        DelegateError,
        match=r"^Method 'forward', delegate 0: Unsupported packaging 'inline'; expected mlir or vmfb\. Re-export the program\.$",
    ):
        load_forward(with_manifest(small_program, 0, packaging="inline"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"multifunction": 1}, r"Expected `bool`, got `int` - at `\$.multifunction`"),
        ({"multifunction": "yes"}, r"Expected `bool`, got `str` - at `\$.multifunction`"),
        ({"function": 7}, r"Expected `str`, got `int` - at `\$.function`"),
        ({"bundle": ["portable"]}, r"Expected `object`, got `array` - at `\$.bundle`"),
        ({"packaging": 3}, r"Expected `str`, got `int` - at `\$.packaging`"),
        ({"export_hash": None}, r"missing required field `export_hash`"),
        ({"surprise": True}, r"unknown field `surprise`"),
        ({"version": 99}, r"manifest version 99 is newer than this onecopy reads"),
        ({"bundle": {"x86_64": "bundle/x"}}, r"an mlir manifest needs exactly the bundle key 'portable'"),
        ({"encoders": ["x86_64"]}, r"Expected `object`, got `array` - at `\$.encoders`"),
        ({"encoders": {"portable": "bundle/x"}}, r"field `encoders` applies to vmfb manifests only, this one is mlir"),
    ],
)
def test_invalid_manifest_names_the_field(small_program, changes, message):
    with pytest.raises(DelegateError, match=r"Method 'forward', delegate 0: .*" + message):
        load_forward(with_manifest(small_program, 0, **changes))


def test_missing_bundle_is_reported(small_program):
    with pytest.raises(DelegateError, match=r"bundle 'bundle/gone' is missing from the program's named data"):
        load_forward(with_manifest(small_program, 0, bundle={"portable": "bundle/gone"}))


def test_missing_function_lists_the_functions(small_program):
    with pytest.raises(DelegateError, match=r"the bundle has no function 'decode_3'; it has .*main"):
        load_forward(with_manifest(small_program, 0, function="decode_3"))


def test_vmfb_encoders_name_only_targets_of_the_bundle(small_vmfb_program):
    other = "aarch64" if HOST == "x86_64" else "x86_64"
    with pytest.raises(DelegateError, match=rf"field `encoders` names target\(s\) {other} that `bundle` has no code for \(it has {HOST}\)"):
        load_forward(with_manifest(small_vmfb_program, 0, encoders={other: "bundle/x"}))


def test_missing_parameter_encoder_is_reported(small_vmfb_program):
    with pytest.raises(DelegateError, match=rf"parameter encoder for {HOST} 'bundle/gone' is missing from the program's named data"):
        load_forward(with_manifest(small_vmfb_program, 0, encoders={HOST: "bundle/gone"}))


def test_vmfb_manifest_that_lost_its_encoders_is_a_clear_error(small_vmfb_program):
    # The bundle was compiled to read packed weights: without its encoder nothing produces them.
    with pytest.raises(DelegateError, match=rf"the {HOST} bundle reads weights packed ahead of time \(parameter scope 'encoded'\) but nothing produced them: its manifest names no parameter encoder for {HOST}\. Re-export the program\."):
        load_forward(with_manifest(small_vmfb_program, 0, encoders=None))


def test_old_style_vmfb_manifest_without_encoders_still_loads(small_methods, small_model, states, monkeypatch, rng):
    program = vmfb_without_encoders(small_methods)
    assert all("encoders" not in d.manifest for d in program.definition.delegates)
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # nothing to encode: the load specializes nothing
    x = rng.standard_normal((16, 64), dtype=np.float32)
    with Runtime().load_program(program.to_bytes()) as loaded:
        (y,) = loaded.load_method("prefill").execute([x])
    np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    assert states() == ["restored"]


def test_a_state_whose_size_disagrees_with_its_shape_is_refused():
    from onecopy.delegate.manifest import parse_manifest

    raw = {"version": 1, "packaging": "mlir", "export_hash": "x", "bundle": {"portable": "bundle/x.mlirbc"},
           "function": "decode_0", "input_names": [], "output_names": [], "compute_units": "cpu",
           "states": [{"name": "cache", "parameter": "onecopy_state_0", "shape": [8, 16], "dtype": "float32",
                       "nbytes": 4}]}
    with pytest.raises(DelegateError, match="state 'cache' says 4 bytes, but float32\\[8, 16\\] takes 512"):
        parse_manifest(raw, "Method 'decode', delegate 0")
    raw["states"][0].update(nbytes=512)
    assert parse_manifest(raw, "here").states[0].nbytes == 512


def test_a_vmfb_bundle_key_of_an_unknown_precision_is_refused(small_vmfb_program):
    manifest = small_vmfb_program.definition.delegates[0].manifest
    with pytest.raises(DelegateError, match=rf"bundle key\(s\) {HOST}@f8 name an unknown precision \(known: fp32, bf16\)"):
        load_forward(with_manifest(small_vmfb_program, 0, bundle={**manifest["bundle"], f"{HOST}@f8": "bundle/x"}))


def test_bundle_keys_name_target_and_precision():
    from onecopy.delegate.manifest import bundle_key, split_bundle_key

    assert bundle_key("x86_64") == bundle_key("x86_64", "fp32") == "x86_64"
    assert bundle_key("aarch64", "bf16") == "aarch64@bf16"
    assert split_bundle_key("aarch64@bf16") == ("aarch64", "bf16") and split_bundle_key("x86_64") == ("x86_64", "fp32")
