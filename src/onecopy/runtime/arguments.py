"""The checks a method's arguments pass before anything runs: inputs, output storage, index bounds.

Each error says which argument of which method is wrong and how to fix it; nothing here touches the engine.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

import numpy as np

from onecopy.errors import ExecutionError
from onecopy.program import MethodDef
from onecopy.runtime.method_meta import MethodMeta, TensorMeta, dim_value

__all__ = ["STATE_ADVICE", "as_array", "check_bounds", "check_inputs", "output_storage"]


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays as they are; DLPack producers (torch, jax, cupy on host) as zero-copy views; else asarray."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise ExecutionError(f"{what} cannot be viewed as a host array through DLPack: {e}") from e
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise ExecutionError(f"{what} is not an array: {type(value).__name__}.") from e


def _check_list(given: Any, what: str, example: str) -> None:
    """Inputs and outputs come as a list (or tuple) with one entry per tensor; a bare array would be taken apart
    along its first axis."""
    if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
        raise ExecutionError(f"{what} as a list with one entry per tensor ({example}), got {type(given).__name__}.")


def _check_tensor(
    array: np.ndarray, meta: TensorMeta, symbols: dict[str, int], what: str,
    ranges: dict[str, list[int | None]] | None = None, derived: list[tuple[str, int, int, str]] | None = None,
    storage: bool = False,
) -> None:
    """`array` against `meta`: dtype, rank, static sizes, and each dynamic dimension that is a symbol of its own
    ("T": bound in `symbols` by the first input that has it, within its exported range). A dimension that is an
    expression of symbols ("2*T", derived from another Dim) is left to `_check_derived`, appended to `derived`
    (what, axis, size, expression), once every input has bound the symbols it names."""
    if array.dtype != meta.dtype:
        # Output storage is not converted: a converted copy (astype) would receive the results, not the caller's.
        fix = (f"Pass storage of that dtype, e.g. np.empty(shape, np.{meta.dtype})." if storage
               else f"Convert it, e.g. x.astype(np.{meta.dtype}).")
        raise ExecutionError(f"{what} has dtype {array.dtype}; expected {meta.dtype}. {fix}")
    if array.ndim != len(meta.shape):
        raise ExecutionError(f"{what} has shape {list(array.shape)}; expected {list(meta.shape)}.")
    for axis, (given, want) in enumerate(zip(array.shape, meta.shape)):
        if isinstance(want, str):
            if not want.isidentifier():
                if derived is not None:
                    derived.append((what, axis, given, want))
                continue
            low, high = (ranges or {}).get(want, (None, None))
            if (low is not None and given < low) or (high is not None and given > high):
                raise ExecutionError(
                    f"{what} has size {given} at dimension {axis} ('{want}'), outside its exported range "
                    f"[{low}, {high if high is not None else 'inf'}]; re-export with a wider torch.export.Dim."
                )
            bound = symbols.setdefault(want, given)
            if bound != given:
                raise ExecutionError(
                    f"{what} has size {given} at dimension {axis} ('{want}'), but another input set '{want}' = {bound}."
                )
        elif given != want:
            raise ExecutionError(f"{what} has shape {list(array.shape)}; expected {list(meta.shape)}.")


def _solve(expression: str, symbol: str, size: int, symbols: dict[str, int], low: int | None,
           high: int | None) -> int | None:
    """The value of `symbol` (the one symbol of `expression` no input bound) within [low, high] that makes
    `expression` equal `size`, or None. Found directly where the expression is linear in it (a*T + b, what
    derived Dims are), else searched over a bounded range of at most 2**16 values."""
    def at(value: int) -> int | None:
        return dim_value(expression, {**symbols, symbol: value})

    start = low if low is not None else 0
    v0, v1 = at(start), at(start + 1)
    if v0 is not None and v1 is not None and v1 != v0 and (size - v0) % (v1 - v0) == 0:
        guess = start + (size - v0) // (v1 - v0)
        if guess >= start and (high is None or guess <= high) and at(guess) == size:
            return guess
    if high is not None and high - start < 2**16:
        return next((v for v in range(start, high + 1) if at(v) == size), None)
    return None


def _check_derived(derived: list[tuple[str, int, int, str]], symbols: dict[str, int],
                   ranges: dict[str, list[int | None]] | None) -> None:
    """Dimensions that are expressions of other inputs' symbols ("2*T"): each must equal its expression's value.
    Unchecked, a smaller input would be read past its end by the engine, a larger one read in part. An
    expression whose one symbol no input has on its own binds it, as torch.export's own guards do."""
    for what, axis, given, expression in derived:
        unknown = sorted(_symbols_of(expression) - symbols.keys())
        if len(unknown) == 1:
            low, high = (ranges or {}).get(unknown[0], (None, None))
            solved = _solve(expression, unknown[0], given, symbols, low, high)
            if solved is None:
                span = f"[{low if low is not None else 0}, {high if high is not None else 'inf'}]"
                raise ExecutionError(
                    f"{what} has size {given} at dimension {axis} ('{expression}'): no value of '{unknown[0]}' in "
                    f"its exported range {span} gives that size. Pass an input of a size '{expression}' can take."
                )
            symbols[unknown[0]] = solved
        want = dim_value(expression, symbols)
        if want is None:
            raise ExecutionError(
                f"{what} has dimension {axis} of exported size '{expression}', which onecopy cannot work out from "
                "this call's inputs; re-export with a plain torch.export.Dim for it."
            )
        if want != given:
            names = ", ".join(f"'{n}' = {symbols[n]}" for n in sorted(_symbols_of(expression)) if n in symbols)
            raise ExecutionError(
                f"{what} has size {given} at dimension {axis}; it must be '{expression}' = {want} ({names}, from "
                "this call's inputs)."
            )


def _symbols_of(expression: str) -> set[str]:
    """The symbols an expression of the header names (not the functions it calls: "Max(1, T)" names T)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return set()
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}


def _check_output(array: np.ndarray, meta: TensorMeta, symbols: dict[str, int], what: str) -> None:
    """An output's storage against its dtype and rank, and against the shape this call's inputs give it: a
    dynamic output's storage sized for other inputs would be written in part (the rest left as it was) or
    refused by the engine halfway through the call."""
    _check_tensor(array, meta, {}, what, storage=True)
    want = [dim_value(d, symbols) for d in meta.shape]
    if any(w is not None and w != given for w, given in zip(want, array.shape)):
        sizes = ", ".join(f"'{d}' = {w}" for d, w in zip(meta.shape, want) if isinstance(d, str) and w is not None)
        raise ExecutionError(
            f"{what} has shape {list(array.shape)}; this call's inputs make it "
            f"{[w if w is not None else d for w, d in zip(want, meta.shape)]} ({sizes}). Pass storage of that shape."
        )


def check_inputs(name: str, definition: MethodDef, meta: MethodMeta, inputs: Sequence[Any],
                 symbols: dict[str, int] | None = None) -> list[np.ndarray]:
    """The inputs of method `name` as arrays, each checked against its dtype and shape (symbolic dimensions agree
    across inputs and stay within their exported ranges). `symbols` receives the dynamic dimensions' sizes."""
    _check_list(inputs, f"Method '{name}' takes its inputs", "execute([x, ...]), or a dict by input name")
    if len(inputs) != len(meta.inputs):
        raise ExecutionError(f"Method '{name}' takes {len(meta.inputs)} inputs, got {len(inputs)}.")
    symbols = {} if symbols is None else symbols
    arrays = []
    derived: list[tuple[str, int, int, str]] = []
    for i, (value, tmeta) in enumerate(zip(inputs, meta.inputs)):
        what = f"Input {i} of method '{name}'"
        array = as_array(value, what)
        _check_tensor(array, tmeta, symbols, what, definition.symbols, derived)
        arrays.append(array)
    if derived:
        _check_derived(derived, symbols, definition.symbols)
    return arrays


def _unplanned(name: str, index: int) -> str:
    return (f"Output {index} of method '{name}' is not memory planned (exported with "
            "memory_planned_outputs=False); pass its storage with outputs=[...].")


def output_storage(name: str, definition: MethodDef, meta: MethodMeta, outputs: Sequence[Any] | None,
                   symbols: dict[str, int] | None = None) -> dict[int, np.ndarray]:
    """The caller's output storage of method `name` by value id, checked: writable arrays of each output's dtype
    and shape, a dynamic output's shape as the inputs' `symbols` (check_inputs') make it. Outputs that are not
    memory planned must be given."""
    if outputs is None:
        unplanned = next((i for i, o in enumerate(meta.outputs) if not o.memory_planned), None)
        if unplanned is not None:
            raise ExecutionError(_unplanned(name, unplanned))
        return {}
    _check_list(outputs, f"Method '{name}' takes output storage", "outputs=[y, ...], None for any the runtime "
                "allocates")
    if len(outputs) != len(meta.outputs):
        raise ExecutionError(
            f"Method '{name}' has {len(meta.outputs)} outputs; outputs= gave {len(outputs)} (use None for "
            "outputs the runtime should allocate)."
        )
    storage: dict[int, np.ndarray] = {}
    for i, (out, vid, tmeta) in enumerate(zip(outputs, definition.outputs, meta.outputs)):
        if out is None:
            if not tmeta.memory_planned:
                raise ExecutionError(_unplanned(name, i))
            continue
        what = f"Output {i} of method '{name}'"
        if not isinstance(out, np.ndarray) and not hasattr(out, "__dlpack__"):
            # np.asarray would make a new array: the results would be written there and lost.
            raise ExecutionError(f"{what} must be an array to write into (numpy, or a DLPack tensor on the "
                                 f"host), got {type(out).__name__}.")
        array = as_array(out, what)
        if not array.flags.writeable:
            raise ExecutionError(f"{what} is read-only; pass writable storage.")
        _check_output(array, tmeta, symbols or {}, what)
        if vid in storage:  # one value returned twice: the second copy is made at the end
            continue
        storage[vid] = array
    return storage


# What a stateful method's caller does about an index outside its bounds: a cache position past the cache.
STATE_ADVICE = "Start a new state (state.reset()), or export with a larger max_cache_len."


def check_bounds(name: str, bounds: dict[int, tuple[int, int]], inputs: Sequence[Any], advice: str = "") -> None:
    """Inputs that index into the engine's memory (a token id into an embedding, a cache position) within the
    values `bounds` (input index -> [low, high]) the method was exported for: the engine does not check indices.
    `advice`: what to do about a value outside them (a stateful method's: start a new state). An input missing or
    not an integer array is left to the method's other checks."""
    for index, (low, high) in bounds.items():
        if index >= len(inputs):
            continue
        array = inputs[index]
        if type(array) is not np.ndarray:
            array = as_array(array, f"Input {index} of method '{name}'")
        if array.dtype.kind not in "iu":
            continue
        if array.size == 1:  # a decode step's position: item() is a tenth of min() + max()
            lowest = highest = int(array.item())
        elif array.size == 0:
            continue
        else:
            lowest, highest = int(array.min()), int(array.max())
        if lowest < low or highest > high:
            bad = highest if highest > high else lowest
            raise ExecutionError(
                f"Input {index} of method '{name}' holds {bad}, outside [{low}, {high}], the values it was exported "
                f"for: it indexes a table of {high + 1} entries (an embedding's rows, a cache's positions), and the "
                f"engine does not check indices. {advice or 'Give indices within the table.'}"
            )
