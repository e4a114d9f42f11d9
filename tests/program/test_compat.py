"""Program files written by an earlier onecopy still load and run: the header and manifest schema only grow.

`data/` holds files written by onecopy at commit f8e7851 (its exporter built each manifest as a dict) with
`data/write.py`; the answers beside them are torch eager's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.delegate import parse_manifest
from onecopy.program import read_program

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name", ["accumulator", "in_place"])
def test_an_earlier_program_file_parses_with_the_current_schema(name):
    loaded = read_program(DATA / f"{name}.onecopy")
    for index, delegate in enumerate(loaded.definition.delegates):
        parse_manifest(delegate.manifest, f"delegate {index}")


def test_an_earlier_stateful_multifunction_program_runs_as_eager_does(tmp_path):
    want = np.load(DATA / "accumulator.npz")
    with Runtime(cache_dir=tmp_path).load_program(DATA / "accumulator.onecopy") as program:
        manifest = parse_manifest(program.definition.delegates[0].manifest, "delegate 0")
        assert manifest.multifunction and [s.name for s in manifest.states] == ["cache", "steps", "total"]
        prefill = program.load_method("prefill").execute([want["x2"], np.array([0, 1])])
        decode = program.load_method("decode").execute([want["x1"], np.array([2])])
    np.testing.assert_allclose(prefill[0], want["prefill_0"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decode[0], want["decode_0"], rtol=1e-5, atol=1e-5)
    assert (int(prefill[1]), int(decode[1])) == (int(want["prefill_1"]), int(want["decode_1"])) == (1, 2)


def test_an_earlier_program_with_caller_provided_outputs_writes_them_in_place(tmp_path):
    want = np.load(DATA / "in_place.npz")
    with Runtime(cache_dir=tmp_path).load_program(DATA / "in_place.onecopy") as program:
        assert parse_manifest(program.definition.delegates[0].manifest, "delegate 0").outputs_in_place
        y = np.zeros_like(want["y"])
        program.load_method("forward").execute([want["x"]], outputs=[y])
    np.testing.assert_allclose(y, want["y"], rtol=1e-5, atol=1e-5)
