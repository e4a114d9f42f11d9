"""The typed schema of a program file's header.

Decoding is strict: a field of the wrong type, an unknown field or a missing one is an error naming the field
(msgspec reports it as a path such as `$.methods[0].instructions[2].delegate`). Delegate manifests are kept as
plain mappings here because they belong to their backend, which validates them with its own schema and errors.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

__all__ = [
    "TensorSpec",
    "ValueArg",
    "ConstArg",
    "Arg",
    "DelegateCall",
    "HostOp",
    "Instruction",
    "ConstantDef",
    "MethodDef",
    "StateDef",
    "DelegateDef",
    "SegmentDef",
    "ProgramDef",
]


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class TensorSpec(_Strict):
    """Shape and dtype of a tensor. A dimension is an int, or a symbol name (str) where it is dynamic."""

    shape: list[Union[int, str]]
    dtype: str
    # Outputs the runtime allocates are memory planned; the others need caller-provided storage.
    memory_planned: bool = True


class ValueArg(_Strict, tag="value"):
    """A reference to a value slot of the method."""

    id: int


Scalar = Union[int, float, bool, str, None]


class ConstArg(_Strict, tag="const"):
    """A literal argument of a host op (ints, floats, bools, strings, lists of them)."""

    value: Union[Scalar, list[Scalar]]


Arg = Union[ValueArg, ConstArg]


class DelegateCall(_Strict, tag="delegate_call"):
    """Call delegate `delegate` on the values `inputs`; its results fill the values `outputs`."""

    delegate: int
    inputs: list[int]
    outputs: list[int]


class HostOp(_Strict, tag="host_op"):
    """Run the host kernel registered under `op` (e.g. `aten.relu.default`)."""

    op: str
    args: list[Arg]
    outputs: list[int]
    kwargs: dict[str, Arg] = {}
    # Per output, the dtype torch.export recorded for it (what the kernel must return); empty in files written
    # before it was recorded.
    output_dtypes: list[str] = []


Instruction = Union[DelegateCall, HostOp]


class ConstantDef(_Strict):
    """A value the method reads from the named data store (a weight a host op needs)."""

    id: int
    key: str
    spec: TensorSpec


class MethodDef(_Strict):
    name: str
    num_values: int
    inputs: list[int]
    outputs: list[int]
    input_specs: list[TensorSpec]
    output_specs: list[TensorSpec]
    instructions: list[Instruction]
    constants: list[ConstantDef] = []
    # Dynamic dimensions: symbol -> [min, max] (max None: unbounded), as exported with torch.export.Dim.
    symbols: dict[str, list[Union[int, None]]] = {}
    # Names of the program states (`ProgramDef.states`) the method reads or updates in place.
    states: list[str] = []
    # Input index -> [min, max] of the values it may hold (e.g. a cache position), checked before each call.
    input_bounds: dict[int, list[int]] = {}
    # Per input, its name in the exported signature (`forward(self, ids, mask)`; a keyword input's key): what
    # `execute({name: array})` and serving's named npz members go by. Empty in files written before names.
    input_names: list[str] = []
    # Delegates (indices into `ProgramDef.delegates`) that can each run the whole method instead of its
    # instructions: they take the method's inputs and return its outputs. The runtime picks one at load
    # (`load_program(prefer=...)`); a file without any runs its instructions.
    alternatives: list[int] = []


class StateDef(_Strict):
    """A tensor kept by the engine between calls (a KV cache): updated in place by the methods that name it.

    `initial`: named data key of its initial value; None means all zeros (stored as no bytes at all)."""

    name: str
    spec: TensorSpec
    initial: Union[str, None] = None


class DelegateDef(_Strict):
    """One lowered partition: the backend that runs it and that backend's manifest."""

    backend: str
    manifest: dict[str, Any]


class SegmentDef(_Strict):
    """A named blob of the data store. Keys with equal content share one offset."""

    key: str
    offset: int
    length: int
    sha256: str
    alignment: int


class ProgramDef(_Strict):
    methods: list[MethodDef]
    delegates: list[DelegateDef]
    segments: list[SegmentDef]
    states: list[StateDef] = []
