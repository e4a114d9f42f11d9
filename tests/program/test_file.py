import os
import struct

import msgspec
import numpy as np
import pytest

from onecopy.errors import ExportError, InvalidArgument, OnecopyError, ProgramFormatError
from onecopy.program import (
    FORMAT_VERSION,
    MAGIC,
    PAGE_SIZE,
    DelegateCall,
    DelegateDef,
    HostOp,
    MethodDef,
    NamedDataStore,
    ProgramDef,
    ProgramFile,
    TensorSpec,
    ValueArg,
    ConstArg,
    read_program,
)
from tests.delegate import huge_probe


def tiny_program() -> ProgramFile:
    store = NamedDataStore()
    store.add("param/a", np.arange(1000, dtype=np.float32))
    store.add("param/b", np.arange(1000, dtype=np.float32))  # same bytes: stored once
    store.add("bundle/x", b"code", alignment=16)
    method = MethodDef(
        name="forward",
        num_values=3,
        inputs=[0],
        outputs=[2],
        input_specs=[TensorSpec(shape=[1, "seq"], dtype="float32")],
        output_specs=[TensorSpec(shape=[1, "seq"], dtype="float32")],
        instructions=[
            DelegateCall(delegate=0, inputs=[0], outputs=[1]),
            HostOp(op="aten.clamp.default", args=[ValueArg(id=1), ConstArg(value=0.0)], outputs=[2],
                   kwargs={"max": ConstArg(value=[1, 2.5, None])}),
        ],
    )
    definition = ProgramDef(methods=[method], delegates=[DelegateDef(backend="IreeBackend", manifest={})], segments=[])
    return ProgramFile(definition, store)


def test_saved_program_round_trips_exactly(tmp_path):
    program = tiny_program()
    path = program.save(tmp_path / "p.onecopy")
    assert path.read_bytes() == program.to_bytes()
    loaded = read_program(path)
    try:
        assert loaded.definition.methods == program.definition.methods
        assert bytes(loaded.named_data["bundle/x"]) == b"code"
        assert np.array_equal(np.frombuffer(loaded.named_data["param/b"], np.float32), np.arange(1000))
        resaved = ProgramFile(loaded.definition, program.data).to_bytes()
        assert resaved == program.to_bytes()
    finally:
        loaded.close()


def test_equal_content_is_stored_once_and_parameters_are_page_aligned():
    program = tiny_program()
    loaded = read_program(program.to_bytes())
    offsets = {s.key: s.offset for s in loaded.definition.segments}
    assert offsets["param/a"] == offsets["param/b"]
    absolute = {k: loaded.named_data.location(k)[0] for k in offsets}
    assert absolute["param/a"] % PAGE_SIZE == 0
    assert absolute["bundle/x"] % 16 == 0
    assert len(program.to_bytes()) < 2 * PAGE_SIZE + 4000 + 100
    loaded.close()


def test_weights_read_in_place_map_on_huge_pages_where_the_kernel_can(tmp_path):
    if not huge_probe.file_pages_map_huge(tmp_path):
        pytest.skip(huge_probe.SKIP_REASON)
    program = tiny_program()
    weights = np.random.default_rng(0).standard_normal(3 << 20, dtype=np.float32)  # 12 MiB
    program.data.add("param/big", weights)
    path = program.save(tmp_path / "p.onecopy")
    with open(path, "rb") as f:  # as after eviction (or a reboot): the load reads the file from disk
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    loaded = read_program(path)
    try:
        assert np.array_equal(np.frombuffer(loaded.named_data["param/big"], np.float32), weights)  # touches all
        assert huge_probe.file_pmd_mapped(path) >= 4 * huge_probe.HUGE  # the whole huge pages inside 12 MiB
    finally:
        loaded.close()


def test_same_key_with_different_bytes_is_an_error():
    store = NamedDataStore()
    store.add("k", b"one")
    store.add("k", b"one")  # same bytes again: fine
    with pytest.raises(InvalidArgument, match="Named data key 'k' was added twice with different bytes"):
        store.add("k", b"two")


def test_bytes_program_is_used_in_place():
    data = bytearray(tiny_program().to_bytes())
    loaded = read_program(data)
    view = loaded.named_data["bundle/x"]
    data[loaded.named_data.location("bundle/x")[0]] = ord("C")
    assert bytes(view) == b"Code"  # a view of the caller's buffer, not a copy
    loaded.close()


def test_wrong_magic_names_the_file(tmp_path):
    path = tmp_path / "bad.onecopy"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ProgramFormatError, match=r"'.*bad.onecopy' is not a onecopy program \(wrong magic"):
        read_program(path)


def test_newer_format_version_asks_to_upgrade(tmp_path):
    data = bytearray(tiny_program().to_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    with pytest.raises(ProgramFormatError, match="format version 2, newer than this onecopy reads .*upgrade onecopy"):
        read_program(bytes(data))


@pytest.mark.parametrize("keep", [0, 10, 40, 200])
def test_truncated_header_is_reported(tmp_path, keep):
    path = tmp_path / "cut.onecopy"
    path.write_bytes(tiny_program().to_bytes()[:keep])
    with pytest.raises(ProgramFormatError, match="empty|truncated"):
        read_program(path)


def test_truncated_data_names_the_segment(tmp_path):
    data = tiny_program().to_bytes()
    path = tmp_path / "cut.onecopy"
    path.write_bytes(data[:-10])
    with pytest.raises(ProgramFormatError, match=r"truncated: named data '(param/a|param/b|bundle/x)' ends at byte"):
        read_program(path)


def test_schema_violation_names_the_field():
    program = tiny_program()
    data = program.to_bytes()
    magic, version, reserved, header_len, data_offset = struct.unpack_from("<8sIIQQ", data)
    header = msgspec.json.decode(data[32 : 32 + header_len])
    header["methods"][0]["instructions"][0]["delegate"] = "zero"
    new_header = msgspec.json.encode(header)
    assert len(new_header) <= data_offset - 32
    patched = data[:16] + struct.pack("<QQ", len(new_header), data_offset) + new_header + data[32 + len(new_header):]
    with pytest.raises(ProgramFormatError, match=r"violates the schema: Expected `int`, got `str` - at `\$.methods\[0\].instructions\[0\].delegate`"):
        read_program(patched)


def test_corrupted_header_is_an_error_not_a_crash():
    data = bytearray(tiny_program().to_bytes())
    data[40:48] = b"\xff" * 8
    with pytest.raises(ProgramFormatError, match="corrupted header|violates the schema"):
        read_program(bytes(data))


def test_missing_file_and_directory_are_clear(tmp_path):
    with pytest.raises(InvalidArgument, match="does not exist"):
        read_program(tmp_path / "nope.onecopy")
    with pytest.raises(InvalidArgument, match="is a directory"):
        read_program(tmp_path)
    with pytest.raises(InvalidArgument, match="from a path or bytes"):
        read_program(42)
    with pytest.raises(InvalidArgument, match=r"got ProgramFile. Save it first \(program.save\(path\)\) or pass "
                                              r"program.to_bytes\(\)"):
        read_program(tiny_program())


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    program = tiny_program()
    target = tmp_path / "p.onecopy"
    target.write_bytes(b"previous")

    def boom(self, out):
        out.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ProgramFile, "write_to", boom)
    with pytest.raises(OnecopyError, match=r"Could not save the program to '.*p.onecopy' \(disk full\); nothing "
                                           r"was written there \(a file already at that path is unchanged\)"):
        program.save(target)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["p.onecopy"]


def test_saved_program_has_the_mode_of_a_new_file_or_of_the_file_it_replaces(tmp_path):
    """The temporary file a save renames into place is made 0600: the program was readable by its owner alone
    (a server running as another user could not load it), and a file saved over lost its mode."""
    umask = os.umask(0o022)
    try:
        path = tiny_program().save(tmp_path / "p.onecopy")
        assert os.stat(path).st_mode & 0o777 == 0o644
        os.chmod(path, 0o640)
        tiny_program().save(path)
        assert os.stat(path).st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_weights_changed_in_place_after_they_were_added_are_refused_at_save(tmp_path):
    """The store holds blobs by reference (an exported program: the model's own parameters). Changed in place
    before the save (a training step, load_state_dict into the same model), they were written under the hash of
    their old bytes: the file ran other weights than the exported ones, and verify called it corrupted."""
    weights = np.arange(1000, dtype=np.float32)
    store = NamedDataStore()
    store.add("param/w", weights)
    program = ProgramFile(tiny_program().definition, store)
    target = tmp_path / "p.onecopy"
    target.write_bytes(b"previous")
    weights[3] = -1.0
    with pytest.raises(ExportError, match=r"Named data 'param/w' changed after the program was made .* Save the "
                                          r"program before changing the model, or export it again"):
        program.save(target)
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["p.onecopy"]
    with pytest.raises(ExportError, match="'param/w' changed"):
        program.to_bytes()


def test_save_refuses_a_directory_or_missing_parent(tmp_path):
    with pytest.raises(InvalidArgument, match="is a directory"):
        tiny_program().save(tmp_path)
    with pytest.raises(InvalidArgument, match="does not exist"):
        tiny_program().save(tmp_path / "missing" / "p.onecopy")
    with pytest.raises(InvalidArgument, match=r"Cannot save the program to '/proc/p.onecopy': no file can be made "
                                              r"in directory '/proc' \(.*\); give a path in a writable directory"):
        tiny_program().save("/proc/p.onecopy")  # a directory nothing can be created in, even as root


def test_verify_detects_corrupted_named_data():
    data = bytearray(tiny_program().to_bytes())
    loaded = read_program(data)
    loaded.named_data.verify("param/a")
    data[loaded.named_data.location("param/a")[0]] ^= 0xFF
    with pytest.raises(ProgramFormatError, match="does not match its recorded sha256"):
        loaded.named_data.verify("param/a")
    loaded.close()


def test_magic_is_stable():
    assert tiny_program().to_bytes()[:8] == MAGIC
