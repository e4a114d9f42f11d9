"""Structural checks of a parsed program: everything the runtime indexes or sizes by what the header says.

The schema (msgspec) already guarantees each field's type; these checks guarantee that the values agree with each
other and with the file: every value id below `num_values`, every delegate index below the number of delegates,
every segment inside the file's data, every dtype one onecopy runs, every constant's bytes as long as its spec.
`read_program` runs them on every load, so a damaged or hand-edited header fails there with a `ProgramFormatError`
naming the field, never later as an `IndexError` deep in a call. They read the header only (no segment bytes are
hashed: programs are hundreds of MB); `hash_problems` is the full check `onecopy verify` adds.

Example:

    problems = structure_problems(definition, file_size=size, header_end=end, data_offset=offset)
    for p in problems:
        print(p)        # "method 'forward', instruction 0, field delegate: delegate 7 does not exist; ..."
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from onecopy.program.schema import (
    ConstArg, DelegateCall, DelegateDef, HostOp, MethodDef, ProgramDef, SegmentDef, TensorSpec,
)

__all__ = ["DTYPES", "Problem", "structure_problems", "hash_problems"]

# The dtypes a program's tensors may have: those numpy names exactly (the runtime hands numpy arrays to the
# engine). torch-only types (bfloat16, float8_*) have no numpy dtype, so no program carrying one could run.
DTYPES = frozenset({
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})
_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
}
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a program file: `where` in it (segment, method, instruction, field), and `what`."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def structure_problems(definition: ProgramDef, *, file_size: int, header_end: int, data_offset: int,
                       page_size: int) -> list[Problem]:
    """Every disagreement between the header's fields, and between the header and the file's size."""
    problems = list(_segment_problems(definition.segments, file_size, header_end, data_offset, page_size))
    segments = {s.key: s for s in definition.segments}
    seen: set[str] = set()
    for index, method in enumerate(definition.methods):
        if method.name in seen:
            problems.append(Problem(f"method {index} ('{method.name}')",
                                    f"a second method named '{method.name}'; method names must be unique"))
        seen.add(method.name)
        problems.extend(_method_problems(method, definition.delegates, segments))
    problems.extend(_state_problems(definition, segments))
    for index, delegate in enumerate(definition.delegates):
        if not delegate.backend:
            problems.append(Problem(f"delegate {index}, field backend", "the backend name is empty"))
    return problems


def _segment_problems(segments: list[SegmentDef], file_size: int, header_end: int, data_offset: int,
                      page_size: int) -> Iterator[Problem]:
    if data_offset < header_end:
        yield Problem("preamble, field data offset",
                      f"the data starts at byte {data_offset}, inside the header (which ends at byte {header_end})")
        return  # every segment's position would be wrong
    if data_offset % page_size:
        yield Problem("preamble, field data offset",
                      f"the data starts at byte {data_offset}, not on a {page_size}-byte page boundary")
        return
    keys: set[str] = set()
    for segment in segments:
        where = f"segment '{segment.key}'"
        if not segment.key:
            yield Problem(f"segment {len(keys)}", "the key is empty")
        if segment.key in keys:
            yield Problem(where, "a second segment with this key; keys must be unique")
        keys.add(segment.key)
        if segment.offset < 0 or segment.length < 0:
            yield Problem(where, f"negative offset ({segment.offset}) or length ({segment.length})")
            continue
        alignment = segment.alignment
        if alignment <= 0 or alignment & (alignment - 1):
            yield Problem(f"{where}, field alignment", f"{alignment} is not a power of two")
        elif segment.offset % alignment:
            yield Problem(f"{where}, field offset", f"{segment.offset} is not a multiple of its alignment {alignment}")
        if not _SHA256.fullmatch(segment.sha256):
            yield Problem(f"{where}, field sha256", f"{segment.sha256[:80]!r} is not a sha256 (64 hex digits)")
        end = data_offset + segment.offset + segment.length
        if end > file_size:
            yield Problem(where, f"truncated: named data '{segment.key}' ends at byte {end}, the file has "
                                 f"{file_size}")


def _method_problems(method: MethodDef, delegate_defs: list[DelegateDef],
                     segments: dict[str, SegmentDef]) -> Iterator[Problem]:
    name = method.name
    delegates = len(delegate_defs)
    at = f"method '{name}'"
    if not name:
        yield Problem(at, "the method name is empty")
    count = method.num_values
    if count < 0:
        yield Problem(f"{at}, field num_values", f"{count} is negative")
        return
    defined_anywhere = len(method.inputs) + len(method.constants) + sum(
        len(ins.outputs) for ins in method.instructions)
    # Every value is a method input, a constant or an instruction's result: a table longer than that holds slots
    # nothing writes (and a huge count would be allocated on every call).
    if count > defined_anywhere:
        yield Problem(f"{at}, field num_values",
                      f"{count} values, but the method defines only {defined_anywhere} (inputs, constants and "
                      "instruction results)")

    has = f"the method has {count} values (0..{count - 1})" if count else "the method has no values"

    def ids(values: Iterable[int], where: str) -> Iterator[Problem]:
        for position, vid in enumerate(values):
            if not 0 <= vid < count:
                yield Problem(f"{where}[{position}]", f"value {vid} does not exist; {has}")

    yield from ids(method.inputs, f"{at}, field inputs")
    yield from ids(method.outputs, f"{at}, field outputs")
    for field, values, specs in (("inputs", method.inputs, method.input_specs),
                                 ("outputs", method.outputs, method.output_specs)):
        if len(specs) != len(values):
            yield Problem(f"{at}, field {field[:-1]}_specs",
                          f"{len(specs)} specs for {len(values)} {field}; there must be one per {field[:-1]}")
        for position, spec in enumerate(specs):
            yield from _spec_problems(spec, f"{at}, {field[:-1]}_specs[{position}]")
    for symbol, bounds in method.symbols.items():
        yield from _symbol_problems(symbol, bounds, f"{at}, symbols['{symbol}']")

    defined = set(method.inputs)
    for position, constant in enumerate(method.constants):
        where = f"{at}, constants[{position}] ('{constant.key}')"
        yield from ids([constant.id], f"{where}, field id")
        if constant.id in defined:
            yield Problem(f"{where}, field id", f"value {constant.id} is already an input or another constant")
        defined.add(constant.id)
        spec_problems = list(_spec_problems(constant.spec, f"{where}, field spec"))
        yield from spec_problems
        if any(isinstance(d, str) for d in constant.spec.shape):
            yield Problem(f"{where}, field spec", f"shape {constant.spec.shape} is dynamic; a constant's is static")
            continue
        segment = segments.get(constant.key)
        if segment is None:
            yield Problem(f"{where}, field key", f"named data '{constant.key}' is not among the program's segments")
        elif not spec_problems:
            nbytes = _ITEMSIZE[constant.spec.dtype]
            for d in constant.spec.shape:
                nbytes *= int(d)
            if nbytes != segment.length:
                yield Problem(where, f"{constant.spec.dtype}{constant.spec.shape} needs {nbytes} bytes, its named "
                                     f"data has {segment.length}")

    for position, ins in enumerate(method.instructions):
        if isinstance(ins, DelegateCall):
            where = f"{at}, instruction {position} (delegate_call)"
            if not 0 <= ins.delegate < delegates:
                yield Problem(f"{where}, field delegate",
                              f"delegate {ins.delegate} does not exist; the program has {delegates} "
                              f"delegate{'s' if delegates != 1 else ''}"
                              + (f" (0..{delegates - 1})" if delegates else ""))
            reads = list(ins.inputs)
            yield from ids(ins.inputs, f"{where}, field inputs")
            if 0 <= ins.delegate < delegates:
                yield from _arity_problems(ins, delegate_defs[ins.delegate].manifest, where)
        elif isinstance(ins, HostOp):
            where = f"{at}, instruction {position} (host_op {ins.op})"
            if not ins.op:
                yield Problem(f"{where}, field op", "the op name is empty")
            if ins.output_dtypes and len(ins.output_dtypes) != len(ins.outputs):
                yield Problem(f"{where}, field output_dtypes", f"{len(ins.output_dtypes)} dtypes for "
                                                               f"{len(ins.outputs)} outputs")
            for k, dtype in enumerate(ins.output_dtypes):
                yield from _dtype_problems(dtype, f"{where}, field output_dtypes[{k}]")
            reads = []
            for field, args in (("args", list(enumerate(ins.args))), ("kwargs", list(ins.kwargs.items()))):
                for key, arg in args:
                    if isinstance(arg, ConstArg):
                        continue
                    label = f"[{key}]" if field == "args" else f"['{key}']"
                    if not 0 <= arg.id < count:
                        yield Problem(f"{where}, field {field}{label}", f"value {arg.id} does not exist; {has}")
                    reads.append(arg.id)
        else:  # the schema's union has these two members only
            continue
        yield from ids(ins.outputs, f"{where}, field outputs")
        for vid in reads:
            if 0 <= vid < count and vid not in defined:
                yield Problem(where, f"reads value {vid} before anything writes it (not an input, a constant or "
                                     "an earlier instruction's result)")
        defined.update(ins.outputs)
    for position, index in enumerate(method.alternatives):
        where = f"{at}, alternatives[{position}]"
        if not 0 <= index < delegates:
            yield Problem(where, f"delegate {index} does not exist; the program has {delegates} "
                                 f"delegate{'s' if delegates != 1 else ''}")
            continue
        # An alternative runs the whole method: it takes the method's inputs and returns its outputs.
        whole = DelegateCall(delegate=index, inputs=list(method.inputs), outputs=list(method.outputs))
        yield from _arity_problems(whole, delegate_defs[index].manifest, where)
    for position, vid in enumerate(method.outputs):
        if 0 <= vid < count and vid not in defined:
            yield Problem(f"{at}, field outputs[{position}]",
                          f"value {vid} is never written (not an input, a constant or an instruction's result)")


def _arity_problems(call: DelegateCall, manifest: dict, where: str) -> Iterator[Problem]:
    # Every manifest names its function's arguments and results (`input_names`, `output_names`): a call passing
    # another count would fail in the engine's own terms. Their types are the backend's to check, at its init.
    for field, names, values in (("inputs", manifest.get("input_names"), call.inputs),
                                 ("outputs", manifest.get("output_names"), call.outputs)):
        if isinstance(names, list) and len(names) != len(values):
            yield Problem(f"{where}, field {field}",
                          f"{len(values)} {field} for delegate {call.delegate}, whose manifest names "
                          f"{len(names)} ({field[:-1]}_names)")


def _state_problems(definition: ProgramDef, segments: Mapping[str, SegmentDef]) -> Iterator[Problem]:
    """States: unique names, static specs, an initial value of their size; every state a method names exists and
    every input bound names an input."""
    names: set[str] = set()
    for index, state in enumerate(definition.states):
        where = f"state {index} ('{state.name}')"
        if not state.name or state.name in names:
            yield Problem(f"{where}, field name", "the name is empty or names another state too")
        names.add(state.name)
        spec_problems = list(_spec_problems(state.spec, f"{where}, field spec"))
        yield from spec_problems
        if any(isinstance(d, str) for d in state.spec.shape):
            yield Problem(f"{where}, field spec", f"shape {state.spec.shape} is dynamic; a state's is static")
        elif state.initial is not None and not spec_problems:
            segment = segments.get(state.initial)
            nbytes = _ITEMSIZE[state.spec.dtype]
            for d in state.spec.shape:
                nbytes *= int(d)
            if segment is None:
                yield Problem(f"{where}, field initial", f"named data '{state.initial}' is not among the segments")
            elif segment.length != nbytes:
                yield Problem(f"{where}, field initial", f"{state.spec.dtype}{state.spec.shape} needs {nbytes} "
                                                         f"bytes, its initial value has {segment.length}")
    for index, method in enumerate(definition.methods):
        at = f"method '{method.name}'"
        for name in method.states:
            if name not in names:
                yield Problem(f"{at}, field states", f"state '{name}' is not among the program's states")
        for position, bounds in method.input_bounds.items():
            if not 0 <= position < len(method.inputs):
                yield Problem(f"{at}, field input_bounds", f"input {position} does not exist; the method has "
                                                           f"{len(method.inputs)}")
            elif len(bounds) != 2 or bounds[0] > bounds[1]:
                yield Problem(f"{at}, field input_bounds[{position}]", f"{bounds} is not [min, max]")
        if method.input_names and len(method.input_names) != len(method.inputs):
            yield Problem(f"{at}, field input_names", f"{len(method.input_names)} names for {len(method.inputs)} "
                                                      "inputs")
        elif len(set(method.input_names)) != len(method.input_names):
            yield Problem(f"{at}, field input_names", f"names repeat: {method.input_names}")


def _dtype_problems(dtype: str, where: str) -> Iterator[Problem]:
    if dtype not in DTYPES:
        yield Problem(where, f"'{dtype[:40]}' is not a dtype onecopy runs ({', '.join(sorted(DTYPES))})")


def _spec_problems(spec: TensorSpec, where: str) -> Iterator[Problem]:
    yield from _dtype_problems(spec.dtype, f"{where}, field dtype")
    for axis, d in enumerate(spec.shape):
        if isinstance(d, int) and d < 0:
            yield Problem(f"{where}, field shape[{axis}]", f"{d} is negative")
        elif isinstance(d, str) and not d:
            yield Problem(f"{where}, field shape[{axis}]", "the symbol is empty")
    # A str dimension names a symbol of `symbols`, or an expression of them (e.g. `2*s0`, an output's size) that
    # the runtime does not check against a range.


def _symbol_problems(symbol: str, bounds: list[int | None], where: str) -> Iterator[Problem]:
    if len(bounds) != 2:
        yield Problem(where, f"{bounds} is not [min, max]")
        return
    low, high = bounds
    if not isinstance(low, int) or low < 0:
        yield Problem(where, f"min {low} is not a non-negative int")
    elif high is not None and high < low:
        yield Problem(where, f"max {high} is below min {low}")


def hash_problems(segments: list[SegmentDef], views: Mapping[str, memoryview]) -> list[Problem]:
    """Each segment's bytes against its recorded sha256 (a segment shared by several keys is hashed once)."""
    problems = []
    found: dict[tuple[int, int], str] = {}
    for segment in segments:
        view = views.get(segment.key)
        if view is None:
            continue  # outside the file: a structural problem already
        place = (segment.offset, segment.length)
        digest = found.get(place)
        if digest is None:
            digest = found[place] = hashlib.sha256(view).hexdigest()
        if digest != segment.sha256:
            problems.append(Problem(f"segment '{segment.key}'", f"its bytes do not match the sha256 in the header "
                                    f"(recorded {segment.sha256[:12]}..., found {digest[:12]}...): the data is "
                                    "corrupted"))
    return problems
