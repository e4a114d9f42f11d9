"""The IREE delegate: manifest, targets, engine adapter and the backend the runtime finds by name."""

from onecopy.delegate.manifest import MANIFEST_VERSION, PACKAGINGS, Manifest, parse_manifest
from onecopy.delegate.targets import COMPUTE_UNITS, TARGETS, Target, available_compute_units

__all__ = [
    "MANIFEST_VERSION",
    "PACKAGINGS",
    "Manifest",
    "parse_manifest",
    "COMPUTE_UNITS",
    "TARGETS",
    "Target",
    "available_compute_units",
]
