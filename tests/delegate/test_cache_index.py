"""The cache index: uses are written off the restore's path, and none is lost or counted twice."""

import os
import time

from onecopy.delegate.cache_index import CacheIndex


def make_index(tmp_path) -> CacheIndex:
    index = CacheIndex(tmp_path / "index.sqlite")
    index.record("k" * 64, size=10, program="p", packaging="mlir", compute_units="cpu", target="x86_64")
    return index


def test_queued_uses_are_written_before_anything_in_the_process_reads_the_index(tmp_path):
    index = make_index(tmp_path)
    before = time.time()
    for _ in range(3):
        index.touch_later("k" * 64)
    (entry,) = index.ls()  # ls waits for the queued uses
    assert entry.hits == 3
    assert entry.last_access >= before


def test_a_forked_child_counts_its_own_uses_and_never_waits_on_its_parents_writer(tmp_path):
    index = make_index(tmp_path)
    index.touch_later("k" * 64)  # queued in the parent; its writer thread does not exist in a child
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            index.touch_later("k" * 64)
            index.flush()  # would wait for ever on the parent's queue if the child adopted it
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the forked child hung flushing the index"
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    (entry,) = index.ls()
    assert entry.hits == 2  # the parent's use once (not again by the child), the child's own once


def test_a_damaged_index_is_replaced_by_an_empty_one_with_a_warning(tmp_path, caplog):
    # A stray or damaged file failed every load with sqlite's "file is not a database", blamed on the program.
    (tmp_path / "index.sqlite").write_bytes(b"not a database at all, and longer than a header" * 4)
    index = CacheIndex(tmp_path / "index.sqlite")
    assert index.ls() == []
    assert "is damaged" in caplog.text
    index.record("k" * 64, size=10, program="p", packaging="mlir", compute_units="cpu", target="x86_64")
    assert [e.key for e in CacheIndex(tmp_path / "index.sqlite").ls()] == ["k" * 64]
