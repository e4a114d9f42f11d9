"""The manifest of an OpenVINO delegate: where its IR's xml and each of its constants live in the named data.

Example:

    {"version": 1, "export_hash": "5be1…", "model": "bundle/5be1….openvino.xml",
     "weights": {"12": "param/3a1e…", "40": "openvino/const/77c0…"}, "input_names": ["x"],
     "output_names": ["linear"], "folded_bytes": 2048}

`weights` maps the id of each `Const` layer of the xml to the named data key of its bytes: a parameter IREE's
delegate reads too where OpenVINO kept torch's bytes, else a blob of OpenVINO's own (a constant it computed at
conversion, e.g. a convolution with its batch norm folded in). `folded_bytes` is what those own blobs add.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from onecopy.errors import DelegateError

__all__ = ["BACKEND", "MANIFEST_VERSION", "OpenVinoManifest", "parse_manifest", "missing_named_data"]

BACKEND = "OpenVinoBackend"  # `DelegateDef.backend` of these manifests
MANIFEST_VERSION = 1


class OpenVinoManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    version: int
    export_hash: str
    model: str
    weights: dict[str, str]
    input_names: list[str]
    output_names: list[str]
    folded_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_manifest(raw: Mapping[str, Any], where: str) -> OpenVinoManifest:
    """Validate a manifest read from a program; every problem is a `DelegateError` naming `where` and the field."""
    if not isinstance(raw, Mapping):
        raise DelegateError(f"{where}: the OpenVINO manifest is not a mapping. Re-export the program.")
    try:
        manifest = msgspec.convert(dict(raw), OpenVinoManifest, strict=True)
    except msgspec.ValidationError as e:
        raise DelegateError(f"{where}: invalid OpenVINO manifest: {e}. Re-export the program.") from e
    if manifest.version > MANIFEST_VERSION:
        raise DelegateError(f"{where}: OpenVINO manifest version {manifest.version} is newer than this onecopy "
                            f"reads ({MANIFEST_VERSION}); upgrade onecopy.")
    return manifest


def missing_named_data(manifest: OpenVinoManifest, keys: Collection[str]) -> list[str]:
    wanted = [("the IR's xml", manifest.model)]
    wanted += [(f"constant layer {layer}", key) for layer, key in manifest.weights.items()]
    return [f"{what} names named data '{key}', which the program does not hold" for what, key in wanted
            if key not in keys]
