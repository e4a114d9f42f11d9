"""`Program.verify()` and `verify_program`: the full check of a file without running it. Loading hashes nothing,
so a flipped data byte loads, and verify is what finds it; the engine never sees code whose hash is wrong."""

import re

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.errors import DelegateError, ProgramFormatError
from onecopy.program import Problem, read_program
from onecopy.runtime import verify_program
from tests.conftest import with_manifest
from tests.program.fuzzing import header_of, layout, with_field


def flipped(data: bytes, key_prefix: str) -> tuple[bytes, str]:
    """`data` with one byte flipped in the middle of the first segment whose key starts with `key_prefix`."""
    _, data_offset = layout(data)
    segment = next(s for s in header_of(data)["segments"] if s["key"].startswith(key_prefix))
    damaged = bytearray(data)
    damaged[data_offset + segment["offset"] + segment["length"] // 2] ^= 0x5A
    return bytes(damaged), segment["key"]


def test_a_whole_program_has_no_problems(small_program_path):
    assert verify_program(small_program_path) == []
    with Runtime().load_program(small_program_path) as program:
        assert program.verify() == []


def test_a_flipped_parameter_byte_loads_but_verify_finds_it(small_program, tmp_path):
    data, key = flipped(small_program.to_bytes(), "param/")
    path = tmp_path / "flipped.onecopy"
    path.write_bytes(data)
    with Runtime().load_program(path) as program:  # loading hashes nothing: it loads
        problems = program.verify()
    assert [p.where for p in problems] == [f"segment '{key}'"]
    assert re.fullmatch(r"its bytes do not match the sha256 in the header \(recorded [0-9a-f]{12}\.\.\., found "
                        r"[0-9a-f]{12}\.\.\.\): the data is corrupted", problems[0].what)
    assert verify_program(path) == problems


def test_a_flipped_vmfb_bundle_fails_load_method_before_the_engine_sees_it(small_vmfb_program):
    # Three flipped bytes of a vmfb once crashed IREE's context creation (a segfault): code is hashed first.
    data, key = flipped(small_vmfb_program.to_bytes(), "bundle/")
    with Runtime().load_program(data) as program:
        with pytest.raises(ProgramFormatError, match=rf"Method '\w+', delegate \d: bundle '{re.escape(key)}' does not "
                                                     r"match its recorded sha256: the program file '<bytes>' is damaged"):
            for name in program.method_names:
                program.load_method(name)
        assert [p.where for p in program.verify()] == [f"segment '{key}'"]


def test_a_flipped_vmfb_bundle_fails_a_load_that_restores_its_packed_weights_too(small_vmfb_program, tmp_path):
    # The code that runs is read once the cache entry says which precision's it is: after the restore.
    with Runtime(cache_dir=tmp_path).load_program(small_vmfb_program.to_bytes()) as program:
        for name in program.method_names:  # the entries of their packed weights
            program.load_method(name)
    data, key = flipped(small_vmfb_program.to_bytes(), "bundle/")
    with Runtime(cache_dir=tmp_path).load_program(data) as program:
        with pytest.raises(ProgramFormatError, match=rf"bundle '{re.escape(key)}' does not match its recorded sha256"):
            for name in program.method_names:
                program.load_method(name)


def test_a_manifest_of_the_wrong_type_loads_fails_load_method_and_is_listed(small_program):
    data = with_manifest(small_program, 0, function=3)
    with Runtime().load_program(data) as program:  # manifests are the backend's: checked at its init
        problems = program.verify()
        with pytest.raises(DelegateError, match=r"invalid manifest: Expected `str`, got `int` - at `\$.function`"):
            program.load_method("forward")
    assert [str(p) for p in problems] == [
        "delegate 0 (IreeBackend): invalid manifest: Expected `str`, got `int` - at `$.function`. Re-export the "
        "program."]


def test_a_manifest_naming_missing_named_data_is_listed(small_program):
    manifest = small_program.definition.delegates[0].manifest
    name = next(iter(manifest["parameters"]))
    data = with_manifest(small_program, 0, bundle={"portable": "bundle/nope"},
                         parameters={**manifest["parameters"], name: "param/nope"})
    assert [str(p) for p in verify_program(data)] == [
        "delegate 0 (IreeBackend): bundle 'portable' names named data 'bundle/nope', which the program does not hold",
        f"delegate 0 (IreeBackend): parameter '{name}' names named data 'param/nope', which the program does not "
        "hold",
    ]


def test_an_unknown_backend_is_listed(small_program):
    data = with_field(small_program.to_bytes(), ("delegates", 1, "backend"), "NoSuchBackend")
    (problem,) = verify_program(data)
    assert problem.where == "delegate 1 (NoSuchBackend)"
    assert problem.what.startswith("No backend named 'NoSuchBackend'; known backends: ")


def test_a_file_that_is_not_a_program_is_one_problem(tmp_path):
    path = tmp_path / "foreign.onecopy"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert verify_program(path) == [Problem("header", f"'{path}' is not a onecopy program (wrong magic b'PK\\x03\\x04"
                                                      "\\x00\\x00\\x00\\x00').")]
    path.write_bytes(b"")
    assert verify_program(path) == [Problem("file", f"Program file '{path}' is empty; re-export it.")]


def test_a_truncated_file_lists_every_cut_segment_and_checks_the_others(small_program, tmp_path):
    data = small_program.to_bytes()
    path = tmp_path / "cut.onecopy"
    path.write_bytes(data[:-1])
    problems = verify_program(path)
    assert len(problems) >= 1
    assert all(re.fullmatch(r"segment '.+'", p.where) and p.what.startswith("truncated: named data ")
               for p in problems)


def test_verify_of_a_closed_program_says_so(small_program_path):
    program = Runtime().load_program(small_program_path)
    program.close()
    with pytest.raises(Exception, match="is closed; load it again"):
        program.verify()


def test_verify_hashes_a_shared_segment_once(monkeypatch):
    # Keys with equal bytes share one segment: a program of hundreds of MB must not be hashed twice over.
    from onecopy.program import NamedDataStore, ProgramDef, ProgramFile
    from onecopy.program import validate

    store = NamedDataStore()
    store.add("param/a", np.arange(1000, dtype=np.float32))
    store.add("param/b", np.arange(1000, dtype=np.float32))
    loaded = read_program(ProgramFile(ProgramDef(methods=[], delegates=[], segments=[]), store).to_bytes())
    hashed = []
    real = validate.hashlib.sha256
    monkeypatch.setattr(validate.hashlib, "sha256", lambda data: hashed.append(len(data)) or real(data))
    assert validate.hash_problems(loaded.definition.segments, loaded.named_data) == []
    assert hashed == [4000]
    loaded.close()
