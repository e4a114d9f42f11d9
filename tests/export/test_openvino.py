"""Export with the OpenVINO alternative: one weights store, what OpenVINO adds, which methods get one."""

from __future__ import annotations

import contextlib
import logging
import re

import pytest

from onecopy.delegate.openvino import parse_manifest
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, export_program
from onecopy.program import read_program as _read


@contextlib.contextmanager
def read_program(path):
    loaded = _read(path)
    try:
        yield loaded
    finally:
        loaded.close()


def _unique(segments, prefix=None):
    """Bytes of each distinct content once, of the segments whose key starts with `prefix` (None: all)."""
    return sum({s.sha256: s.length for s in segments if prefix is None or s.key.startswith(prefix)}.values())


def _openvino_all(definition):
    return [parse_manifest(definition.delegates[i].manifest, "test") for m in definition.methods for i in m.alternatives]


def _openvino(definition):
    return _openvino_all(definition)[0]


def _iree_parameters(definition):
    return {key for d in definition.delegates if d.backend == "IreeBackend" for key in d.manifest["parameters"].values()}


@pytest.mark.parametrize("programs", ["mlp_programs", "conv_programs"])
def test_the_openvino_delegate_reads_iree_parameters_and_adds_only_its_xml_and_own_constants(programs, request):
    iree_path, both_path = request.getfixturevalue(programs)
    with read_program(iree_path) as iree, read_program(both_path) as both:
        manifests = _openvino_all(both.definition)
        shared = {key for m in manifests for key in m.weights.values() if key.startswith("param/")}
        assert shared and shared <= _iree_parameters(both.definition)  # the blobs IREE reads: one copy on disk
        xml = sum(s.length for s in both.definition.segments if s.key in {m.model for m in manifests})
        own = _unique(both.definition.segments, "openvino/const/")
        assert own <= sum(m.folded_bytes for m in manifests) < 64  # a reduction's axes, no weights
        # The file holds IREE's bundle and parameters, the xml and OpenVINO's own constants, and nothing else;
        # its parameters are no more than the IREE-only export's (folded batch norms leave fewer).
        iree_keys = _iree_parameters(both.definition) | {
            key for d in both.definition.delegates if d.backend == "IreeBackend" for key in d.manifest["bundle"].values()}
        iree_bytes = sum({s.sha256: s.length for s in both.definition.segments if s.key in iree_keys}.values())
        assert _unique(both.definition.segments) == iree_bytes + xml + own
        assert _unique(both.definition.segments, "param/") <= _unique(iree.definition.segments, "param/")
        assert all(key.startswith(("param/", "openvino/const/")) for m in manifests for key in m.weights.values())


def test_an_mlp_keeps_torchs_weights_so_openvino_adds_none(mlp_programs):
    with read_program(mlp_programs[1]) as loaded:
        manifest = _openvino(loaded.definition)
        shared = [k for k in manifest.weights.values() if k.startswith("param/")]
        assert len(shared) == 6  # 3 Linear layers' weights and biases, the same blobs IREE reads
        assert manifest.folded_bytes == 0


def test_a_batch_norm_folded_in_torch_leaves_openvino_nothing_to_fold(conv_programs):
    with read_program(conv_programs[1]) as loaded:
        manifest = _openvino(loaded.definition)
        assert sum(k.startswith("param/") for k in manifest.weights.values()) == 4  # conv and fc weights and biases
        assert manifest.folded_bytes == 16  # the mean's axes [2, 3] as int64


def test_every_method_ir_runs_whole_gets_an_alternative(mlp_programs):
    with read_program(mlp_programs[1]) as loaded:
        assert {m.name: len(m.alternatives) for m in loaded.definition.methods} == {"forward": 1, "prefill": 1}


def test_a_stateful_method_gets_no_openvino_delegate_and_the_log_says_why(accumulator, caplog):
    from tests.conftest import accumulator_methods

    pytest.importorskip("openvino")
    with caplog.at_level(logging.WARNING, logger="onecopy"):
        program = export_program(accumulator_methods(accumulator),
                                 compile_spec=CompileSpec(delegates=("iree", "openvino")))
    assert all(not m.alternatives for m in program.definition.methods)
    assert "no OpenVINO delegate: it keeps state" in caplog.text


@pytest.mark.parametrize("delegates, message", [
    (("iree", "tensorrt"), "unknown delegate(s) 'tensorrt'; known: iree, openvino"),
    (("openvino",), "must start with 'iree'"),
    (("iree", "openvino", "openvino"), "name each delegate once"),
    ("openvino", "write delegates=('openvino',)"),
])
def test_a_bad_delegates_list_is_refused_naming_the_fix(delegates, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        CompileSpec(delegates=delegates)


def test_a_program_with_an_openvino_delegate_verifies_clean_without_loading_openvino(conv_programs):
    from onecopy.runtime import verify_program

    assert verify_program(conv_programs[1]) == []
