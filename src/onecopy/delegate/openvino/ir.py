"""OpenVINO IR constants onto a program's named data store, and back.

An IR is an xml (the graph) and a bin (every `Const` layer's bytes at `<data offset=.. size=..>`). At export,
`split_constants` cuts the bin into one blob per constant; the exporter stores each under the key of the parameter
with the same bytes when there is one (the store holds each content once), so the weights are on disk once. At
load, `place_constants` points every constant's offset at its blob's place in the program file, so OpenVINO reads
the weights from the file's own pages: no second weights file, no copy at read.

Measured (OpenVINO 2026.4, torch 2.13): `openvino.convert_model` folds each batch norm into the convolution before
it, so on a program as torch exports it ResNet-18 keeps 2 of its 44 constants (the classifier, 2 MB) and would
add 44.7 MB of its own. The exporter therefore folds batch norms in torch first, for both delegates
(onecopy.export.batch_norm_folding): then 42 of 44 are IREE's parameters and OpenVINO adds 32 bytes
(MobileNetV3-small: 176 bytes); a Linear/MLP model adds nothing.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping

from onecopy.errors import DelegateError

__all__ = ["split_constants", "place_constants"]


def _constants(root: ET.Element):
    for layer in root.iter("layer"):
        if layer.get("type") == "Const":
            data = layer.find("data")
            if data is not None and data.get("offset") is not None:
                yield layer.get("id"), data


def split_constants(xml_text: str, weights: bytes) -> dict[str, bytes]:
    """Const layer id -> its bytes in the IR's bin (empty constants are left out: they read nothing)."""
    out = {}
    for layer, data in _constants(ET.fromstring(xml_text)):
        offset, size = int(data.get("offset")), int(data.get("size"))
        if size:
            out[str(layer)] = weights[offset:offset + size]
    return out


def place_constants(xml_text: str, locations: Mapping[str, tuple[int, int]], where: str) -> str:
    """The xml with each listed Const layer reading (offset, length) of the weights buffer: `locations` maps a layer
    id to where its bytes are. A layer the xml lacks, or whose size differs from its blob, is a `DelegateError`."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise DelegateError(f"{where}: the OpenVINO IR stored in the program is not valid xml ({e}); the program "
                            "is damaged: re-export it.") from e
    seen = set()
    for layer, data in _constants(root):
        place = locations.get(str(layer))
        if place is None:
            if int(data.get("size", "0")):
                raise DelegateError(f"{where}: the OpenVINO IR's constant layer {layer} has no named data in the "
                                    "manifest; the program is damaged: re-export it.")
            continue
        offset, length = place
        if int(data.get("size")) != length:
            raise DelegateError(f"{where}: the OpenVINO IR's constant layer {layer} takes {data.get('size')} bytes "
                                f"but its named data holds {length}; the program is damaged: re-export it.")
        data.set("offset", str(offset))
        seen.add(str(layer))
    stray = sorted(set(locations) - seen)
    if stray:
        raise DelegateError(f"{where}: the manifest names constant layers {', '.join(stray)} that the OpenVINO IR "
                            "lacks; the program is damaged: re-export it.")
    return ET.tostring(root, encoding="unicode")
