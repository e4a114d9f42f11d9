"""The OpenVINO delegate's manifest: typed, one schema, errors naming the field."""

from __future__ import annotations

import pytest

from onecopy.delegate.openvino.backend import OpenVinoBackend
from onecopy.delegate.openvino.manifest import OpenVinoManifest, parse_manifest
from onecopy.errors import DelegateError

GOOD = {"version": 1, "export_hash": "ab", "model": "bundle/ab.openvino.xml", "weights": {"1": "param/cd"},
        "input_names": ["x"], "output_names": ["y"]}


def test_a_manifest_round_trips_leaving_defaults_out():
    manifest = parse_manifest(GOOD, "d")
    assert manifest == OpenVinoManifest(**GOOD)
    assert manifest.to_dict() == GOOD


@pytest.mark.parametrize("change, message", [
    ({"weights": {"1": 3}}, r"Expected `str`, got `int` - at `\$.weights\[...\]`"),
    ({"model": None}, r"Expected `str`, got `null` - at `\$.model`"),
    ({"stray": 1}, r"unknown field `stray`"),
    ({"version": 9}, r"OpenVINO manifest version 9 is newer than this onecopy reads \(1\); upgrade onecopy"),
])
def test_a_bad_field_is_an_error_naming_it(change, message):
    with pytest.raises(DelegateError, match=f"d: .*{message}"):
        parse_manifest({**GOOD, **change}, "d")


def test_verify_names_named_data_the_program_lacks():
    problems = OpenVinoBackend().verify_manifest(GOOD, {"bundle/ab.openvino.xml"}, "delegate 1 (OpenVinoBackend)")
    assert problems == ["delegate 1 (OpenVinoBackend): constant layer 1 names named data 'param/cd', which the "
                        "program does not hold"]
