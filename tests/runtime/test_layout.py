"""The native checks that decide whether `execute` reruns a kept plan or skips a first call's checks
(runtime/_layout.c)."""

import numpy as np
import pytest

from onecopy.runtime._layout import repeat_kept, same_shapes


class Plan:
    """A kept plan as `repeat_kept` reads it: snapshots of the arrays it was made on (inputs, then outputs)."""

    def __init__(self, *arrays):
        self.snapshots = tuple(a.view() for a in arrays)
        self.runs = 0

    def run(self):
        self.runs += 1


class Kept:
    """A method's per-thread state: `repeats`, (snapshots, run) of each plan, newest first."""

    def __init__(self, *plans):
        self.repeats = tuple((plan.snapshots, plan.run) for plan in plans)


def test_a_call_laid_out_as_a_kept_plan_runs_it_and_returns_its_own_outputs():
    memory = np.zeros((4, 8), np.float16)
    plan = Plan(memory, memory[1:])
    out = memory[1:][:]  # a new view of the planned output
    result = repeat_kept(Kept(plan), [memory.reshape(4, 8)], (out,))
    assert plan.runs == 1 and type(result) is list and len(result) == 1 and result[0] is out


def test_empty_input_or_output_lists_match_a_plan_made_on_none():
    out = np.zeros(4, np.float32)
    plan = Plan(out)  # a method with no inputs
    assert repeat_kept(Kept(plan), [], [out]) == [out] and plan.runs == 1


def test_the_first_matching_plan_runs_and_no_match_says_none():
    a, b = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.float32)
    first, second, third = Plan(a, b), Plan(b, a), Plan(b, a)
    kept = Kept(first, second, third)
    assert repeat_kept(kept, [b], [a]) == [a]
    assert (first.runs, second.runs, third.runs) == (0, 1, 0)
    assert repeat_kept(kept, [a], [a]) is None
    assert repeat_kept(Kept(), [a], [b]) is None  # nothing kept on this thread yet
    with pytest.raises(AttributeError):
        repeat_kept(object(), [a], [b])
    broken = Kept()
    broken.repeats = (first,)
    with pytest.raises(TypeError, match="pairs"):
        repeat_kept(broken, [a], [b])


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a[:, ::2],                      # other strides
        lambda a: a.reshape(8, 4),                # other shape
        lambda a: a.reshape(1, 4, 8),             # other rank
        lambda a: a[1:],                          # other address
        lambda a: a.view(np.int16),               # other dtype, same size
        lambda a: np.zeros_like(a),               # other memory
        lambda a: a.view(np.matrix) if a.ndim == 2 else a,  # a subclass: not exactly an ndarray
        lambda a: memoryview(a),                  # not an array
    ],
)
def test_any_difference_that_a_first_call_would_check_does_not_match(change):
    memory, out = np.zeros((4, 8), np.float16), np.zeros((4, 8), np.float16)
    plan = Plan(memory, out)
    assert repeat_kept(Kept(plan), [change(memory)], [out]) is None
    assert repeat_kept(Kept(plan), [memory], [change(out)]) is None
    assert plan.runs == 0


def test_outputs_must_still_be_writable_and_counts_must_agree():
    memory, out = np.zeros((4, 8), np.float16), np.zeros((4, 8), np.float16)
    plan = Plan(memory, out)
    frozen_in, frozen_out = memory.view(), out.view()
    frozen_in.flags.writeable = frozen_out.flags.writeable = False
    assert repeat_kept(Kept(plan), [frozen_in], [out]) == [out]  # an input may be read-only
    assert repeat_kept(Kept(plan), [memory], [frozen_out]) is None  # an output may not
    assert repeat_kept(Kept(plan), [memory, memory], [out]) is None
    assert repeat_kept(Kept(plan), [memory], []) is None
    assert repeat_kept(Kept(plan), iter([memory]), [out]) is None  # lists and tuples only
    with pytest.raises(TypeError):
        repeat_kept(Kept(plan), [memory])


def test_a_failing_run_raises_through():
    memory, out = np.zeros(4), np.zeros(4)

    class Failing(Plan):
        def run(self):
            raise ValueError("engine failed")

    with pytest.raises(ValueError, match="engine failed"):
        repeat_kept(Kept(Failing(memory, out)), [memory], [out])


def template(shape, dtype):
    return np.broadcast_to(np.zeros((), dtype), shape)


def test_same_shapes_ignores_addresses_and_strides():
    templates = (template((4, 8), np.float32), template((3,), np.int64))
    a, b = np.ones((4, 8), np.float32), np.arange(3)
    assert same_shapes([a, b], templates)
    assert same_shapes((np.ones((4, 16), np.float32)[:, ::2], b.copy()), templates)
    assert same_shapes([], ())


@pytest.mark.parametrize(
    "given",
    [
        [np.ones((8, 4), np.float32), np.arange(3)],          # other shape
        [np.ones((1, 4, 8), np.float32), np.arange(3)],       # other rank
        [np.ones((4, 8), np.float64), np.arange(3)],          # other dtype
        [np.ones((4, 8), ">f4"), np.arange(3)],               # other byte order
        [np.ones((4, 8), np.float32)],                        # fewer
        [np.ones((4, 8), np.float32), np.arange(3), np.arange(3)],  # more
        [np.ones((4, 8), np.float32).view(np.recarray), np.arange(3)],  # a subclass
        [memoryview(np.ones((4, 8), np.float32)), np.arange(3)],    # not an array
    ],
)
def test_same_shapes_refuses_anything_a_first_call_would_check(given):
    assert not same_shapes(given, (template((4, 8), np.float32), template((3,), np.int64)))


def test_same_shapes_takes_lists_and_tuples_only():
    x = np.ones(3)
    assert not same_shapes(iter([x]), (template((3,), np.float64),))
    with pytest.raises(TypeError):
        same_shapes([x], [template((3,), np.float64)])
