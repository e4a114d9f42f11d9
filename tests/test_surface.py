"""Surfaces: row padding, the shared-memory header, locks and lifetimes, across threads and processes."""

from __future__ import annotations

import os
import re
import select
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from onecopy.errors import InvalidArgument, OnecopyError
from onecopy.surface import SHM_DIR, Surface

NAME_RULE = "use 1 to 128 characters from A-Z a-z 0-9 _ . - (e.g. 'camera0')."
ROOT = Path(__file__).resolve().parents[1]
RUN = f"test-{os.getpid()}"  # every name this process makes starts so, and only those are cleaned or checked


def shm_files() -> set[str]:
    # Only this process's names: other test runs may share /dev/shm at the same time.
    mine = (f"onecopy-{RUN}", f".onecopy-tmp-{os.getpid()}-")
    return {f for f in os.listdir(SHM_DIR) if f.startswith(mine)}


@pytest.fixture(autouse=True)
def leaves_nothing_in_shm():
    before = shm_files()
    yield
    assert shm_files() == before


@pytest.fixture
def name(request):
    """A fresh surface name; its /dev/shm file is removed after the test whatever made it."""
    chosen = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{RUN}-{request.node.name}")[:100]
    yield chosen
    Path(SHM_DIR, f"onecopy-{chosen}").unlink(missing_ok=True)


@pytest.fixture
def surfaces():
    """Surface.create that closes and unlinks everything it made after the test."""
    made = []

    def create(*args, **kwargs):
        surface = Surface.create(*args, **kwargs)
        made.append(surface)
        return surface

    yield create
    for surface in made:
        surface.close()
        surface.unlink()


def child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.surface_child", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


class Holder:
    """A child process that holds the surface's lock until it is killed."""

    def __init__(self, name: str, mode: str) -> None:
        cmd = [sys.executable, "-m", "tests.surface_child", "hold", name, mode]
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Holder:
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else ""
        if line.strip() != "locked":
            self.__exit__()
            pytest.fail(f"the child did not take the lock: {line!r} {self.process.stderr.read()}")
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def __exit__(self, *exc_info) -> None:
        self.process.kill()
        self.process.communicate()  # reaps it and closes both pipes


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


def corrupt(path: str, offset: int, fmt: str, value) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "8s", b"GARBAGE!", r"is not a onecopy surface \(magic b'GARBAGE!', expected b'ONECSURF'\)"),
        (8, "<I", 2, r"has header version 2; this onecopy reads version 1\. Upgrade onecopy\."),
        (12, "<I", 7, r"has unknown format code 7; expected one of 1 \(float16\), 2 \(float32\), 3 \(uint8\)"),
        (16, "<Q", 0, r"has an invalid size 0x360 in its header"),
        (16, "<Q", 5, r"header describes 3840 bytes of data at offset 4096, but the file holds only 7168 bytes"),
        (24, "<Q", 400, r"has 768 bytes per row, which does not hold 400 float16 values padded to 64 bytes"),
        (32, "<Q", 700, r"has 700 bytes per row, which does not hold 360 float16 values"),
        (40, "<Q", 100, r"has data offset 100, not a multiple of 4096 past the header"),
    ],
    ids=["magic", "version", "format", "zero-height", "too-tall", "too-wide", "short-rows", "data-offset"],
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


def test_generation_increments_on_writable_unlock_only(surfaces):
    surface = surfaces(2, 8)
    assert surface.generation == 0
    with surface.lock(readonly=True):
        pass
    assert surface.generation == 0
    with surface.lock():
        assert surface.generation == 0
    assert surface.generation == 1
    with pytest.raises(RuntimeError):
        with surface.lock():
            raise RuntimeError("the data may have changed anyway")
    assert surface.generation == 2
    with Surface.open(surface.name) as same:
        assert same.generation == 2
        with same.lock(timeout=10):  # a lock left behind by the first object would make this fail, not hang
            pass
    assert surface.generation == 3


def test_a_writer_in_another_process_excludes_this_one_until_it_dies(surfaces, name):
    surface = surfaces(2, 8, name=name)
    with Holder(name, "write") as holder:
        with pytest.raises(OnecopyError) as error:
            with surface.lock(blocking=False):
                pytest.fail("took a lock another process holds")
        assert str(error.value) == (
            f"Surface '{name}' is locked by another process or thread; could not take the write lock without "
            "waiting. Retry later or pass a longer timeout=."
        )
        with pytest.raises(OnecopyError, match="could not take the read lock within 0.2 s"):
            with surface.lock(readonly=True, timeout=0.2):
                pass
        holder.kill()
        with surface.lock(timeout=30):
            pass
    assert surface.generation == 1


def test_readers_in_two_processes_share_the_lock_and_exclude_a_writer(surfaces, name):
    surface = surfaces(2, 8, name=name)
    with Holder(name, "read"):
        with surface.lock(readonly=True, blocking=False) as frame:
            assert not frame.flags.writeable
        with pytest.raises(OnecopyError, match="could not take the write lock"):
            with surface.lock(timeout=0.05):
                pass


def test_a_writer_thread_excludes_other_threads_and_readers_share(surfaces):
    surface = surfaces(2, 8)
    held, done = threading.Event(), threading.Event()

    def hold(readonly):
        with surface.lock(readonly=readonly, timeout=10):
            held.set()
            done.wait(30)

    thread = threading.Thread(target=hold, args=(False,))
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(OnecopyError, match="could not take the read lock within 0.05 s"):
            with surface.lock(readonly=True, timeout=0.05):
                pass
    finally:
        done.set()
        thread.join()
    held.clear()
    done.clear()
    thread = threading.Thread(target=hold, args=(True,))
    thread.start()
    try:
        assert held.wait(30)
        with surface.lock(readonly=True, blocking=False):
            pass
        with pytest.raises(OnecopyError, match="could not take the write lock"):
            with surface.lock(blocking=False):
                pass
    finally:
        done.set()
        thread.join()
    with surface.lock(blocking=False):
        pass


def test_two_surfaces_of_one_name_in_one_process_exclude_each_other(surfaces, name):
    surface = surfaces(2, 8, name=name)
    with Surface.open(name) as same, same.lock(timeout=10):
        with pytest.raises(OnecopyError):
            with surface.lock(blocking=False):
                pass
    with surface.lock(timeout=10):
        pass


def test_a_write_lock_cannot_be_nested_in_one_thread(surfaces):
    surface = surfaces(2, 8)
    for outer in (False, True):
        with surface.lock(readonly=outer):
            nested = "this thread already holds a lock on it; a write lock cannot be nested"
            with pytest.raises(InvalidArgument, match=nested):
                with surface.lock():
                    pass
    with surface.lock(readonly=True), surface.lock(readonly=True) as frame:  # nested reads are fine
        assert frame.shape == (2, 8)
    with surface.lock():
        pass


def test_a_readonly_lock_yields_a_read_only_view(surfaces):
    surface = surfaces(2, 8)
    with surface.lock(readonly=True) as frame:
        with pytest.raises(ValueError, match="read-only"):
            frame[0, 0] = 1
    with surface.lock() as frame:
        frame[0, 0] = 1
    assert surface.array()[0, 0] == 1


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


def test_close_is_refused_while_a_lock_is_held(surfaces):
    surface = surfaces(2, 8)
    with surface.lock():
        with pytest.raises(InvalidArgument) as error:
            surface.close()
        assert str(error.value) == (
            f"Surface '{surface.name}' cannot be closed while this process holds a write lock on it; "
            "leave the `with surface.lock()` block first."
        )
    surface.close()
    assert surface.is_closed


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
