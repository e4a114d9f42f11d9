"""OpenVinoBackend.init on a real program: weights read from the program file, fp32, the options it takes."""

from __future__ import annotations

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


def test_an_unknown_precision_is_refused(conv_programs, tmp_path):
    loaded = read_program(conv_programs[1])
    try:
        with pytest.raises(InvalidArgument, match=r"\['inference_precision'\] is 'f8'; expected one of f32, bf16"):
            _init(loaded, tmp_path, inference_precision="f8")
    finally:
        loaded.close()
