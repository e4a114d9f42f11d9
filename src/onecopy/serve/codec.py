"""The HTTP formats of a served program: requests and answers as npz (arrays in input order) or JSON.

    POST /forward  content-type: application/x-npz    body: np.savez(f, x0, x1, ...)      -> npz of the outputs
    POST /forward  content-type: application/json     body: {"inputs": [[...], ...]}       -> {"outputs": [...]}

An answer comes in the format of its request. JSON carries no dtypes: each input is converted to the dtype the
method takes, and a value that dtype cannot hold is refused (RequestError, HTTP 400), never truncated, wrapped or
rounded to inf: a float given to an integer input, an integer outside the input's range (300 for uint8), a finite
number beyond a float input's largest (1e5 for float16). The answer says each output's dtype and shape beside its
values. JSON numbers have no NaN or infinities: answers write them as the strings "NaN", "Infinity" and
"-Infinity" (the words Python's json module writes, quoted), and float inputs take those strings too.
Nothing here needs Ray.
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
    "NONFINITE_JSON",
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
    arrays = _decode_npz(body, where, limit, [t.name for t in inputs]) if fmt == NPZ else _decode_json(body, inputs, where)
    if len(arrays) != len(inputs):
        raise RequestError(f"{where}: the request holds {len(arrays)} arrays; the method takes {len(inputs)} inputs.")
    return arrays


def _decode_npz(body: bytes, where: str, limit: int, input_names: Sequence[str] = ()) -> list[np.ndarray]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        # A compressed npz (savez_compressed) may unpack to much more than it sent: bound what it unpacks to.
        unpacked = sum(info.file_size for info in archive.infolist())
        if unpacked > limit:
            raise too_large(where, unpacked, limit)
        with np.load(io.BytesIO(body), allow_pickle=False) as npz:
            names = _input_order(list(npz.files), input_names)
            arrays = [npz[name] for name in names]
    except RequestTooLarge:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise RequestError(
            f"{where}: the body is not a readable npz of plain arrays ({e}); send np.savez(f, x0, x1, ...)."
        ) from e
    for name, array in zip(names, arrays):
        # np.load hands back a member that is not an .npy file (or not a whole one) as its raw bytes: the method
        # then refused "dtype |S5", advising a cast, for what is not an array at all.
        if not isinstance(array, np.ndarray):
            raise RequestError(f"{where}: the npz member '{name}' is not a .npy array; send np.savez(f, x0, x1, ...).")
    return arrays


def _input_order(names: list[str], input_names: Sequence[str] = ()) -> list[str]:
    """np.savez(f, a, b) names arrays arr_0, arr_1 (sorted by index, past arr_9 too); arrays named as the
    method's inputs (np.savez(f, ids=..., mask=...)) go by those names; other names keep their order in the
    archive, which is the order they were given."""
    if input_names and all(input_names) and sorted(names) == sorted(input_names):
        return list(input_names)
    if names and all(n.startswith("arr_") and n[4:].isdigit() for n in names):
        return sorted(names, key=lambda n: int(n[4:]))
    return names


def _decode_json(body: bytes, inputs: Sequence[TensorMeta], where: str) -> list[np.ndarray]:
    try:
        request = msgspec.json.decode(body, type=_JsonRequest)
    except RecursionError:
        raise _too_deep(where) from None
    except msgspec.ValidationError as e:
        raise RequestError(f"{where}: the JSON body is not {{\"inputs\": [...]}}: {e}.") from e
    except msgspec.DecodeError as e:
        raise RequestError(f"{where}: the body is not JSON ({e}); send {{\"inputs\": [...]}}.") from e
    if len(request.inputs) != len(inputs):
        raise RequestError(f"{where}: the request holds {len(request.inputs)} inputs; the method takes {len(inputs)}.")
    return [_json_array(raw, meta, f"{where}: input {i}") for i, (raw, meta) in enumerate(zip(request.inputs, inputs))]


def _too_deep(where: str) -> RequestError:
    return RequestError(f"{where}: the JSON nests deeper than it can be read; an input is a nested list with one "
                        "level per dimension.")


# Float values JSON numbers cannot carry: written as these strings in answers, taken as them in float inputs.
NONFINITE_JSON = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _json_array(raw: msgspec.Raw, meta: TensorMeta, where: str) -> np.ndarray:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.ValidationError as e:  # a number literal beyond float64 (1e400): msgspec's only check here
        raise RequestError(f"{where} holds a number beyond float64's range ({e}); the method takes "
                           f"{meta.dtype}.") from e
    except RecursionError:  # lists nested thousands deep: the client's doing, not a fault of the replica (500)
        raise _too_deep(where) from None
    try:
        given = np.array(value)
    except ValueError as e:  # ragged lists: numpy refuses to make an object array implicitly
        raise RequestError(f"{where} is not a rectangular nested list of numbers ({e}).") from e
    dtype = meta.dtype
    if dtype.kind == "b":
        if given.dtype.kind in "OU":
            raise RequestError(f"{where} holds {given.dtype} values; expected true/false for bool.")
        if given.dtype.kind != "b":
            raise RequestError(f"{where} holds numbers; the method takes bool. Send true/false.")
        return given
    if dtype.kind not in "iuf":
        raise RequestError(f"{where}: the method takes {dtype}, which JSON does not carry; send npz.")
    # numpy's own dtype for the values can hide what was sent: ints past uint64's range make an object array, and
    # int64 and uint64 values together a float64 one. Those (and strings, nulls) are read value by value.
    if given.dtype.kind not in "biuf" or (dtype.kind in "iu" and given.dtype.kind == "f"):
        given = _by_value(value, given.dtype, dtype, where)
    if dtype.kind in "iu":
        return _as_integers(given, dtype, where)
    return _as_floats(given, dtype, where)


def _by_value(value: object, shown: np.dtype, dtype: np.dtype, where: str) -> np.ndarray:
    """The values of a nested list one by one, as Python decoded them: a float for an integer input is refused,
    integers of any size are kept exact (their range is checked after), the strings of NONFINITE_JSON are taken
    for a float input; anything else (null, other strings) is refused."""
    items = np.array(value, dtype=object)  # rectangular (np.array(value) made it), so each item is a scalar
    flat = items.reshape(-1)
    out = np.empty(flat.shape, np.float64 if dtype.kind == "f" else object)
    for k, item in enumerate(flat):
        if isinstance(item, (bool, int)):
            if dtype.kind == "f":
                try:
                    out[k] = float(item)
                except OverflowError:  # an integer beyond float64's range
                    raise _out_of_range(where, item, _index(k, items.shape), dtype) from None
            else:
                out[k] = int(item)
        elif isinstance(item, float):
            if dtype.kind != "f":
                raise RequestError(f"{where} holds fractional numbers; the method takes {dtype}. Send integers.")
            out[k] = item
        elif isinstance(item, str) and dtype.kind == "f" and item in NONFINITE_JSON:
            out[k] = NONFINITE_JSON[item]
        else:
            raise RequestError(f"{where} holds {shown} values; expected numbers for {dtype}"
                               + (f' (or the strings {", ".join(map(repr, NONFINITE_JSON))})' if dtype.kind == "f"
                                  else "") + ".")
    if dtype.kind == "f":
        return out.reshape(items.shape)
    _check_integers(out, items.shape, dtype, where)  # before making an int64 array of them (it could overflow)
    return out.astype(dtype).reshape(items.shape)


def _check_integers(flat: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, where: str) -> None:
    info = np.iinfo(dtype)
    for k, item in enumerate(flat):
        if not info.min <= item <= info.max:
            raise _out_of_range(where, int(item), _index(k, shape), dtype)


def _as_integers(given: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    if given.dtype.kind in "iu" and given.size:
        info = np.iinfo(dtype)
        if int(given.min()) < info.min or int(given.max()) > info.max:
            outside = ((given < info.min) | (given > info.max)).reshape(-1)
            k = int(np.argmax(outside))
            raise _out_of_range(where, int(given.reshape(-1)[k]), _index(k, given.shape), dtype)
    return given.astype(dtype, copy=False)


def _as_floats(given: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        converted = given.astype(dtype, copy=False)
    if given.dtype.kind != "b" and converted.size:
        overflowed = np.isinf(converted) & np.isfinite(given)
        if overflowed.any():
            k = int(np.argmax(overflowed.reshape(-1)))
            raise _out_of_range(where, given.reshape(-1)[k].item(), _index(k, given.shape), dtype)
    return converted


def _index(k: int, shape: tuple[int, ...]) -> list[int]:
    return [int(i) for i in np.unravel_index(k, shape)] if shape else []


def _out_of_range(where: str, found: int | float, index: list[int], dtype: np.dtype) -> RequestError:
    at = f" at {index}" if index else ""
    shown = str(found)
    if len(shown) > 40:  # an integer of hundreds of digits
        shown = f"{shown[:12]}... ({len(shown.lstrip('-'))} digits)"
    if dtype.kind == "f":
        largest = f"{float(np.finfo(dtype).max):.8g}"  # 65504, 3.4028235e+38
        return RequestError(
            f"{where} holds {shown}{at}, outside {dtype}'s range [-{largest}, {largest}]: it would become inf. "
            f"The method takes {dtype}; send values within its range.")
    info = np.iinfo(dtype)
    return RequestError(
        f"{where} holds {shown}{at}, outside {dtype}'s range [{info.min}, {info.max}]: values are never wrapped "
        f"into the method's dtype. The method takes {dtype}; send values within its range.")


def encode_outputs(outputs: Sequence[np.ndarray], fmt: str) -> bytes:
    """An answer in the request's format: npz (arr_0, arr_1, ... in output order) or JSON."""
    if fmt == NPZ:
        buffer = io.BytesIO()
        np.savez(buffer, *outputs)
        return buffer.getvalue()
    return encode_json(
        {
            "outputs": [_json_values(o) for o in outputs],
            "dtypes": [str(o.dtype) for o in outputs],
            "shapes": [list(o.shape) for o in outputs],
        }
    )


def _json_values(output: np.ndarray) -> object:
    """An output as nested lists, with NaN and infinities as the strings of NONFINITE_JSON (JSON has no such
    numbers; msgspec would write each as null, and the three would look alike)."""
    if output.dtype.kind == "f":
        nan, positive, negative = np.isnan(output), np.isposinf(output), np.isneginf(output)
        if nan.any() or positive.any() or negative.any():
            items = output.astype(object)  # Python floats
            items[nan], items[positive], items[negative] = "NaN", "Infinity", "-Infinity"
            return items.tolist()
    return output.tolist()


def encode_json(value: object) -> bytes:
    return msgspec.json.encode(value)
