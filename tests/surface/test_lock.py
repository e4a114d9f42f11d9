"""Surface locks: readers share, a writer excludes, across threads and processes; the generation counter."""

from __future__ import annotations

import threading

import pytest

from onecopy.errors import InvalidArgument, OnecopyError
from onecopy.surface import Surface
from tests.surface.conftest import Holder


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


def test_acquire_and_release_lock_without_a_view_like_lock_does(surfaces):
    surface = surfaces(2, 64)
    surface.acquire(readonly=True)
    surface.acquire(readonly=True)  # readers share, in one thread too
    with pytest.raises(OnecopyError, match="could not take the write lock without waiting"):
        threading_result = []
        worker = threading.Thread(target=lambda: threading_result.append(_try_write(surface)))
        worker.start()
        worker.join()
        raise threading_result[0]
    surface.release(readonly=True)
    surface.release(readonly=True)
    assert surface.generation == 0
    surface.acquire()
    surface.release()
    assert surface.generation == 1  # a writer's release moves the generation on, as lock() does
    surface.close()
    with pytest.raises(InvalidArgument, match="is closed; lock\\(\\) needs an open surface"):
        surface.acquire(readonly=True)


def _try_write(surface: Surface) -> Exception:
    try:
        with surface.lock(blocking=False):
            pass
    except Exception as e:  # handed back to the test thread
        return e
    return AssertionError("the write lock was taken while readers held the surface")
