"""The native checks that decide whether `execute` reruns a kept plan or skips a first call's checks
(runtime/_layout.c)."""

import numpy as np
import pytest

from onecopy.runtime._layout import same_layout, same_shapes


def test_the_same_memory_with_the_same_layout_matches_through_new_views():
    memory = np.zeros((4, 8), np.float16)
    planned = (memory.view(), memory[1:].view())
    assert same_layout((memory, memory[1:]), planned, 1)
    assert same_layout((memory.reshape(4, 8), memory[1:][:]), planned, 1)


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
    memory = np.zeros((4, 8), np.float16)
    assert not same_layout((change(memory),), (memory.view(),), 1)


def test_outputs_must_still_be_writable_and_counts_must_agree():
    memory = np.zeros((4, 8), np.float16)
    frozen = memory.view()
    frozen.flags.writeable = False
    assert same_layout((frozen,), (memory.view(),), 1)  # an input may be read-only
    assert not same_layout((frozen,), (memory.view(),), 0)  # an output may not
    assert not same_layout((memory, memory), (memory.view(),), 1)
    with pytest.raises(TypeError):
        same_layout([memory], (memory.view(),), 1)


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
