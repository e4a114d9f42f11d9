"""Whether two ways of running a method agree: inputs nobody gave that are safe to run it on, and how one run's
outputs differ from another's.

Two checks use it: `prefer="latency"` compares each alternative delegate with IREE's (onecopy.runtime.selection),
and serving compares a batched call with its requests run alone (onecopy.serve.batching).

Inputs. Floats (and complex) are standard normals, flags (bool) fair coin flips (a flag indexes nothing: a mask's
selection has a size the data decides, refused at export). An integer input may be an index into the engine's
memory (a token id, a position, a class embedding's row), and the engine checks no index: an out-of-range one
reads, or through a scatter writes, past a buffer. So an integer input is drawn only from the values the method's
recorded bounds (`MethodDef.input_bounds`, checked before every call) allow, negatives included where they do, and
one without bounds is all zeros, the only value in range for any index (a dimension of 1, e.g. a beam index at
batch 1, rules out even 1). The limitation: an integer computation is compared on varied values only where the
program records bounds for its inputs (onecopy.llm's token ids and positions do); elsewhere on zeros, so a wrong
integer result there (e.g. a floor division that truncates toward zero, which only negative values show) is not
seen. `mirrored` gives a second draw with the signs turned where the bounds allow.

Outputs agree when they have the same shape and dtype and the same values: exactly for integers and flags (an
index or a count off by one is wrong, whatever the outputs' scale; a flag or index computed from floats, like
x > 0 or argmax, may flip on a near tie: that keeps the reference, never a wrong result), NaN and infinities in the
same places, and other floats within a tolerance of the outputs' scale (at least 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onecopy.runtime.method_meta import TensorMeta

__all__ = ["TOLERANCES", "difference", "integer_range", "mirrored", "random_array", "random_inputs"]

# A float output's tolerance per compute precision, of the reference outputs' scale (bf16: both runs compute on
# bf16 inputs and round differently).
TOLERANCES = {"fp32": 1e-4, "bf16": 3e-2}


def integer_range(dtype: np.dtype, bound: Sequence[int] | None) -> tuple[int, int] | None:
    """[low, high] of the values to draw for an integer input: its recorded bounds, within its dtype (and int64's,
    which draws them); None without bounds, or bounds that hold no value of the dtype."""
    if bound is None or len(bound) != 2:
        return None
    info, wide = np.iinfo(dtype), np.iinfo(np.int64)
    low, high = max(int(bound[0]), info.min, wide.min), min(int(bound[1]), info.max, wide.max)
    return (low, high) if low <= high else None


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype: np.dtype,
                 bound: Sequence[int] | None = None) -> np.ndarray:
    """One input of `shape` and `dtype` as the module docstring says; `bound`: an integer input's [min, max]."""
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    found = integer_range(dtype, bound) if dtype.kind in "iu" else None
    if found is not None:
        return rng.integers(found[0], found[1], shape, dtype=np.int64, endpoint=True).astype(dtype)
    return np.zeros(shape, dtype)  # an integer input without bounds (see the module docstring)


def random_inputs(specs: Sequence[TensorMeta], seed: int = 0,
                  bounds: Mapping[int, Sequence[int]] | None = None) -> list[np.ndarray]:
    """Inputs of a method's (static) shapes; `bounds`: input index -> [min, max] of an integer input."""
    rng = np.random.default_rng(seed)
    bounds = bounds or {}
    return [random_array(rng, spec.shape, spec.dtype, bounds.get(i)) for i, spec in enumerate(specs)]  # type: ignore[arg-type]


def mirrored(arrays: Sequence[np.ndarray], specs: Sequence[TensorMeta],
             bounds: Mapping[int, Sequence[int]] | None = None) -> list[np.ndarray]:
    """A second draw that shows sign-dependent results (floor division, remainder, rounding): floats negated, flags
    flipped, and each integer negated where its negation is within the input's recorded bounds (kept where not;
    zeros stay zeros), so every magnitude a bounded integer was drawn at runs with both signs the bounds allow."""
    bounds = bounds or {}
    out = []
    for index, (array, spec) in enumerate(zip(arrays, specs)):
        kind = spec.dtype.kind
        if kind in "fc":
            out.append(-array)
        elif kind == "b":
            out.append(~array)
        elif kind in "iu" and (found := integer_range(spec.dtype, bounds.get(index))) is not None:
            low, high = found
            wide = array.astype(np.int64)
            negated = -wide  # in int64: the drawn values are within it, and so are their negations but -2**63's
            inside = (wide != np.iinfo(np.int64).min) & (negated >= low) & (negated <= high)
            out.append(np.where(inside, negated, wide).astype(spec.dtype))
        else:
            out.append(array)
    return out


def difference(got: Any, want: np.ndarray, tolerance: float, reference: str) -> str | None:
    """How `got` differs from `reference`'s `want` (as the module docstring says they must agree), one phrase
    naming `reference` ("differs from iree's in 1 of 2 elements ..."), or None where it agrees."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"has shape {list(got.shape)}, {reference}'s {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"is {got.dtype}, {reference}'s {want.dtype}"
    if want.dtype.kind not in "fc":
        wrong = int(np.count_nonzero(got != want))
        return (f"differs from {reference}'s in {wrong} of {want.size} elements (integers must be equal)"
                if wrong else None)
    if not want.size:
        return None
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    g, w = got.astype(wide), want.astype(wide)
    nan = np.isnan(w)
    if not np.array_equal(np.isnan(g), nan):
        return f"has NaN elsewhere than {reference}'s"
    g, w = np.where(nan, 0, g), np.where(nan, 0, w)
    infinite = np.isinf(w)
    if not np.array_equal(g[infinite], w[infinite]) or np.isinf(g[~infinite]).any():
        return f"has infinities elsewhere than {reference}'s"
    g, w = np.where(infinite, 0, g), np.where(infinite, 0, w)
    scale = float(np.max(np.abs(w)))
    err = float(np.max(np.abs(g - w)))
    if not err <= tolerance * max(scale, 1.0):
        return f"differs from {reference}'s by {err:.2e} (scale {scale:.2e})"
    return None
