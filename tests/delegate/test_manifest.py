import pytest

from onecopy import Runtime
from onecopy.delegate import parse_manifest
from onecopy.errors import DelegateError
from tests.conftest import with_manifest


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
