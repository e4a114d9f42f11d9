"""Surfaces: row padding, views, opening by name, lifetimes (close, unlink, views alive), across processes."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onecopy.errors import InvalidArgument
from onecopy.surface import SHM_DIR, Surface
from tests.surface.conftest import ROOT, RUN, child


def test_rows_of_360_fp16_values_are_padded_to_768_bytes(surfaces):
    surface = surfaces(4, 360)
    assert surface.dtype == np.float16
    assert surface.bytes_per_row == 768
    assert surface.nbytes == 4 * 768
    assert surface.shape == (4, 360)
    frame = surface.array()
    assert frame.shape == (4, 360)
    assert frame.strides == (768, 2)
    assert frame.dtype == np.float16
    assert frame.flags.writeable
    assert not surface.dense
    assert not frame.flags.c_contiguous


def test_rows_of_1920_fp16_values_need_no_padding_and_are_dense(surfaces):
    surface = surfaces(2, 1920, "float16")
    assert surface.bytes_per_row == 3840
    assert surface.dense
    frame = surface.array()
    assert frame.strides == (3840, 2)
    assert frame.flags.c_contiguous


@pytest.mark.parametrize(
    ("dtype", "width", "bytes_per_row", "dense"),
    [
        (np.float32, 10, 64, False),
        (np.dtype("float32"), 16, 64, True),
        ("float32", 17, 128, False),
        ("uint8", 65, 128, False),
        (np.uint8, 1920, 1920, True),
    ],
)
def test_float32_and_uint8_rows_are_padded_to_64_bytes(surfaces, dtype, width, bytes_per_row, dense):
    surface = surfaces(3, width, dtype)
    assert surface.dtype == np.dtype(dtype)
    assert surface.bytes_per_row == bytes_per_row
    assert surface.dense is dense
    assert surface.array().strides == (bytes_per_row, np.dtype(dtype).itemsize)


def test_padded_view_is_dense_over_rows_and_their_padding(surfaces):
    surface = surfaces(3, 360)
    whole = surface.array(include_padding=True)
    assert whole.shape == (3, 384)
    assert whole.flags.c_contiguous
    whole[1, :360] = 7
    whole[1, 360:] = 9
    frame = surface.array()
    assert (frame[1] == 7).all()
    assert (frame[0] == 0).all() and (frame[2] == 0).all()


def test_base_address_is_the_views_data_pointer_and_page_aligned(surfaces):
    for width in (360, 1920):
        surface = surfaces(5, width)
        frame = surface.array()
        assert surface.base_address == frame.__array_interface__["data"][0]
        assert surface.base_address % 64 == 0
        assert surface.base_address % 4096 == 0
        assert surface.array(include_padding=True).__array_interface__["data"][0] == surface.base_address


def test_a_new_surface_is_zeroed_and_views_share_its_memory(surfaces):
    surface = surfaces(2, 8, "float32")
    first, second = surface.array(), surface.array()
    assert (first == 0).all()
    first[1, 3] = 2.5
    assert second[1, 3] == 2.5


def test_opening_in_the_same_process_maps_the_same_memory(surfaces, name):
    surface = surfaces(2, 360, name=name)
    surface.array()[1, 5] = 3
    with Surface.open(name) as same:
        assert (same.shape, same.dtype, same.bytes_per_row) == ((2, 360), np.float16, 768)
        assert same.array()[1, 5] == 3
        assert same.base_address != surface.base_address  # its own mapping of the same pages


def test_generated_names_are_unique_and_openable(surfaces):
    a, b = surfaces(1, 1), surfaces(1, 1)
    assert a.name != b.name
    assert Path(a.path) == Path(SHM_DIR, f"onecopy-{a.name}")
    with Surface.open(a.name) as same:
        assert same.shape == (1, 1)


def test_create_with_an_existing_name_fails_and_keeps_the_first(surfaces, name):
    first = surfaces(2, 4, "uint8", name=name)
    first.array()[:] = 5
    with pytest.raises(InvalidArgument, match=rf"A surface named '{name}' already exists \(/dev/shm/onecopy-{name}\)"):
        Surface.create(8, 8, "float32", name=name)
    with Surface.open(name) as same:
        assert (same.shape, same.dtype) == ((2, 4), np.uint8)
        assert (same.array() == 5).all()


def test_open_of_a_missing_name_fails_naming_it(name):
    with pytest.raises(InvalidArgument) as error:
        Surface.open(name)
    assert str(error.value) == (
        f"No surface named '{name}' (/dev/shm/onecopy-{name}); create it first with Surface.create(..., name='{name}')."
    )


@pytest.mark.parametrize("child_closes", [True, False], ids=["child-closes", "child-exits-without-closing"])
def test_a_second_process_writes_a_frame_and_the_surface_outlives_it(surfaces, name, child_closes):
    # The Python 3.11 trap: multiprocessing.shared_memory unlinks a segment when a process that opened it exits.
    surface = surfaces(3, 360, name=name)
    result = child("write", name, "1.5", *([] if child_closes else ["--no-close"]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"
    assert Path(surface.path).exists()
    with surface.lock(readonly=True) as frame:
        assert (frame == np.float16(1.5)).all()
    assert surface.generation == 1
    with Surface.open(name) as again:
        assert (again.array() == np.float16(1.5)).all()


def test_a_closed_surface_refuses_base_address_array_and_lock(surfaces):
    surface = surfaces(2, 8)
    surface.close()
    assert surface.is_closed
    expected = (
        f"Surface '{surface.name}' is closed; {{}} needs an open surface. "
        f"Open it again with Surface.open('{surface.name}')."
    )
    for what, use in [
        ("base_address", lambda: surface.base_address),
        ("array()", surface.array),
        ("lock()", lambda: surface.lock().__enter__()),
        ("generation", lambda: surface.generation),
    ]:
        with pytest.raises(InvalidArgument) as error:
            use()
        assert str(error.value) == expected.format(what)
    surface.close()  # idempotent
    assert repr(surface).endswith("closed)")


def mapped(surface: Surface) -> bool:
    # By inode, since the maps line of an unlinked file ends in "(deleted)".
    inode = str(os.stat(surface.path).st_ino)
    return any(line.split()[4] == inode for line in Path("/proc/self/maps").read_text().splitlines())


def test_views_alive_at_close_keep_their_memory_until_they_go(surfaces):
    surface = surfaces(2, 8)
    frame = surface.array()
    row = frame[1]
    del frame  # the slice alone must keep the memory
    assert surface.views_alive == 1
    surface.close()
    assert mapped(surface)
    row[:] = 4  # still valid memory, not a use after free
    assert (row == 4).all()
    with Surface.open(surface.name) as same:
        assert (same.array()[1] == 4).all()
    del row
    assert surface.views_alive == 0
    assert not mapped(surface)


def test_close_without_views_unmaps_at_once(surfaces):
    surface = surfaces(2, 8)
    assert mapped(surface)
    surface.close()
    assert not mapped(surface)


def test_unlink_removes_the_shm_file_and_mappings_stay_usable(name):
    surface = Surface.create(2, 8, name=name)
    with Surface.open(name) as opener:
        surface.unlink()
        assert not Path(surface.path).exists()
        assert opener.unlinked and surface.unlinked
        opener.array()[0, 0] = 6
        assert surface.array()[0, 0] == 6
        with pytest.raises(InvalidArgument, match="No surface named"):
            Surface.open(name)
    surface.unlink()  # idempotent
    surface.close()


def test_unlink_leaves_a_newer_surface_that_took_the_name(name):
    old = Surface.create(1, 8, name=name)
    late = Surface.open(name)  # a second holder of the old surface, which unlinks after the name was reused
    old.unlink()
    with Surface.create(1, 8, name=name) as new:
        late.unlink()
        assert Path(new.path).exists()
        assert late.unlinked
    late.close()
    old.close()


def test_the_creators_with_block_closes_and_unlinks_an_openers_only_closes(name):
    with Surface.create(2, 8, name=name) as creator:
        with Surface.open(name) as opener:
            pass
        assert opener.is_closed
        assert Path(creator.path).exists()
    assert creator.is_closed
    assert not Path(creator.path).exists()


def test_leaving_the_creators_with_block_tells_every_opener_it_is_unlinked(name):
    with Surface.create(2, 8, name=name):
        opener = Surface.open(name)
        assert not opener.unlinked
    assert not Path(opener.path).exists()
    assert opener.unlinked  # the shared flag, not only the name's absence
    opener.close()


def test_unlink_after_close_still_sets_the_shared_flag(name):
    creator = Surface.create(2, 8, name=name)
    opener = Surface.open(name)
    creator.close()
    creator.unlink()
    assert not Path(opener.path).exists()
    assert opener.unlinked
    opener.close()


def test_a_closed_surfaces_unlink_neither_removes_nor_flags_a_newer_surface_that_took_the_name(name):
    old = Surface.create(1, 8, name=name)
    late = Surface.open(name)
    old.unlink()
    late.close()
    with Surface.create(1, 8, name=name) as new:
        late.unlink()  # closed: it would flag the surface through the file, were the file still its own
        assert Path(new.path).exists()
        assert not new.unlinked
    old.close()


OPENER = """
import sys
from onecopy.surface import Surface
surface = Surface.open(sys.argv[1])
print(surface.unlinked, flush=True)
sys.stdin.readline()
print(surface.unlinked, flush=True)
surface.close()
"""


def test_an_opener_in_another_process_sees_the_creators_with_block_unlink(name):
    with Surface.create(2, 8, name=name):
        process = subprocess.Popen(
            [sys.executable, "-c", OPENER, name], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        try:
            ready, _, _ = select.select([process.stdout], [], [], 60)
            assert ready and process.stdout.readline().strip() == "False", process.stderr.read()
        except BaseException:
            process.kill()
            process.communicate()
            raise
    out, err = process.communicate("go\n", timeout=60)
    assert process.returncode == 0, err
    assert out.strip() == "True"


def test_a_surface_dropped_without_close_gives_its_descriptor_back(name):
    before = len(os.listdir("/proc/self/fd"))
    surface = Surface.create(2, 8, name=name)
    assert len(os.listdir("/proc/self/fd")) == before + 2  # ours and the map's
    del surface
    assert len(os.listdir("/proc/self/fd")) == before
    assert Path(SHM_DIR, f"onecopy-{name}").exists()  # only unlink() or the creator's with block removes it


def test_repr_names_the_surface_and_its_geometry(surfaces):
    surface = surfaces(2, 360, name=f"{RUN}-repr")
    assert repr(surface) == (
        f"Surface(name='{RUN}-repr', height=2, width=360, dtype=float16, bytes_per_row=768, open)"
    )


def test_bad_arguments_to_open_and_lock_say_what_and_how_to_fix(surfaces):
    with pytest.raises(InvalidArgument, match=r"Surface name '\.\./etc' is not valid"):
        Surface.open("../etc")
    surface = surfaces(2, 8)
    with pytest.raises(InvalidArgument, match="give either blocking=False or timeout=, not both"):
        with surface.lock(blocking=False, timeout=1):
            pass
    with pytest.raises(InvalidArgument, match=r"timeout must be a number of seconds >= 0 or None, got -1"):
        with surface.lock(timeout=-1):
            pass
    with surface.lock(blocking=False):  # a refused call leaves no lock behind
        pass


def test_the_creators_mapping_is_named_after_the_surface(surfaces):
    # Not after the temporary file it was built in: /proc/<pid>/maps is how one finds who maps a surface.
    surface = surfaces(2, 8)
    lines = Path("/proc/self/maps").read_text().splitlines()
    assert any(line.endswith(surface.path) for line in lines)
    assert not any(".onecopy-tmp-" in line for line in lines)
