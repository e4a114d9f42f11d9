"""The compiler's two-phase compile (onecopy.delegate.compiler): which flags call for which configuration edit, and
an edit IREE cannot compile falls back to IREE's own configurations instead of failing the load."""

import torch

from onecopy.delegate import compiler
from onecopy.delegate.tuning import (
    CHANNELS_LAST,
    CHANNELS_LAST_DATA_TILING,
    CONV_DATA_TILING,
    DEFAULT,
)
from tests.delegate.test_conv_tiles import assert_compiles_edited_and_matches_torch
from tests.delegate.test_transpose_tiles import Stem


def test_each_edit_applies_to_the_flags_that_create_its_dispatches():
    edits = compiler._configuration_edits
    assert edits(list(DEFAULT.flags), data_tiling=True) == []  # one phase: nothing to edit
    assert edits(list(CHANNELS_LAST.flags), data_tiling=True) == [compiler._WHOLE_ROWS]
    assert edits(list(CONV_DATA_TILING.flags), data_tiling=True) == [compiler._NARROW_ROWS]
    assert edits(list(CHANNELS_LAST_DATA_TILING.flags), data_tiling=True) == [compiler._NARROW_ROWS,
                                                                              compiler._WHOLE_ROWS]
    # Without data tiling no convolution is data-tiled: its tiles are not there to set.
    assert edits(list(CHANNELS_LAST_DATA_TILING.flags), data_tiling=False) == [compiler._WHOLE_ROWS]


def test_an_edit_iree_cannot_compile_falls_back_to_the_one_phase_compile(monkeypatch, caplog):
    def breaks(configuration: str) -> tuple[str, int]:  # an edit gone wrong: text IREE does not parse
        return configuration.replace("func.func @", "func.func %", 1), 1

    monkeypatch.setattr(compiler, "_WHOLE_ROWS", (breaks, "a broken edit"))
    torch.manual_seed(0)
    assert_compiles_edited_and_matches_torch(Stem().eval(), torch.randn(1, 3, 32, 48), CHANNELS_LAST,
                                             "the two-phase compile failed", caplog)
    assert "a broken edit" not in caplog.text  # the edit's change is logged only when its compile succeeds
