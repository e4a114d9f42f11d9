"""The OpenVINO delegate: an alternative engine for methods IREE runs whole, reading its weights from the program
file's own named data (see `ir` for how the IR's constants map onto it). Importing this package never imports
openvino; only a load that uses it does (`pip install 'onecopy[openvino]'`)."""

from onecopy.delegate.openvino.manifest import BACKEND, OpenVinoManifest, parse_manifest

__all__ = ["BACKEND", "OpenVinoManifest", "parse_manifest"]
