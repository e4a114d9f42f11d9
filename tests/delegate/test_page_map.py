import gc
import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from onecopy.delegate.page_map import HUGE_PAGE, PAGE, _aligned_base, huge_mapped_bytes, map_pages, write_pages
from tests.delegate import huge_probe


class Owner:
    """Stands for the cache entry whose collection unmaps the range."""


def test_duplicate_pages_are_stored_once_and_mapped_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, 3 * PAGE, dtype=np.uint8)
    b = rng.integers(0, 255, 2 * PAGE, dtype=np.uint8)
    packed = np.concatenate([a, b, a, b[:100]])  # the layout the parameter encoder produces: weights repeated
    path = tmp_path / "encoded.bin"
    with open(path, "w+b") as f:
        layout = write_pages(f, {"parameter0": packed})
    assert path.stat().st_size == 6 * PAGE  # a, b, and the partial last page of b (zero-padded)
    owner = Owner()
    fd = os.open(path, os.O_RDONLY)
    try:
        view = map_pages(fd, layout[0], owner)
    finally:
        os.close(fd)
    assert view.nbytes == packed.nbytes
    assert np.array_equal(np.frombuffer(view, np.uint8), packed)
    assert view.readonly


def test_mapping_outlives_the_file_descriptor_and_goes_with_its_owner(tmp_path):
    data = np.arange(4 * PAGE, dtype=np.uint8)
    path = tmp_path / "encoded.bin"
    with open(path, "w+b") as f:
        layout = write_pages(f, {"p": np.concatenate([data, data])})
    owner = Owner()
    unmapped = []
    weakref.finalize(owner, unmapped.append, True)
    fd = os.open(path, os.O_RDONLY)
    view = map_pages(fd, layout[0], owner)
    os.close(fd)
    array = np.frombuffer(view, np.uint8)
    del view
    gc.collect()
    assert np.array_equal(array[: data.nbytes], data) and np.array_equal(array[data.nbytes :], data)
    del array, owner
    gc.collect()
    assert unmapped == [True]  # the range goes with its owner, from Python


@pytest.mark.parametrize("reservation_page", [0, 1, 300, 511])
def test_the_range_starts_where_its_largest_runs_line_up_with_their_file_pages(reservation_page):
    per = HUGE_PAGE // PAGE
    reservation = (1000 * per + reservation_page) * PAGE
    # File page 3 at virtual page 0 for 4 huge pages' worth; a deduplicated run at another offset, and a run
    # too short to hold a huge page whatever its offset: the first decides.
    runs = [[0, 3, 3 * per], [3 * per, 3 * per + 3, per], [4 * per, 7, 2 * per], [6 * per, 1, 5]]
    base = _aligned_base(reservation, runs)
    assert reservation <= base < reservation + HUGE_PAGE  # inside the reservation's extra huge page
    assert (base // PAGE - 3) % per == 0  # virtual page 0 sits where file page 3 sits within a huge page
    assert _aligned_base(reservation, [[0, 0, 5]]) == reservation + (-reservation_page % per) * PAGE  # no whole huge page: aligned


def _pss_and_rss(path) -> tuple[int, int]:
    kib = huge_probe.mapped_kib(path, "Pss", "Rss")
    return kib["Pss"], kib["Rss"]


CHILD = """
import os, sys
from onecopy.delegate.page_map import map_pages, huge_mapped_bytes
import json
layout = json.loads(sys.argv[2])
fd = os.open(sys.argv[1], os.O_RDONLY)
class Owner: pass
owner = Owner()
view = map_pages(fd, layout, owner)
print(huge_mapped_bytes(view), flush=True)
sys.stdin.readline()
"""


def test_weights_map_on_huge_pages_shared_with_another_process_where_the_kernel_can(tmp_path):
    if not huge_probe.file_pages_map_huge(tmp_path):
        pytest.skip(huge_probe.SKIP_REASON)
    per = HUGE_PAGE // PAGE
    first = np.random.default_rng(1).integers(0, 255, (3 * per + 5) * PAGE, dtype=np.uint8)
    # The encoder's layout: weights packed again further on; this copy points back at file pages 5 pages off a
    # huge page's alignment, so only the first copy can be mapped huge.
    packed = np.concatenate([first, first[:HUGE_PAGE]])
    path = tmp_path / "encoded.bin"
    with open(path, "w+b") as f:
        (entry,) = write_pages(f, {"parameter0": packed})
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # as a published cache entry is left
    fd = os.open(path, os.O_RDONLY)
    owner = Owner()
    view = map_pages(fd, entry, owner)
    os.close(fd)
    assert np.array_equal(np.frombuffer(view, np.uint8), packed)
    assert huge_probe.file_pmd_mapped(path) == 3 * HUGE_PAGE  # the first copy's three whole huge pages
    assert huge_mapped_bytes(view) == 3 * HUGE_PAGE
    alone, rss = _pss_and_rss(path)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), json.dumps(entry)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert int(child.stdout.readline()) == 3 * HUGE_PAGE  # the same folios, mapped huge there too
        shared, rss_now = _pss_and_rss(path)
    finally:
        child.communicate("\n", timeout=60)
    assert rss_now == rss
    # One copy in memory: with a second process mapping the same pages, this one's share halves.
    assert shared == pytest.approx(alone / 2, rel=0.05)
