"""Weights packed once per machine for vmfb programs too: the parameter encoder compiled at export beside each CPU
target's bundle runs at the first load, its output is cached (encoded parameters only: the code runs from the
program file), and every later load, process and VM context maps that one copy."""

import json

import numpy as np
import pytest

from onecopy.delegate import parse_manifest
from onecopy.delegate.cache import open_cache
from onecopy.delegate.targets import host_cpu_target
from onecopy.errors import DelegateError
from onecopy.models import builtin_methods
from tests.conftest import eager, vmfb_without_encoders
from tests.delegate.test_cache import child, load_all

BATCHES = {"forward": 1, "prefill": 16}
BUILTIN_WEIGHT_BYTES = 8 * 1024 * 1024 * 4  # the built-in model's 8 Linear(1024, 1024) weight matrices, fp32


def run(methods, rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{method: (input, output)} for each loaded method (the small model's width, 64)."""
    results = {}
    for method in methods:
        name = method.method_meta.name
        x = rng.standard_normal((BATCHES[name], 64), dtype=np.float32)
        (y,) = method.execute([x])
        results[name] = (x, y)
    return results


def models(methods):
    return [d.model for m in methods for d in m._delegates.values()]


def test_vmfb_program_carries_an_encoder_per_target_and_matches_torch_eager(
    small_vmfb_program, small_vmfb_program_path, small_model, tmp_path, states, rng
):
    for delegate in small_vmfb_program.definition.delegates:
        manifest = parse_manifest(delegate.manifest, "test")
        assert set(manifest.encoders) == set(manifest.bundle) == {host_cpu_target().name}
        assert set(manifest.encoders.values()) <= set(small_vmfb_program.data.keys())
    program, methods = load_all(small_vmfb_program_path, tmp_path)
    try:
        assert states() == ["specialized", "specialized"]  # one module per method: each encoder ran once
        assert all(model.encoded_bytes > 0 for model in models(methods))
        for x, y in run(methods, rng).values():
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    finally:
        program.close()


def test_second_load_restores_the_encoded_parameters(small_vmfb_program_path, tmp_path, states, monkeypatch, rng):
    program, methods = load_all(small_vmfb_program_path, tmp_path)
    expected = run(methods, rng)
    program.close()
    cache = open_cache(tmp_path)
    assert [(e.packaging, e.target) for e in cache.ls()] == [("vmfb", host_cpu_target().name)] * 2
    for entry in (tmp_path / "v1" / "entries").iterdir():
        meta = json.loads((entry / "entry.json").read_text())
        assert meta["module"] is False and meta["encoded"]
        assert (entry / "module.vmfb").stat().st_size == 0  # the code is not copied: it runs from the program
        assert (entry / "encoded.bin").stat().st_size > 0

    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # a load that had to run an encoder would fail
    program, methods = load_all(small_vmfb_program_path, tmp_path)
    try:
        assert states() == ["specialized", "specialized", "restored", "restored"]
        assert all(model.encoded_bytes > 0 for model in models(methods))
        for name, (x, y) in expected.items():
            (again,) = next(m for m in methods if m.method_meta.name == name).execute([x])
            np.testing.assert_array_equal(again, y)
    finally:
        program.close()
    out = child(small_vmfb_program_path, tmp_path, env={"ONECOPY_FORBID_SPECIALIZE": "1"})
    assert out["states"] == ["restored", "restored"]  # another process restores too
    assert all(e.hits >= 2 for e in cache.ls())


def test_encoding_is_a_specialization_step_a_restore_only_load_refuses(small_vmfb_program_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")
    with pytest.raises(DelegateError, match=r"Method 'forward', delegate 0: specialization is forbidden \(ONECOPY_FORBID_SPECIALIZE is set\) but the cache has no entry"):
        load_all(small_vmfb_program_path, tmp_path)
    assert open_cache(tmp_path).ls() == []


def test_disabled_cache_encodes_in_memory_for_each_loaded_model(small_vmfb_program_path, small_model, tmp_path, states,
                                                                 monkeypatch, rng):
    monkeypatch.setenv("ONECOPY_DISABLE_CACHE", "1")
    program, methods = load_all(small_vmfb_program_path, tmp_path / "c")
    try:
        assert states() == ["specialized", "specialized"]
        assert all(model.encoded_bytes > 0 for model in models(methods))
        for x, y in run(methods, rng).values():
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    finally:
        program.close()
    assert not (tmp_path / "c").exists()


def test_vm_contexts_of_one_model_share_one_packed_copy(builtin_program, tmp_path):
    """4 VM contexts of one loaded model (in a fresh process, so freed memory of other tests cannot hide growth):
    the 3 extra contexts must cost far less than one packed copy of the weights. Without encoded parameters each
    context packs its own copy at initialization (see the control below)."""
    out = child(builtin_program, tmp_path, "--contexts", "4")
    assert out["contexts"] == 4
    assert out["encoded_bytes"] >= BUILTIN_WEIGHT_BYTES  # the model was given the packed weights (scope `encoded`)
    assert out["growth"]["Rss"] < BUILTIN_WEIGHT_BYTES / 4, out["growth"]


def test_control_without_an_encoder_every_context_packs_its_own_copy(builtin, tmp_path):
    """The measurement above does see a copy per context when there is one: an old-style vmfb program."""
    path = vmfb_without_encoders(builtin_methods(builtin)).save(tmp_path / "old.onecopy")
    out = child(path, tmp_path / "cache", "--contexts", "4")
    assert out["encoded_bytes"] == 0 and out["states"] == ["restored", "restored"]
    assert out["growth"]["Rss"] > 2 * BUILTIN_WEIGHT_BYTES, out["growth"]
