"""Damaged and foreign program files, made from a whole one by a seeded generator (for test_fuzz.py).

Each case is (name, bytes). Byte flips in a JSON header mostly break the JSON (the decoder's errors); the
structured mutations change one field of the decoded header to a wrong but well-typed value, which is what the
structural checks of `onecopy.program.validate` are for.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

PREAMBLE = struct.Struct("<8sIIQQ")


def layout(data: bytes) -> tuple[int, int]:
    """(header end, data offset) of a whole program's bytes."""
    _, _, _, header_len, data_offset = PREAMBLE.unpack_from(data, 0)
    return PREAMBLE.size + header_len, data_offset


def with_header(data: bytes, header: Any) -> bytes | None:
    """`data` with its header replaced by `header` (JSON), the data where it was; None when it does not fit."""
    encoded = msgspec.json.encode(header)
    _, data_offset = layout(data)
    if PREAMBLE.size + len(encoded) > data_offset:
        return None
    preamble = bytearray(data[: PREAMBLE.size])
    struct.pack_into("<Q", preamble, 16, len(encoded))
    padding = b"\0" * (data_offset - PREAMBLE.size - len(encoded))
    return bytes(preamble) + encoded + padding + data[data_offset:]


def header_of(data: bytes) -> Any:
    """The decoded JSON header of a program's bytes."""
    header_end, _ = layout(data)
    return msgspec.json.decode(data[PREAMBLE.size:header_end])


def with_field(data: bytes, path: tuple, value: Any) -> bytes:
    """`data` with the header field at `path` (keys and indices) set to `value`."""
    out = with_header(data, _replace(header_of(data), path, value))
    assert out is not None, "the changed header no longer fits before the data"
    return out


def _leaves(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))


def _replace(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(root, dict):
        return {**root, head: _replace(root[head], rest, value)}
    copy = list(root)
    copy[head] = _replace(root[head], rest, value)
    return copy


_INTS = (-1, 0, 1, 2, 7, 63, 4095, 4097, 2**31, 2**63 - 1, 2**64 + 5)
_STRS = ("", "x", "float33", "bfloat16", "object", "s0", "bundle/nope", "IreeBackend", "vmfb", "inline")


def _mutant(rng: np.random.Generator, value: Any) -> Any:
    if isinstance(value, bool):
        return [not value, 0, "true", None][int(rng.integers(4))]
    if isinstance(value, int):
        choice = int(rng.integers(4))
        if choice == 0:
            return value + int(rng.choice([-1, 1]))
        if choice == 1:
            return -value - 1
        return _INTS[int(rng.integers(len(_INTS)))]
    if isinstance(value, str):
        choice = int(rng.integers(3))
        if choice == 0 and value:
            return value[:-1]
        return _STRS[int(rng.integers(len(_STRS)))]
    if isinstance(value, list):
        if value and rng.integers(2):
            index = int(rng.integers(len(value)))
            return value[:index] + value[index + 1:]
        return value + value[-1:] if value else [0]
    if isinstance(value, dict):
        if value and rng.integers(2):
            key = list(value)[int(rng.integers(len(value)))]
            return {k: v for k, v in value.items() if k != key}
        return {**value, "extra": 1}
    return 0


def structured(data: bytes, rng: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    """`count` programs with one field of the header changed (a value, or an element or key dropped or added)."""
    header_end, _ = layout(data)
    header = msgspec.json.decode(data[PREAMBLE.size:header_end])
    leaves = list(_leaves(header))[1:]
    made = 0
    while made < count:
        path, value = leaves[int(rng.integers(len(leaves)))]
        new = _mutant(rng, value)
        out = with_header(data, _replace(header, path, new))
        if out is not None:
            made += 1
            yield f"header{list(path)}={str(new)[:40]}", out


def byte_flips(data: bytes, rng: np.random.Generator, count: int, start: int, end: int) -> Iterator[tuple[str, bytes]]:
    """`count` copies with 1 to 3 random bytes of [start, end) set to random values."""
    for _ in range(count):
        damaged = bytearray(data)
        places = rng.integers(start, end, size=int(rng.integers(1, 4)))
        for place in places:
            damaged[place] = (damaged[place] + int(rng.integers(1, 256))) % 256
        yield f"flip{sorted(places.tolist())}", bytes(damaged)


def truncations(data: bytes, rng: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    """Cut at the edges that matter (preamble, header, each segment's end) and at `count` random lengths."""
    header_end, data_offset = layout(data)
    header = msgspec.json.decode(data[PREAMBLE.size:header_end])
    edges = {0, 1, 7, 8, 31, 32, header_end - 1, header_end, data_offset, len(data) - 1}
    for segment in header["segments"]:
        end = data_offset + segment["offset"] + segment["length"]
        edges.update({end - 1, end})
    lengths = sorted(edges | set(rng.integers(0, len(data), size=count).tolist()))
    for length in lengths:
        if 0 <= length < len(data):
            yield f"cut{length}", data[:length]


def foreign(data: bytes, rng: np.random.Generator, count: int) -> Iterator[tuple[str, bytes]]:
    """Random bytes; random bytes after onecopy's magic; a whole preamble before a random header."""
    for i in range(count):
        size = int(rng.integers(1, 20000))
        noise = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
        kind = i % 3
        if kind == 0:
            yield f"random{size}", noise
        elif kind == 1:
            yield f"magic+random{size}", data[:8] + noise
        else:
            header_len = int(rng.integers(0, size + 64))
            yield f"preamble+random{size}", data[:16] + struct.pack("<QQ", header_len, 4096) + noise
