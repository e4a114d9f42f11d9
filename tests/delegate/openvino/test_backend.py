"""OpenVinoBackend.init on a real program: weights read from the program file, fp32, the options it takes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from onecopy.delegate.openvino.backend import OpenVinoBackend
from onecopy.errors import InvalidArgument
from onecopy.program import read_program
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.init_context import InitContext

pytest.importorskip("openvino")


def _init(loaded, tmp_path, **options):
    (index,) = loaded.definition.methods[0].alternatives
    context = InitContext("forward", index, loaded.named_data, options, loaded.path, tmp_path, lambda: None)
    return OpenVinoBackend().init(context, loaded.definition.delegates[index].manifest)


@pytest.mark.parametrize("source", ["path", "bytes"])
def test_the_delegate_runs_the_method_in_fp32_from_the_programs_weights(conv_programs, conv_net, tmp_path, source):
    path = conv_programs[1]
    loaded = read_program(path if source == "path" else path.read_bytes())
    try:
        delegate = _init(loaded, tmp_path)
        x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
        stats = CopyStats()
        (y,) = delegate.execute([x], [None], stats)
        with torch.no_grad():
            want = conv_net(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
        assert stats.copied_in == 0 and stats.copied_out == y.nbytes  # C-contiguous input shared, output copied
        delegate.destroy()
        with pytest.raises(InvalidArgument, match="destroyed"):
            delegate.execute([x], [None], CopyStats())
    finally:
        loaded.close()


def test_compiled_models_are_cached_in_onecopys_cache_dir(conv_programs, tmp_path):
    loaded = read_program(conv_programs[1])
    try:
        _init(loaded, tmp_path).destroy()
        assert any((tmp_path / "openvino").iterdir())
    finally:
        loaded.close()


def test_a_model_compiles_into_openvinos_cache_under_a_lock_other_processes_wait_on(conv_programs, tmp_path,
                                                                                    monkeypatch):
    """OpenVINO writes its cache blob in place and maps it to import it: processes loading one program at once
    read a blob another was still writing (SIGBUS, or wrong answers). Compiling holds a file lock per model."""
    import filelock

    import onecopy.delegate.openvino.backend as backend

    core = backend._shared_core(backend.import_openvino("test"))
    held = []

    class Core:  # OpenVINO's Core, noting whether another holder (a process: a descriptor of its own) could lock
        def read_model(self, **kwargs):
            return core.read_model(**kwargs)

        def compile_model(self, *args):
            for path in (tmp_path / "openvino" / "locks").glob("*.lock"):
                try:
                    with ThreadPoolExecutor(1) as pool:  # a FileLock of another thread: another descriptor
                        pool.submit(lambda: filelock.FileLock(path, timeout=0).acquire().lock.release()).result()
                except filelock.Timeout:
                    held.append(path.name)
            return core.compile_model(*args)

    monkeypatch.setattr(backend, "_shared_core", lambda ov: Core())
    loaded = read_program(conv_programs[1])
    try:
        _init(loaded, tmp_path).destroy()
    finally:
        loaded.close()
    assert len(held) == 1


def test_an_unknown_precision_is_refused(conv_programs, tmp_path):
    loaded = read_program(conv_programs[1])
    try:
        with pytest.raises(InvalidArgument, match=r"\['inference_precision'\] is 'f8'; expected one of f32, bf16"):
            _init(loaded, tmp_path, inference_precision="f8")
    finally:
        loaded.close()


def test_calls_from_several_threads_run_side_by_side_each_on_its_own_request(conv_programs, conv_net, tmp_path):
    loaded = read_program(conv_programs[1])
    try:
        delegate = _init(loaded, tmp_path)
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(4)]
        with torch.no_grad():
            wants = [conv_net(torch.from_numpy(x)).numpy() for x in xs]
        requests = delegate._requests
        with requests.request():  # a call in flight holds one request: another thread's call does not wait for it
            with ThreadPoolExecutor(1) as other:
                (y,) = other.submit(delegate.execute, [xs[0]], [None], CopyStats()).result(timeout=60)
            assert requests.made == 2
        np.testing.assert_allclose(y, wants[0], rtol=1e-5, atol=1e-5 * float(np.abs(wants[0]).max()))

        def calls(i):  # four threads, each its own input, repeatedly: every answer is its own input's
            return [delegate.execute([xs[i]], [None], CopyStats())[0] for _ in range(10)]

        with ThreadPoolExecutor(4) as pool:
            for i, got in enumerate(pool.map(calls, range(4))):
                for y in got:
                    np.testing.assert_allclose(y, wants[i], rtol=1e-5, atol=1e-5 * float(np.abs(wants[i]).max()))
        assert 2 <= requests.made <= 4  # one per call in flight, kept for the next
        # Destroyed while a call is in flight: that call finishes on the model and weights it holds; later calls
        # are refused.
        with requests.request() as request:
            delegate.destroy()
            with pytest.raises(InvalidArgument, match="destroyed"):
                delegate.execute([xs[1]], [None], CopyStats())
            (y,) = request.infer([xs[1]], share_inputs=False, share_outputs=False).values()
            np.testing.assert_allclose(y, wants[1], rtol=1e-5, atol=1e-5 * float(np.abs(wants[1]).max()))
            assert requests._weights is not None
        assert requests._weights is None and requests._compiled is None
    finally:
        loaded.close()
