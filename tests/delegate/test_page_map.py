import gc
import os
import weakref

import numpy as np

from onecopy.delegate.page_map import PAGE, map_pages, write_pages


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
