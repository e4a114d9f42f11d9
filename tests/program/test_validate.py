"""Structural checks at load: a header that disagrees with itself or with the file fails in `read_program`,
naming the field, instead of later as an IndexError (or worse) in the runtime."""

import re
import struct

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.errors import OnecopyError, ProgramError, ProgramFormatError
from onecopy.program import (
    ConstantDef,
    DelegateCall,
    DelegateDef,
    HostOp,
    MethodDef,
    NamedDataStore,
    ProgramDef,
    ProgramFile,
    StateDef,
    TensorSpec,
    ValueArg,
    read_program,
)
from onecopy.runtime import verify_program
from tests.program.fuzzing import header_of, layout, with_field


def program() -> bytes:
    """A method of a delegate call and a host op reading a constant, with a dynamic dimension."""
    store = NamedDataStore()
    store.add("param/w", np.ones((4, 4), np.float32))
    store.add("state/c", np.arange(8, dtype=np.float32))  # the initial value of state 'cache'
    store.add("bundle/b", b"code", alignment=16)
    method = MethodDef(
        name="forward",
        num_values=4,
        inputs=[0],
        outputs=[3],
        input_specs=[TensorSpec(shape=["s0", 4], dtype="float32")],
        output_specs=[TensorSpec(shape=["s0", 4], dtype="float32")],
        instructions=[
            DelegateCall(delegate=0, inputs=[0], outputs=[2]),
            HostOp(op="aten.add.Tensor", args=[ValueArg(id=2), ValueArg(id=1)], outputs=[3], output_dtypes=["float32"]),
        ],
        constants=[ConstantDef(id=1, key="param/w", spec=TensorSpec(shape=[4, 4], dtype="float32"))],
        symbols={"s0": [1, 64]},
        states=["cache"],
        input_bounds={0: [0, 63]},
        input_names=["x"],
    )
    delegate = DelegateDef(backend="IreeBackend", manifest={"input_names": ["x"], "output_names": ["y"]})
    state = StateDef(name="cache", spec=TensorSpec(shape=[2, 4], dtype="float32"), initial="state/c")
    return ProgramFile(ProgramDef(methods=[method], delegates=[delegate], segments=[], states=[state]),
                       store).to_bytes()


def test_the_whole_program_passes():
    read_program(program()).close()


M = ("methods", 0)
CASES = [
    ((*M, "instructions", 0, "delegate"), 7,
     "method 'forward', instruction 0 (delegate_call), field delegate: delegate 7 does not exist; the program has 1 "
     "delegate (0..0)"),
    ((*M, "inputs", 0), 4, "method 'forward', field inputs[0]: value 4 does not exist; the method has 4 values (0..3)"),
    ((*M, "outputs", 0), -1, "method 'forward', field outputs[0]: value -1 does not exist"),
    ((*M, "instructions", 0, "outputs", 0), 9,
     "method 'forward', instruction 0 (delegate_call), field outputs[0]: value 9 does not exist"),
    ((*M, "instructions", 1, "args", 1, "id"), 9,
     "method 'forward', instruction 1 (host_op aten.add.Tensor), field args[1]: value 9 does not exist"),
    ((*M, "instructions", 1, "output_dtypes"), ["float32", "float32"],
     "method 'forward', instruction 1 (host_op aten.add.Tensor), field output_dtypes: 2 dtypes for 1 outputs"),
    ((*M, "instructions", 1, "output_dtypes"), ["bfloat16"],
     "instruction 1 (host_op aten.add.Tensor), field output_dtypes[0]: 'bfloat16' is not a dtype onecopy runs"),
    ((*M, "input_specs"), [], "method 'forward', field input_specs: 0 specs for 1 inputs"),
    ((*M, "input_specs", 0, "dtype"), "bfloat16",
     "method 'forward', input_specs[0], field dtype: 'bfloat16' is not a dtype onecopy runs"),
    ((*M, "output_specs", 0, "dtype"), "object", "'object' is not a dtype onecopy runs"),
    ((*M, "output_specs", 0, "shape", 1), -4, "method 'forward', output_specs[0], field shape[1]: -4 is negative"),
    ((*M, "symbols", "s0"), [5, 2], "method 'forward', symbols['s0']: max 2 is below min 5"),
    ((*M, "symbols", "s0"), [1], "method 'forward', symbols['s0']: [1] is not [min, max]"),
    ((*M, "symbols", "s0"), [None, 4], "min None is not a non-negative int"),
    ((*M, "constants", 0, "key"), "param/nope",
     "method 'forward', constants[0] ('param/nope'), field key: named data 'param/nope' is not among the program's "
     "segments"),
    ((*M, "constants", 0, "spec", "shape"), [4, 5],
     "method 'forward', constants[0] ('param/w'): float32[4, 5] needs 80 bytes, its named data has 64"),
    ((*M, "constants", 0, "spec", "shape"), ["s0", 4], "shape ['s0', 4] is dynamic; a constant's is static"),
    ((*M, "constants", 0, "id"), 0, "value 0 is already an input or another constant"),
    ((*M, "num_values"), 10**12,
     "method 'forward', field num_values: 1000000000000 values, but the method defines only 4"),
    ((*M, "instructions", 0, "inputs", 0), 3,
     "method 'forward', instruction 0 (delegate_call): reads value 3 before anything writes it"),
    ((*M, "instructions"), [], "method 'forward', field outputs[0]: value 3 is never written"),
    ((*M, "instructions", 0, "outputs"), [2, 2],
     "method 'forward', instruction 0 (delegate_call), field outputs: 2 outputs for delegate 0, whose manifest "
     "names 1 (output_names)"),
    ((*M, "name"), "", "method '': the method name is empty"),
    (("segments", 0, "offset"), -4096, "segment 'param/w': negative offset (-4096) or length"),
    (("segments", 0, "alignment"), 3, "segment 'param/w', field alignment: 3 is not a power of two"),
    (("segments", 0, "alignment"), 0, "segment 'param/w', field alignment: 0 is not a power of two"),
    (("segments", 0, "length"), 10**9, "segment 'param/w': truncated: named data 'param/w' ends at byte 1000004096"),
    (("segments", 0, "sha256"), "abc", "segment 'param/w', field sha256: 'abc' is not a sha256"),
    (("segments", 1, "key"), "param/w", "segment 'param/w': a second segment with this key"),
    (("delegates", 0, "backend"), "", "delegate 0, field backend: the backend name is empty"),
    ((*M, "states", 0), "kv", "method 'forward', field states: state 'kv' is not among the program's states"),
    ((*M, "input_bounds"), {"3": [0, 1]}, "method 'forward', field input_bounds: input 3 does not exist; the method has 1"),
    ((*M, "input_bounds"), {"0": [5, 1]}, "method 'forward', field input_bounds[0]: [5, 1] is not [min, max]"),
    ((*M, "input_names"), ["x", "y"], "method 'forward', field input_names: 2 names for 1 inputs"),
    (("states", 0, "spec", "shape"), [2, "s0"], "state 0 ('cache'), field spec: shape [2, 's0'] is dynamic"),
    (("states", 0, "spec", "shape"), [4, 4],
     "state 0 ('cache'), field initial: float32[4, 4] needs 64 bytes, its initial value has 32"),
    (("states", 0, "initial"), "state/nope", "state 0 ('cache'), field initial: named data 'state/nope' is not among"),
    (("states", 0, "spec", "dtype"), "object", "state 0 ('cache'), field spec, field dtype: 'object' is not a dtype"),
    (("states", 0, "name"), "", "state 0 (''), field name: the name is empty or names another state too"),
]


@pytest.mark.parametrize("path, value, message", CASES, ids=[f"{'.'.join(map(str, c[0]))}={c[1]}" for c in CASES])
def test_a_damaged_header_fails_at_load_naming_the_field(path, value, message):
    data = with_field(program(), path, value)
    with pytest.raises(ProgramFormatError) as info:
        read_program(data)
    text = str(info.value)
    assert text.startswith("Program '<bytes>' is damaged or was not written by onecopy: ")
    # The error names the first problem; verify lists every one.
    assert message in text or message in "\n".join(map(str, verify_program(data)))
    assert text.endswith("Re-export or re-copy the program; onecopy.runtime.verify_program(data) lists every "
                         "problem.")


def test_an_unaligned_segment_offset_is_refused():
    data = program()
    offset = header_of(data)["segments"][2]["offset"]  # the bundle, aligned to 16
    with pytest.raises(ProgramFormatError, match=f"segment 'bundle/b', field offset: {offset + 8} is not a multiple "
                                                 "of its alignment 16"):
        read_program(with_field(data, ("segments", 2, "offset"), offset + 8))


def test_two_methods_of_one_name_are_refused():
    data = program()
    method = header_of(data)["methods"][0]
    with pytest.raises(ProgramFormatError, match=r"method 1 \('forward'\): a second method named 'forward'"):
        read_program(with_field(data, ("methods",), [method, method]))


@pytest.mark.parametrize("data_offset, message", [
    (16, "preamble, field data offset: the data starts at byte 16, inside the header"),
    (4096 + 8, "preamble, field data offset: the data starts at byte 4104, not on a 4096-byte page boundary"),
])
def test_a_data_offset_inside_the_header_or_off_a_page_is_refused(data_offset, message):
    data = bytearray(program())
    struct.pack_into("<Q", data, 24, data_offset)
    with pytest.raises(ProgramFormatError, match=re.escape(message)):
        read_program(bytes(data))


def test_every_problem_is_counted_and_verify_lists_them_all():
    data = with_field(with_field(program(), (*M, "inputs", 0), 4), ("segments", 0, "alignment"), 3)
    with pytest.raises(ProgramFormatError, match=r"3 is not a power of two \(and 2 more problems\)"):
        read_program(data)
    # (This test's manifest is not an IreeBackend one: verify reports that too, after the structure.)
    assert [str(p) for p in verify_program(data) if not p.where.startswith("delegate")] == [
        "segment 'param/w', field alignment: 3 is not a power of two",
        "method 'forward', field inputs[0]: value 4 does not exist; the method has 4 values (0..3)",
        "method 'forward', instruction 0 (delegate_call): reads value 0 before anything writes it (not an input, a "
        "constant or an earlier instruction's result)",
    ]


def test_program_error_is_the_program_format_error():
    assert ProgramError is ProgramFormatError and issubclass(ProgramError, OnecopyError)


# The two failures issue #16 reports, on a real program.

def test_a_call_of_delegate_7_of_1_fails_at_load_not_as_an_index_error(small_program):
    whole = small_program.to_bytes()
    header = header_of(whole)
    assert header["methods"][0]["instructions"][0]["delegate"] == 0
    # `forward` alone, with the one delegate it calls.
    data = with_field(with_field(whole, ("methods",), header["methods"][:1]), ("delegates",), header["delegates"][:1])
    Runtime().load_program(data).close()
    damaged = with_field(data, ("methods", 0, "instructions", 0, "delegate"), 7)
    with pytest.raises(ProgramFormatError, match=re.escape(
            "method 'forward', instruction 0 (delegate_call), field delegate: delegate 7 does not exist; the program "
            "has 1 delegate (0..0)")):
        Runtime().load_program(damaged)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_truncated_file_raises_a_program_format_error_not_a_buffer_error(tmp_path, cut):
    # Cut inside the last segment (the 4-byte bundle), so the first lies whole in the mapping: its view used to
    # outlive the failed parse and make closing the mapping raise BufferError over the error.
    path = tmp_path / "cut.onecopy"
    path.write_bytes(program()[:-cut])
    with pytest.raises(ProgramFormatError, match=rf"Program '{re.escape(str(path))}' .*segment 'bundle/b': "
                                                 "truncated: named data 'bundle/b' ends at byte"):
        Runtime().load_program(path)


def test_a_truncated_real_program_raises_a_program_format_error(small_program, tmp_path):
    data = small_program.to_bytes()
    _, data_offset = layout(data)
    path = tmp_path / "cut.onecopy"
    for segment in header_of(data)["segments"]:
        path.write_bytes(data[: data_offset + segment["offset"] + segment["length"] - 1])
        with pytest.raises(ProgramFormatError, match=rf"truncated: named data '{re.escape(segment['key'])}'"):
            read_program(path)
