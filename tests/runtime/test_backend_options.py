import pytest

from onecopy import Runtime
from onecopy.errors import InvalidArgument
from onecopy.runtime import parse_backend_options


def test_absent_options_parse_to_nothing():
    assert parse_backend_options(None) == {}
    assert parse_backend_options({}) == {}


def test_typed_option_parses():
    assert parse_backend_options({"IreeBackend": {"compute_units": "cpu"}}) == {"IreeBackend": {"compute_units": "cpu"}}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"IreeBackend": {"compute_units": 1}},
         r"Backend 'IreeBackend' option 'compute_units' expects str, got int \(1\)\."),
        ({"IreeBackend": {"compute_units": True}},
         r"Backend 'IreeBackend' option 'compute_units' expects str, got bool \(True\)\."),
        ({"IreeBackend": {"no_such_option": True}},
         r"Backend 'IreeBackend' has no option 'no_such_option'; its options are .*compute_units"),
        ({"CoreMLBackend": {}}, r"unknown backend 'CoreMLBackend'; known: IreeBackend"),
        ({"IreeBackend": "cpu"}, r"backend_options\['IreeBackend'\] must be a mapping"),
        ("IreeBackend", r"backend_options must be a mapping"),
    ],
)
def test_bad_options_are_invalid_argument(options, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_backend_options(options)


def test_load_program_checks_options_before_reading_the_file(tmp_path):
    with pytest.raises(InvalidArgument, match="expects str, got int"):
        Runtime().load_program(tmp_path / "missing.onecopy", backend_options={"IreeBackend": {"compute_units": 3}})


@pytest.mark.parametrize("precision", ["fp16", "BF16", None, 16])
def test_an_unknown_precision_is_refused_before_reading_the_file(tmp_path, precision):
    with pytest.raises(InvalidArgument, match=rf"unknown precision {precision!r}; expected one of 'fp32', 'bf16' "
                                              r"\(default 'fp32'\)"):
        Runtime().load_program(tmp_path / "missing.onecopy", precision=precision)
