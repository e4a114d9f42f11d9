"""The surface header: the format every process agrees on, and the checks of what a creator or opener is given.

A surface file starts with a 64-byte header (little-endian: magic, header version, format code, height, width,
bytes_per_row, data offset, generation, flags); then, at byte 128, the lock's words: how many lock slots were ever
claimed, and from byte 192 the slots, one 8-byte word per LockCore that uses the surface (`_lockcore.c`). Its data
starts on the next page. `open` validates a header (`check_header`) before it hands out any memory, so a foreign,
truncated or other-version file is refused with a reason.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import numpy as np

from onecopy.errors import InvalidArgument

__all__ = [
    "SHM_DIR", "PREFIX", "ROW_ALIGNMENT", "DATA_OFFSET", "HEADER_VERSION", "FORMATS", "CODES", "MAGIC", "HEADER",
    "U64", "GENERATION_AT", "FLAGS_AT", "FLAG_UNLINKED", "SLOTS_USED_AT", "SLOTS_AT", "SLOT_COUNT", "check_dimension", "check_dtype", "check_name",
    "row_bytes", "check_header",
]

SHM_DIR = "/dev/shm"
PREFIX = "onecopy-"
ROW_ALIGNMENT = 64  # bytes; every row starts on a cache line
DATA_OFFSET = 4096  # the data starts on its own page, so base_address is page-aligned
# 2: the lock is the header's slots (1 took a flock on the file: the two would not exclude each other).
HEADER_VERSION = 2
# Format codes stored in the header; never renumber them, other processes read them.
FORMATS = {1: np.dtype(np.float16), 2: np.dtype(np.float32), 3: np.dtype(np.uint8)}
CODES = {dtype: code for code, dtype in FORMATS.items()}

MAGIC = b"ONECSURF"
# magic, header version, format, height, width, bytes_per_row, data offset, generation, flags (little-endian)
HEADER = struct.Struct("<8sIIQQQQQQ")
U64 = struct.Struct("<Q")
GENERATION_AT = 48
FLAGS_AT = 56
SLOTS_USED_AT = 128
SLOTS_AT = 192
SLOT_COUNT = 64  # LockCores (processes, or one process opening it twice) using one surface at once
FLAG_UNLINKED = 1
NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
MAX_DIMENSION = 2**31 - 1


def check_dimension(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(
            f"Surface {what} must be a positive int, got {type(value).__name__} {value!r}; pass e.g. {what}=1080."
        )
    if not 0 < value <= MAX_DIMENSION:
        raise InvalidArgument(f"Surface {what} must be between 1 and {MAX_DIMENSION}, got {value}.")
    return int(value)


def check_dtype(value: Any) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"Surface dtype {value!r} is not a dtype; use 'float16', 'float32' or 'uint8'."
        ) from e
    if dtype not in CODES:
        raise InvalidArgument(f"Surface dtype {value!r} is not supported; use 'float16', 'float32' or 'uint8'.")
    return dtype


def check_name(value: Any) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise InvalidArgument(
            f"Surface name {value!r} is not valid; use 1 to 128 characters from A-Z a-z 0-9 _ . - (e.g. 'camera0')."
        )
    return value


def row_bytes(width: int, dtype: np.dtype) -> int:
    return -(-width * dtype.itemsize // ROW_ALIGNMENT) * ROW_ALIGNMENT


def check_header(header: tuple, size: int, where: str) -> None:
    magic, version, code, height, width, bytes_per_row, data_offset, _, _ = header
    fix = "unlink it or pick another name"
    if magic != MAGIC:
        raise InvalidArgument(f"{where} is not a onecopy surface (magic {magic!r}, expected {MAGIC!r}); {fix}.")
    if version != HEADER_VERSION:
        fix_version = "Upgrade onecopy" if version > HEADER_VERSION else (
            "It was made by an older onecopy whose lock this one does not share; recreate it with this onecopy")
        raise InvalidArgument(
            f"{where} has header version {version}; this onecopy reads version {HEADER_VERSION}. {fix_version}."
        )
    if code not in FORMATS:
        known = ", ".join(f"{c} ({d})" for c, d in FORMATS.items())
        raise InvalidArgument(f"{where} has unknown format code {code}; expected one of {known}. {fix.capitalize()}.")
    itemsize = FORMATS[code].itemsize
    if not (0 < height <= MAX_DIMENSION and 0 < width <= MAX_DIMENSION):
        raise InvalidArgument(f"{where} has an invalid size {height}x{width} in its header; {fix}.")
    if bytes_per_row < width * itemsize or bytes_per_row % ROW_ALIGNMENT:
        raise InvalidArgument(
            f"{where} has {bytes_per_row} bytes per row, which does not hold {width} {FORMATS[code]} values padded "
            f"to {ROW_ALIGNMENT} bytes; {fix}."
        )
    if data_offset < HEADER.size or data_offset % DATA_OFFSET:
        raise InvalidArgument(
            f"{where} has data offset {data_offset}, not a multiple of {DATA_OFFSET} past the header; {fix}."
        )
    if data_offset + height * bytes_per_row > size:
        raise InvalidArgument(
            f"{where}: its header describes {height * bytes_per_row} bytes of data at offset {data_offset}, but the "
            f"file holds only {size} bytes; {fix}."
        )
