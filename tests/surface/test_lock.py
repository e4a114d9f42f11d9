"""Surface locks: readers share, a writer excludes, across threads and processes; the generation counter."""

from __future__ import annotations

import threading

import pytest

from onecopy.errors import InvalidArgument, OnecopyError
from onecopy.surface import Surface
from onecopy.surface._lockcore import LockCore
from onecopy.surface.lock import give_all, take_all, wake_waiting
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


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_process_that_dies_holding_the_lock_is_reaped_by_the_next_one_waiting(surfaces, name, mode):
    """Its slot still says it holds the lock; its byte lock on the slot went with it, so a waiter clears it."""
    surface = surfaces(2, 8, name=name)
    with Holder(name, mode) as holder:
        with pytest.raises(OnecopyError, match="could not take the write lock"):
            with surface.lock(timeout=0.05):
                pass
        holder.kill()
        with surface.lock(timeout=30):  # the first attempt fails, the reap clears the dead slot, the next succeeds
            pass
    assert surface.generation == 1  # ours: a writer that died never gave its lock back


def test_writers_in_three_processes_and_a_reader_never_overlap(surfaces, name):
    """Mutual exclusion under a real race: two children and this process each add 1 to a value, N times, under
    the write lock (read, then write back: a lost update shows in the total); a reader thread checks that it
    never sees a half-done update (the two values written one after the other differ)."""
    import subprocess
    import sys

    from tests.surface.conftest import ROOT

    count = 400
    surface = surfaces(1, 16, "float32", name=name)
    children = [subprocess.Popen([sys.executable, "-m", "tests.surface.surface_child", "count", name, str(count)],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
    torn, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            with surface.lock(readonly=True, timeout=60) as frame:
                if frame[0, 0] != frame[0, 1]:
                    torn.append((float(frame[0, 0]), float(frame[0, 1])))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(count):
            with surface.lock(timeout=60) as frame:
                value = frame[0, 0]
                frame[0, 1] = value + 1
                frame[0, 0] = value + 1
        for child in children:
            _, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
    finally:
        stop.set()
        reader.join()
        for child in children:
            child.kill()
            child.communicate()
    assert torn == []
    assert surface.array()[0, 0] == 3 * count
    assert surface.generation == 3 * count


def test_each_surface_object_claims_a_slot_and_a_closed_ones_slot_is_claimed_again(surfaces, name):
    surface = surfaces(2, 8, name=name)
    first = Surface.open(name)
    second = Surface.open(name)
    slots = {surface._lock.core.slot, first._lock.core.slot, second._lock.core.slot}
    assert slots == {0, 1, 2}
    freed = first._lock.core.slot
    first.close()
    with Surface.open(name) as again:
        assert again._lock.core.slot == freed
    second.close()


def test_a_surface_used_by_more_objects_than_its_slots_refuses_the_next_open(surfaces, name):
    from onecopy.surface.header import SLOT_COUNT

    surface = surfaces(2, 8, name=name)
    opened = [Surface.open(name) for _ in range(SLOT_COUNT - 1)]
    try:
        with pytest.raises(OnecopyError, match=f"in use by {SLOT_COUNT} surface objects at once"):
            Surface.open(name)
        opened.pop().close()
        with Surface.open(name):  # a slot was given back
            pass
    finally:
        for other in opened:
            other.close()
    with surface.lock(blocking=False):
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


# -- the engine's path: all of one call's locks in one C call (take_all / give_all) --------------------------------


def _cores(*surfaces):
    return tuple(s._lock.core for s in surfaces)


def test_take_all_takes_reads_and_writes_and_give_all_moves_only_written_generations(surfaces):
    a, b = surfaces(2, 8), surfaces(2, 8)
    cores, modes = _cores(a, b), (True, False)
    assert take_all(cores, modes, threading.get_ident()) == 2
    assert a._lock.held() == "1 read lock(s)" and b._lock.held() == "a write lock"
    with pytest.raises(OnecopyError, match="could not take the write lock"):
        a.acquire(False, 0)  # a thread of this process reads it: no writer
    assert give_all(cores, modes, 2) is False  # nobody waits
    assert a._lock.held() is None and b._lock.held() is None
    assert (a.generation, b.generation) == (0, 1)
    with Surface.open(b.name) as other:  # the counter is the shared header's, seen by every opener
        assert other.generation == 1


def test_take_all_stops_at_a_lock_another_process_holds(surfaces, name):
    free, held = surfaces(2, 8), surfaces(2, 8, name=name)
    cores, modes = _cores(free, held), (False, True)
    with Holder(name, "write"):
        assert take_all(cores, modes, threading.get_ident()) == 1  # the first taken, the second would wait
        assert give_all(cores, modes, 1) is False
    assert free.generation == 1 and held._lock.held() is None


def test_give_all_says_when_threads_wait_and_they_take_the_lock_once_woken(surfaces):
    surface = surfaces(2, 8)
    cores, modes = _cores(surface), (False,)
    assert take_all(cores, modes, threading.get_ident()) == 1
    taken = threading.Event()

    def reader():
        surface.acquire(True, 30)
        taken.set()
        surface.release(True)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(3000):
        if surface._lock.core.waiting:
            break
        threading.Event().wait(0.001)
    assert surface._lock.core.waiting == 1
    assert give_all(cores, modes, 1) is True
    wake_waiting([surface._lock])
    assert taken.wait(30)
    thread.join(30)
    assert surface.generation == 1 and surface._lock.core.waiting == 0


def test_releasing_a_lock_not_held_is_an_error_not_a_corrupted_count(surfaces):
    surface = surfaces(2, 8)
    with pytest.raises(RuntimeError, match="released a read lock this process does not hold"):
        give_all(_cores(surface), (True,), 1)
    with pytest.raises(RuntimeError, match="released a write lock this process does not hold"):
        surface._lock.core.release(False)
    with pytest.raises(InvalidArgument, match="holds no read lock on it to release"):
        surface.release(True)
    assert surface._lock.core.readers == 0
    with surface.lock(blocking=False):
        pass


def test_a_thread_cannot_release_a_write_lock_another_thread_holds(surfaces):
    surface = surfaces(2, 8)
    with pytest.raises(InvalidArgument, match="holds no write lock on it to release \\(nobody in this process holds it\\)"):
        surface.release()
    taken, done = threading.Event(), threading.Event()

    def writer():
        surface.acquire()
        taken.set()
        done.wait(30)
        surface.release()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert taken.wait(30)
        with pytest.raises(InvalidArgument, match="holds no write lock on it to release \\(another thread holds it\\)"):
            surface.release()
        assert surface._lock.core.writer == thread.ident  # still the writer's
        with pytest.raises(OnecopyError, match="is locked by another process or thread"):
            surface.acquire(readonly=True, timeout=0)
    finally:
        done.set()
        thread.join(30)
    assert surface.generation == 1  # the writer's own release, once
    with surface.lock(blocking=False):
        pass


def test_bad_arguments_to_the_native_calls_raise(surfaces):
    surface = surfaces(2, 8)
    with pytest.raises(TypeError):
        take_all((object(),), (True,), 1)
    with pytest.raises(ValueError, match="one mode per lock"):
        take_all(_cores(surface), (), 1)
    with pytest.raises(ValueError, match="count out of range"):
        give_all(_cores(surface), (True,), 2)
    with pytest.raises(TypeError, match="modes must be bools"):
        give_all(_cores(surface), (1,), 1)
    with pytest.raises(ValueError, match="does not fit"):
        LockCore(0, bytearray(16), 12, 0, 0, 1)
    with pytest.raises(ValueError, match="does not fit"):
        LockCore(0, bytearray(64), 8, 16, 32, 8)  # 8 slots of 8 bytes from byte 32 overrun the map


def test_a_closed_lock_lets_go_of_the_map(tmp_path):
    import mmap

    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    with open(path, "r+b") as f:
        surface_map = mmap.mmap(f.fileno(), 64)
        core = LockCore(f.fileno(), surface_map, 8, 16, 32, 4)
        with pytest.raises(BufferError):
            surface_map.close()  # the core holds the counter's bytes
        assert core.try_acquire(False, 1) and not core.release(False)
        assert int.from_bytes(surface_map[8:16], "little") == 1
        core.mark_closed()
        assert not core.try_acquire(True, 1)
        surface_map.close()
