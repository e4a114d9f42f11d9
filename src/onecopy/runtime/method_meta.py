"""Method metadata: what a method takes, returns and does, without running it."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from onecopy.errors import InvalidArgument
from onecopy.program import DelegateCall, HostOp, MethodDef, ProgramDef, TensorSpec

__all__ = ["TensorMeta", "DelegateMeta", "Choice", "MethodMeta", "dim_value"]

# The functions torch's symbolic shapes print in a dimension's expression (sympy's str of it: "2*b", "b - 1",
# "(b//2)", "Max(1, b)", "Mod(b, 4)", "CeilToInt(b/2)"), each on exact integers or fractions.
_DIM_FUNCTIONS: dict[str, Callable[..., Fraction | int]] = {
    "Max": max, "Min": min, "Abs": abs,
    "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
    "FloorDiv": lambda a, b: a // b, "CleanDiv": lambda a, b: a // b,
    "floor": math.floor, "FloorToInt": math.floor, "ceiling": math.ceil, "CeilToInt": math.ceil,
    "TruncToInt": math.trunc,
}
_DIM_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction | int]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: Fraction(a) / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
}


def dim_value(dim: int | str, symbols: Mapping[str, int]) -> int | None:
    """The size of dimension `dim` (an int, a symbol, or an expression of symbols as the program's header writes
    it) once `symbols` are known; None when it names a symbol not in `symbols` or is not an expression read here.
    Parsed, never evaluated as Python: the header comes from a file."""
    if isinstance(dim, int):
        return dim
    if dim in symbols:
        return symbols[dim]

    def value(node: ast.AST) -> Fraction | int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in symbols:
            return symbols[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _DIM_OPERATORS:
            right = value(node.right)
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise ValueError("division by zero")
            return _DIM_OPERATORS[type(node.op)](value(node.left), right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = value(node.right)
            if exponent not in range(0, 9):  # a dimension squared or cubed; nothing a header needs beyond
                raise ValueError("exponent out of range")
            return value(node.left) ** int(exponent)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DIM_FUNCTIONS
                and not node.keywords):
            return _DIM_FUNCTIONS[node.func.id](*(value(a) for a in node.args))
        raise ValueError(f"not a dimension expression: {ast.dump(node)}")

    try:
        result = value(ast.parse(dim, mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None
    if isinstance(result, Fraction):
        return int(result) if result.denominator == 1 else None
    return int(result)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int | str, ...]  # a str is a dynamic dimension's symbol
    dtype: np.dtype
    memory_planned: bool
    name: str = ""  # an input's name in the exported signature ("": an output, or a file without names)

    @classmethod
    def from_spec(cls, spec: TensorSpec, name: str = "") -> "TensorMeta":
        return cls(tuple(spec.shape), np.dtype(spec.dtype), spec.memory_planned, name)

    @property
    def is_dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def shape_for(self, symbols: Mapping[str, int]) -> tuple[int, ...] | None:
        """The shape once the dynamic dimensions' symbols are known (from a call's inputs); None when a dimension
        cannot be worked out from them."""
        shape = tuple(dim_value(d, symbols) for d in self.shape)
        return None if None in shape else shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int | None:
        if self.is_dynamic:
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class DelegateSummary(NamedTuple):
    """What a delegate runs, as its backend reads its manifest (each backend's manifest has a schema of its own):
    what `MethodMeta` shows, and the export hash a recorded choice of delegate is keyed by."""

    function: str = ""
    packaging: str = ""
    export_hash: str = ""


@dataclass(frozen=True)
class DelegateMeta:
    index: int
    backend: str
    function: str
    packaging: str


@dataclass(frozen=True)
class Choice:
    """What `load_program(prefer="latency")` chose for a method (onecopy.runtime.selection): the backend that runs
    it and what each candidate measured on this machine."""

    backend: str
    delegate: int  # index into the program's delegates of the one that runs the method whole; -1: its instructions
    latency_ms: dict[str, float]  # backend -> median latency on the method's shapes
    # backend -> {"rss": growth, "pss": growth} in MiB of its load and first call, as measured in this process
    # (a first use in the process includes what the engine's library itself loads)
    memory_mb: dict[str, dict[str, float]]
    note: str = ""  # why a candidate was not kept (its outputs differed)


@dataclass(frozen=True)
class MethodMeta:
    name: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    instructions: tuple[str, ...]  # "delegate_call 0", "host_op aten.relu.default"
    delegates: tuple[DelegateMeta, ...]
    states: tuple[str, ...] = ()  # program states the method reads and updates in place (a KV cache)
    # Delegates that can run the whole method instead (an OpenVINO delegate); `load_program(prefer=...)` picks.
    alternatives: tuple[DelegateMeta, ...] = ()
    # What prefer="latency" chose for this loaded method (backend, timings, memory); None: its instructions run.
    choice: Choice | None = None

    @property
    def stateful(self) -> bool:
        """Whether calls run on a `State` (`execute(..., state=...)`; the program's default one without it)."""
        return bool(self.states)

    def example_inputs(self, seed: int = 0) -> list[np.ndarray]:
        """An input of each input's shape and dtype, for tools that time a method (`onecopy bench`, `profile`):
        standard normal values for floating point, zeros for integers and booleans (valid as indices: token ids,
        positions). A dynamic shape has no example: InvalidArgument."""
        dynamic = [i for i, t in enumerate(self.inputs) if t.is_dynamic]
        if dynamic:
            raise InvalidArgument(f"Method '{self.name}' has dynamic input shapes (input {dynamic[0]}: "
                                  f"{list(self.inputs[dynamic[0]].shape)}); give its inputs.")
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(t.shape).astype(t.dtype) if np.issubdtype(t.dtype, np.floating)
                else np.zeros(t.shape, t.dtype) for t in self.inputs]

    @classmethod
    def from_definition(cls, method: MethodDef, program: ProgramDef,
                        describe: Callable[[int], DelegateSummary] = lambda index: DelegateSummary()) -> "MethodMeta":
        """`describe(index)`: delegate `index` as its backend reads its manifest (`runtime.backend.delegate_summary`)."""
        instructions = []
        delegates = []
        for ins in method.instructions:
            if isinstance(ins, DelegateCall):
                instructions.append(f"delegate_call {ins.delegate}")
                delegates.append(_delegate_meta(ins.delegate, program, describe))
            elif isinstance(ins, HostOp):
                instructions.append(f"host_op {ins.op}")
        return cls(
            method.name,
            tuple(TensorMeta.from_spec(s, n) for s, n in zip(method.input_specs, method.input_names or
                                                               [""] * len(method.input_specs))),
            tuple(TensorMeta.from_spec(s) for s in method.output_specs),
            tuple(instructions),
            tuple(delegates),
            tuple(method.states),
            tuple(_delegate_meta(i, program, describe) for i in method.alternatives),
        )


def _delegate_meta(index: int, program: ProgramDef, describe: Callable[[int], DelegateSummary]) -> DelegateMeta:
    summary = describe(index)
    return DelegateMeta(index, program.delegates[index].backend, summary.function, summary.packaging)
