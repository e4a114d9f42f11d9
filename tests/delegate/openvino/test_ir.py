"""The IR's constants onto named data and back (pure xml: no OpenVINO needed)."""

from __future__ import annotations

import pytest

from onecopy.delegate.openvino.ir import place_constants, split_constants
from onecopy.errors import DelegateError

XML = """<?xml version="1.0"?>
<net name="m" version="11"><layers>
<layer id="0" name="x" type="Parameter" version="opset1"><data shape="1,4" element_type="f32"/></layer>
<layer id="1" name="w" type="Const" version="opset1"><data element_type="f32" shape="4" offset="0" size="16"/></layer>
<layer id="2" name="b" type="Const" version="opset1"><data element_type="f32" shape="2" offset="16" size="8"/></layer>
<layer id="3" name="e" type="Const" version="opset1"><data element_type="f32" shape="0" offset="24" size="0"/></layer>
</layers></net>"""


def test_split_gives_each_constant_its_bytes_and_leaves_empty_ones_out():
    weights = bytes(range(24))
    assert split_constants(XML, weights) == {"1": weights[:16], "2": weights[16:24]}


def test_place_points_each_constant_at_its_blob():
    placed = place_constants(XML, {"1": (4096, 16), "2": (8192, 8)}, "here")
    assert split_constants(placed, bytes(8200)) == {"1": bytes(16), "2": bytes(8)}
    assert 'offset="4096"' in placed and 'offset="8192"' in placed


@pytest.mark.parametrize("locations, message", [
    ({"1": (0, 16)}, "constant layer 2 has no named data in the manifest"),
    ({"1": (0, 12), "2": (0, 8)}, "constant layer 1 takes 16 bytes but its named data holds 12"),
    ({"1": (0, 16), "2": (0, 8), "9": (0, 4)}, "names constant layers 9 that the OpenVINO IR lacks"),
])
def test_a_manifest_that_does_not_fit_the_ir_is_a_damaged_program(locations, message):
    with pytest.raises(DelegateError, match=f"here: the .*{message}.*re-export it"):
        place_constants(XML, locations, "here")


def test_xml_that_does_not_parse_is_a_damaged_program():
    with pytest.raises(DelegateError, match="here: the OpenVINO IR stored in the program is not valid xml"):
        place_constants(XML[:-10], {}, "here")
