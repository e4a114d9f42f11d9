"""The surface header and the arguments of create/open: what an opener validates, what a bad value says."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from onecopy.errors import InvalidArgument
from onecopy.surface import SHM_DIR, Surface
from tests.surface.conftest import NAME_RULE, RUN


def corrupt(path: str, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "8s", b"GARBAGE!", r"is not a onecopy surface \(magic b'GARBAGE!', expected b'ONECSURF'\)"),
        (8, "<I", 3, r"has header version 3; this onecopy reads version 2\. Upgrade onecopy\."),
        (8, "<I", 1, r"has header version 1; this onecopy reads version 2\. It was made by an older onecopy whose "
                     r"lock this one does not share; recreate it with this onecopy\."),
        (12, "<I", 7, r"has unknown format code 7; expected one of 1 \(float16\), 2 \(float32\), 3 \(uint8\)"),
        (16, "<Q", 0, r"has an invalid size 0x360 in its header"),
        (16, "<Q", 5, r"header describes 3840 bytes of data at offset 4096, but the file holds only 7168 bytes"),
        (24, "<Q", 400, r"has 768 bytes per row, which does not hold 400 float16 values padded to 64 bytes"),
        (32, "<Q", 700, r"has 700 bytes per row, which does not hold 360 float16 values"),
        (40, "<Q", 100, r"has data offset 100, not a multiple of 4096 past the header"),
    ],
    ids=["magic", "newer-version", "older-version", "format", "zero-height", "too-tall", "too-wide", "short-rows", "data-offset"],
)
def test_open_rejects_a_corrupted_header(surfaces, name, offset, fmt, value, message):
    surface = surfaces(4, 360, name=name)
    corrupt(surface.path, offset, fmt, value)
    with pytest.raises(InvalidArgument, match=rf"^Surface '{name}' \(/dev/shm/onecopy-{name}\).*{message}"):
        Surface.open(name)


def test_open_rejects_a_garbage_file_too_small_for_a_header(name):
    Path(SHM_DIR, f"onecopy-{name}").write_bytes(b"not a surface")
    with pytest.raises(InvalidArgument) as error:
        Surface.open(name)
    assert str(error.value) == (
        f"Surface '{name}' (/dev/shm/onecopy-{name}) holds 13 bytes, too few for a surface header; "
        "unlink it or pick another name."
    )


def test_open_rejects_a_garbage_file_of_a_plausible_size(name):
    Path(SHM_DIR, f"onecopy-{name}").write_bytes(os.urandom(8192))
    with pytest.raises(InvalidArgument, match="is not a onecopy surface"):
        Surface.open(name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"height": 0}, "Surface height must be between 1 and 2147483647, got 0."),
        ({"width": -3}, "Surface width must be between 1 and 2147483647, got -3."),
        ({"height": 1.5}, "Surface height must be a positive int, got float 1.5; pass e.g. height=1080."),
        ({"width": True}, "Surface width must be a positive int, got bool True; pass e.g. width=1080."),
        ({"dtype": "float64"}, "Surface dtype 'float64' is not supported; use 'float16', 'float32' or 'uint8'."),
        ({"dtype": ">f2"}, "Surface dtype '>f2' is not supported; use 'float16', 'float32' or 'uint8'."),
        ({"dtype": "fp17"}, "Surface dtype 'fp17' is not a dtype; use 'float16', 'float32' or 'uint8'."),
        ({"name": "a/b"}, f"Surface name 'a/b' is not valid; {NAME_RULE}"),
        ({"name": ""}, f"Surface name '' is not valid; {NAME_RULE}"),
        ({"name": "x" * 129}, f"Surface name '{'x' * 129}' is not valid; use 1 to 128 characters"),
        ({"name": 7}, "Surface name 7 is not valid; use 1 to 128 characters"),
    ],
)
def test_bad_arguments_to_create_say_what_and_how_to_fix(kwargs, message):
    arguments = {"height": 2, "width": 8, "dtype": "float16", "name": f"{RUN}-bad", **kwargs}
    with pytest.raises(InvalidArgument) as error:
        Surface.create(**arguments)
    assert str(error.value).startswith(message)


def test_numpy_integers_are_accepted_as_sizes(surfaces):
    assert surfaces(np.int64(2), np.uint16(360)).shape == (2, 360)
