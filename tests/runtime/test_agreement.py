"""Inputs nobody gave that are safe to run a method on, and when two runs' outputs agree."""

import numpy as np
import pytest

from onecopy.runtime import agreement
from onecopy.runtime.method_meta import TensorMeta


def test_integer_inputs_vary_within_their_bounds_and_are_zeros_without():
    specs = [TensorMeta((256,), np.dtype(d), True) for d in ("int64", "int32", "uint8", "bool", "int8", "float32")]
    bounds = {0: [-8, 7], 2: [3, 200], 4: [-1000, 1000]}  # input 4: wider than int8, drawn within int8
    arrays = agreement.random_inputs(specs, bounds=bounds)
    assert [a.dtype for a in arrays] == [s.dtype for s in specs]
    signed, unbounded, unsigned, flags, narrow, floats = arrays
    assert signed.min() >= -8 and signed.max() <= 7 and signed.min() < 0 <= signed.max()
    assert len(np.unique(signed)) > 8
    assert (unbounded == 0).all()  # it may index memory: nothing but 0 is in range for every index
    assert unsigned.min() >= 3 and unsigned.max() <= 200 and len(np.unique(unsigned)) > 50
    assert flags.any() and not flags.all()
    assert narrow.min() < -64 and narrow.max() > 64
    assert floats.std() > 0.5

    mirror = agreement.mirrored(arrays, specs, bounds)
    assert [a.dtype for a in mirror] == [s.dtype for s in specs]
    # Negated where the bounds allow the negation (-8 -> 8 does not fit [-8, 7]: kept), so each magnitude runs
    # with both signs; the unbounded and the non-negative inputs are left as they were.
    np.testing.assert_array_equal(mirror[0], np.where(signed == -8, -8, -signed))
    np.testing.assert_array_equal(mirror[1], unbounded)
    np.testing.assert_array_equal(mirror[2], unsigned)
    np.testing.assert_array_equal(mirror[3], ~flags)
    np.testing.assert_array_equal(mirror[4], np.where(narrow == -128, -128, -narrow.astype(np.int64)))
    np.testing.assert_array_equal(mirror[5], -floats)
    for array, low, high in ((mirror[0], -8, 7), (mirror[2], 3, 200)):
        assert array.min() >= low and array.max() <= high


@pytest.mark.parametrize(("got", "want", "said"), [
    (np.array([1, 2]), np.array([1, 2]), None),
    (np.array([1, 2]), np.array([1, 3]), "differs from ref's in 1 of 2 elements (integers must be equal)"),
    (np.array([1, 2], np.int32), np.array([1, 2]), "is int32, ref's int64"),
    (np.zeros((2, 1)), np.zeros(2), "has shape [2, 1], ref's [2]"),
    (np.array([1.0, 2.00001]), np.array([1.0, 2.0]), None),
    (np.array([1.0, 2.1]), np.array([1.0, 2.0]), "differs from ref's by 1.00e-01 (scale 2.00e+00)"),
    (np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), None),
    (np.array([1.0, np.nan]), np.array([np.nan, 1.0]), "has NaN elsewhere than ref's"),
    (np.array([np.inf, 1.0]), np.array([np.inf, 1.0]), None),
    (np.array([-np.inf, 1.0]), np.array([np.inf, 1.0]), "has infinities elsewhere than ref's"),
    (np.array([1.0, np.inf]), np.array([1.0, 2.0]), "has infinities elsewhere than ref's"),
])
def test_outputs_agree_in_shape_dtype_and_values(got, want, said):
    assert agreement.difference(got, want, 1e-4, "ref") == said
