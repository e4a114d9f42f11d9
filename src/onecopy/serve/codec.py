"""The HTTP formats of a served program: requests and answers as npz (arrays in input order) or JSON.

    POST /forward  content-type: application/x-npz    body: np.savez(f, x0, x1, ...)      -> npz of the outputs
    POST /forward  content-type: application/json     body: {"inputs": [[...], ...]}       -> {"outputs": [...]}

An answer comes in the format of its request. JSON carries no dtypes: each input is converted to the dtype the
method takes (a float given to an integer input is refused, never truncated), and the answer says each output's
dtype and shape beside its values. Nothing here needs Ray.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence

import msgspec
import numpy as np

from onecopy.errors import RequestError, RequestTooLarge
from onecopy.runtime.method_meta import TensorMeta

__all__ = [
    "NPZ",
    "JSON",
    "DEFAULT_MAX_REQUEST_BYTES",
    "request_format",
    "check_declared_length",
    "too_large",
    "decode_inputs",
    "encode_outputs",
    "encode_json",
]

NPZ = "application/x-npz"
JSON = "application/json"
# 64 MiB: a batch of 1080p fp16 frames fits; a runaway client does not fill the replica's memory.
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


class _JsonRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[msgspec.Raw]


def request_format(content_type: str | None, where: str) -> str:
    """NPZ or JSON from a Content-Type header (parameters such as charset ignored)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in (NPZ, "application/npz", "application/octet-stream"):
        return NPZ
    if kind == JSON or kind == "":
        return JSON
    raise RequestError(
        f"{where}: content type '{content_type}' is not served; send {NPZ} (np.savez of the inputs in order) "
        f"or {JSON} ({{\"inputs\": [...]}})."
    )


def check_declared_length(content_length: str | None, limit: int, where: str) -> None:
    """Refuse a request whose Content-Length is over the limit before reading its body."""
    if content_length is None:
        return
    try:
        declared = int(content_length)
    except ValueError:
        raise RequestError(f"{where}: Content-Length '{content_length}' is not a number.") from None
    if declared > limit:
        raise too_large(where, declared, limit)


def too_large(where: str, size: int, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"{where}: the request holds {size} bytes, over this deployment's limit of {limit}; send smaller batches "
        "or deploy with a larger max_request_bytes."
    )


def decode_inputs(body: bytes, fmt: str, inputs: Sequence[TensorMeta], where: str, *, limit: int) -> list[np.ndarray]:
    """The method's inputs from a request body, in input order. Shapes are checked by the method, not here."""
    if len(body) > limit:
        raise too_large(where, len(body), limit)
    arrays = _decode_npz(body, where, limit) if fmt == NPZ else _decode_json(body, inputs, where)
    if len(arrays) != len(inputs):
        raise RequestError(f"{where}: the request holds {len(arrays)} arrays; the method takes {len(inputs)} inputs.")
    return arrays


def _decode_npz(body: bytes, where: str, limit: int) -> list[np.ndarray]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        # A compressed npz (savez_compressed) may unpack to much more than it sent: bound what it unpacks to.
        unpacked = sum(info.file_size for info in archive.infolist())
        if unpacked > limit:
            raise too_large(where, unpacked, limit)
        with np.load(io.BytesIO(body), allow_pickle=False) as npz:
            names = _input_order(list(npz.files))
            return [npz[name] for name in names]
    except RequestTooLarge:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise RequestError(
            f"{where}: the body is not a readable npz of plain arrays ({e}); send np.savez(f, x0, x1, ...)."
        ) from e


def _input_order(names: list[str]) -> list[str]:
    """np.savez(f, a, b) names arrays arr_0, arr_1 (sorted by index, past arr_9 too); named arrays keep their
    order in the archive, which is the order they were given."""
    if names and all(n.startswith("arr_") and n[4:].isdigit() for n in names):
        return sorted(names, key=lambda n: int(n[4:]))
    return names


def _decode_json(body: bytes, inputs: Sequence[TensorMeta], where: str) -> list[np.ndarray]:
    try:
        request = msgspec.json.decode(body, type=_JsonRequest)
    except msgspec.ValidationError as e:
        raise RequestError(f"{where}: the JSON body is not {{\"inputs\": [...]}}: {e}.") from e
    except msgspec.DecodeError as e:
        raise RequestError(f"{where}: the body is not JSON ({e}); send {{\"inputs\": [...]}}.") from e
    if len(request.inputs) != len(inputs):
        raise RequestError(f"{where}: the request holds {len(request.inputs)} inputs; the method takes {len(inputs)}.")
    return [_json_array(raw, meta, f"{where}: input {i}") for i, (raw, meta) in enumerate(zip(request.inputs, inputs))]


def _json_array(raw: msgspec.Raw, meta: TensorMeta, where: str) -> np.ndarray:
    try:
        value = msgspec.json.decode(raw)
        given = np.array(value)
    except ValueError as e:  # ragged lists: numpy refuses to make an object array implicitly
        raise RequestError(f"{where} is not a rectangular nested list of numbers ({e}).") from e
    if given.dtype == object or given.dtype.kind not in "biuf":
        raise RequestError(f"{where} holds {given.dtype} values; expected numbers for {meta.dtype}.")
    if meta.dtype.kind in "iub" and given.dtype.kind == "f":
        raise RequestError(f"{where} holds fractional numbers; the method takes {meta.dtype}. Send integers.")
    if meta.dtype.kind == "b" and given.dtype.kind != "b":
        raise RequestError(f"{where} holds numbers; the method takes bool. Send true/false.")
    return given.astype(meta.dtype, copy=False)


def encode_outputs(outputs: Sequence[np.ndarray], fmt: str) -> bytes:
    """An answer in the request's format: npz (arr_0, arr_1, ... in output order) or JSON."""
    if fmt == NPZ:
        buffer = io.BytesIO()
        np.savez(buffer, *outputs)
        return buffer.getvalue()
    return encode_json(
        {
            "outputs": [o.tolist() for o in outputs],
            "dtypes": [str(o.dtype) for o in outputs],
            "shapes": [list(o.shape) for o in outputs],
        }
    )


def encode_json(value: object) -> bytes:
    return msgspec.json.encode(value)
