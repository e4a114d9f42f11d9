"""The frame step on its own, in both its forms: the definition (frame_step.FrameStep, Python) and its accelerator
(_frame_run.FrameRun, C), each test run on both. A fake engine context and method, real surface locks. The paths of
a real engine call on bound surfaces are in test_binding.py; these are the ones an engine rarely takes."""

import threading

import pytest

from onecopy.delegate._frame_run import FrameRun
from onecopy.delegate.frame_step import FrameStep
from onecopy.runtime.copy_stats import CopyStats


@pytest.fixture(autouse=True, params=[FrameStep, FrameRun], ids=["definition", "accelerator"])
def step(request, monkeypatch):
    """The form of the frame step the test builds."""
    monkeypatch.setattr(Engine, "make", request.param, raising=False)
    return request.param


class Context:
    """A VM context: records its invokes; raises `error` when set."""

    def __init__(self, error=None, check=None):
        self.invoked = []
        self.error = error
        self.check = check  # called inside invoke: what holds then

    def invoke(self, function, arguments, results):
        if self.check is not None:
            self.check()
        self.invoked.append((function, arguments, results))
        if self.error is not None:
            raise self.error


class Engine:
    """What a FrameRun is built from, faked, with real lock cores for `surfaces` (read the first, write the rest)."""

    def __init__(self, surfaces, context=None):
        self.closed = threading.Event()
        self.local = threading.local()
        self.stats = CopyStats(in_place_in=10, in_place_out=20)
        self.records = []
        self.pool = [context or Context()]
        self.made = []
        self.waited = []
        self.woken = []
        self.outputs = ("y",)
        self.surfaces = surfaces
        self.cores = tuple(s._lock.core for s in surfaces)
        self.modes = tuple(i == 0 for i in range(len(surfaces)))
        self.debug = False

    def new_context(self):
        context = Context()
        self.made.append(context)
        return context

    def on_closed(self):
        raise ValueError("closed program")

    def wait_locks(self, taken):
        raise AssertionError(f"the run waited for a lock after taking {taken}")

    def run(self, **changes):
        fields = dict(
            is_closed=self.closed.is_set, on_closed=self.on_closed, debug_enabled=lambda level: self.debug,
            debug_level=10, record=lambda stats, debug: self.records.append((stats, debug)), local=self.local,
            stats=self.stats, outputs=self.outputs, pool=self.pool, new_context=self.new_context,
            vm_function="fn", arguments="args", result_list=lambda n: ["results", n], result_count=1,
            engine_error=lambda e: KeyError(f"engine failed: {e}"), cores=self.cores, modes=self.modes,
            wait_locks=self.wait_locks, wake=self.woken.append,
        )
        fields.update(changes)
        return self.make(**fields)


@pytest.fixture
def two(surfaces):
    return surfaces(4, 32, "float16"), surfaces(4, 32, "float16")


def held(surface):
    return surface._lock.held()


def test_a_run_invokes_with_the_surfaces_locked_and_records_its_stats(two):
    src, dst = two
    during = []
    engine = Engine(two, Context(check=lambda: during.append((held(src), held(dst)))))
    context = engine.pool[0]
    generation = dst.generation
    result = engine.run()()
    assert result == ["y"] and type(result) is list
    assert context.invoked == [("fn", "args", ["results", 1])]
    assert during == [("1 read lock(s)", "a write lock")]
    assert held(src) is None and held(dst) is None and dst.generation == generation + 1
    assert engine.pool == [context] and engine.local.stats is engine.stats and engine.records == []


def test_a_run_logs_its_stats_only_when_debug_is_on(two):
    engine = Engine(two)
    engine.debug = True
    engine.run()()
    assert engine.records == [(engine.stats, True)]


@pytest.mark.parametrize("kind", [RuntimeError, ValueError])  # a failed run; a call IREE refused
def test_an_engine_failure_is_raised_from_as_the_engines_error_with_context_and_locks_given_back(two, kind):
    src, dst = two
    engine = Engine(two, Context(error=kind("bad dispatch")))
    context = engine.pool[0]
    with pytest.raises(KeyError, match="engine failed: bad dispatch") as caught:
        engine.run()()
    assert isinstance(caught.value.__cause__, kind)
    assert engine.pool == [context] and held(src) is None and held(dst) is None
    assert not hasattr(engine.local, "stats")


def test_other_engine_exceptions_pass_unchanged(two):
    engine = Engine(two, Context(error=MemoryError("out")))
    with pytest.raises(MemoryError, match="out"):
        engine.run()()
    assert held(two[0]) is None and held(two[1]) is None


def test_a_closed_program_raises_its_error_before_anything_is_taken(two):
    engine = Engine(two)
    engine.closed.set()
    with pytest.raises(ValueError, match="closed program"):
        engine.run()()
    assert engine.pool[0].invoked == [] and held(two[0]) is None


def test_an_empty_pool_makes_a_context_and_keeps_it(two):
    engine = Engine(two)
    engine.pool.clear()
    engine.run()()
    assert engine.made and engine.pool == engine.made and engine.made[0].invoked


def test_a_lock_that_would_wait_goes_to_python_and_the_run_goes_on(two):
    src, dst = two
    dst._lock.acquire(readonly=True)  # a reader of this process: the write lock cannot be taken at once
    engine = Engine(two)

    def wait_locks(taken):  # what lock.py's slow path does once the reader lets go
        engine.waited.append(taken)
        dst._lock.release(readonly=True)
        dst._lock.acquire(False, timeout=0, track=False)
        return 2

    engine.run(wait_locks=wait_locks)()
    assert engine.waited == [1] and engine.pool[0].invoked
    assert held(src) is None and held(dst) is None


def test_a_failed_wait_gives_back_the_locks_taken_before_it(two):
    src, dst = two
    engine = Engine(two)

    def refuse(taken):
        raise ValueError(f"surface closed after {taken}")

    dst._lock.acquire(readonly=True)
    try:
        with pytest.raises(ValueError, match="surface closed after 1"):
            engine.run(wait_locks=refuse)()
        assert held(src) is None and engine.pool[0].invoked == []
    finally:
        dst._lock.release(readonly=True)


def test_waiting_threads_are_woken_after_the_run(two):
    src, dst = two
    engine = Engine(two)
    dst._lock.core.waiting = 1  # as lock.py's slow path counts a waiter
    try:
        engine.run()()
    finally:
        dst._lock.core.waiting = 0
    assert engine.woken == [2]


def test_a_run_takes_no_arguments_and_needs_every_field(two, step):
    engine = Engine(two)
    with pytest.raises(TypeError, match="takes no arguments|takes 1 positional argument"):
        engine.run()(1)
    with pytest.raises(TypeError):
        step(stats=engine.stats)
    with pytest.raises(TypeError):
        engine.run(pool=("not", "a list"))
    with pytest.raises(ValueError, match="one mode per lock core"):
        engine.run(modes=(True,))
