"""The quarantine: buffers handed to IREE outlive the model that handed them, so IREE's threads never free them."""

import gc
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np

from onecopy.delegate import quarantine

ROOT = Path(__file__).resolve().parents[2]


class Buffer:
    """A stand-in for a mapping IREE imported (weak-referenceable, like the cache entry's page maps)."""


def test_held_objects_stay_alive_for_the_hold_time_then_are_freed_on_a_python_thread():
    obj = Buffer()
    alive = weakref.ref(obj)
    start = time.monotonic() + 100.0  # later than anything held by earlier tests: their entries are due first
    quarantine.hold([obj], now=start)
    del obj
    gc.collect()
    quarantine.release_due(now=start + quarantine.HOLD_S / 2)
    assert alive() is not None  # IREE's worker may still drop its reference now: ours must not be the only one
    quarantine.release_due(now=start + quarantine.HOLD_S)
    gc.collect()
    assert alive() is None


def test_a_closed_model_hands_everything_it_gave_the_engine_to_the_quarantine(small_program_path, tmp_path,
                                                                                monkeypatch):
    from onecopy import Runtime

    handed = []
    monkeypatch.setattr(quarantine, "hold", lambda objects, **_: handed.append(list(objects)))
    with Runtime(cache_dir=tmp_path / "cache").load_program(small_program_path) as specialized:
        specialized.load_method("forward")  # specialization's own models (timing executors) are closed there
    handed.clear()
    program = Runtime(cache_dir=tmp_path / "cache").load_program(small_program_path)
    forward = program.load_method("forward")
    forward.execute([np.ones(forward.method_meta.inputs[0].shape, np.float32)])
    assert handed == []
    program.close()
    (objects,) = handed  # one model, shared by the program's delegates
    views = [o for o in objects if isinstance(o, memoryview)]
    # the module's bytes and every weight the parameter index reads in place
    assert len(views) >= 1 + len(program.definition.delegates[0].manifest["parameters"])


def test_drain_waits_for_what_is_held_and_frees_it():
    obj = Buffer()
    alive = weakref.ref(obj)
    quarantine.hold([obj])
    del obj
    started = time.monotonic()
    quarantine.drain()
    gc.collect()
    assert alive() is None
    assert time.monotonic() - started >= quarantine.HOLD_S * 0.9


EXIT_WITHOUT_CLOSING = """
import sys
import numpy as np
import onecopy
program = onecopy.Runtime(cache_dir=sys.argv[2]).load_program(sys.argv[1])
forward = program.load_method("forward")
forward.execute([np.ones(forward.method_meta.inputs[0].shape, np.float32)])
closed = onecopy.Runtime(cache_dir=sys.argv[2]).load_program(sys.argv[1])
closed.close()  # held by the quarantine, and its releasing thread runs, when the interpreter exits
print("ran", flush=True)
"""


def test_a_process_exits_promptly_with_programs_left_open_or_just_closed(small_program_path, tmp_path):
    # A program left open is closed by the garbage collector during interpreter finalization, when no thread can
    # start: the quarantine must not try to start one then (Thread.start waited for ever).
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSING, str(small_program_path), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ran"
