"""Typed backend options: `{"IreeBackend": {"compute_units": "cpu"}}`.

Types are exact: a bool option given 1 or "true" is refused (in Python `True` is an int, so an int option
refuses bools too). Unknown backends and unknown option names are refused the same way, at `load_program`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onecopy.errors import InvalidArgument
from onecopy.runtime.backend import OptionValue, backend_names, get_backend

__all__ = ["BackendOptions", "DEFAULT_PRECISION", "PRECISIONS", "check_precision", "parse_backend_options"]

BackendOptions = dict[str, dict[str, OptionValue]]

# Compute precision asked of every delegate at load (`load_program(..., precision=)`); each backend decides what
# it means for its engine and refuses what it cannot honour. fp32 is the default and always honoured.
DEFAULT_PRECISION = "fp32"
PRECISIONS = ("fp32", "bf16")


def check_precision(precision: object, where: str) -> str:
    """`precision` if it is one onecopy knows, else `InvalidArgument`."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise InvalidArgument(
            f"{where}: unknown precision {precision!r}; expected one of {', '.join(map(repr, PRECISIONS))} "
            f"(default {DEFAULT_PRECISION!r})."
        )
    return precision


def parse_backend_options(options: Mapping[str, Mapping[str, Any]] | None) -> BackendOptions:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidArgument(
            f"backend_options must be a mapping of backend name to options, got {type(options).__name__}; "
            'e.g. {"IreeBackend": {"compute_units": "cpu"}}.'
        )
    parsed: BackendOptions = {}
    for backend_name, values in options.items():
        if backend_name not in backend_names():
            raise InvalidArgument(
                f"backend_options names an unknown backend '{backend_name}'; known: {', '.join(backend_names())}."
            )
        if not isinstance(values, Mapping):
            raise InvalidArgument(
                f"backend_options['{backend_name}'] must be a mapping of option name to value, "
                f"got {type(values).__name__}."
            )
        schema = get_backend(backend_name).options
        checked: dict[str, OptionValue] = {}
        for option, value in values.items():
            expected = schema.get(option)
            if expected is None:
                raise InvalidArgument(
                    f"Backend '{backend_name}' has no option '{option}'; its options are "
                    f"{', '.join(sorted(schema)) or 'none'}."
                )
            if type(value) is not expected:
                raise InvalidArgument(
                    f"Backend '{backend_name}' option '{option}' expects {expected.__name__}, "
                    f"got {type(value).__name__} ({value!r})."
                )
            checked[option] = value
        parsed[backend_name] = checked
    return parsed
