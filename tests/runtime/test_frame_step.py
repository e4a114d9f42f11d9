"""The frame step's two forms, the definition (Python) and its accelerator (C), give the same results and the same
`CopyStats` on the same randomized calls through `Method`: shapes, strided arrays, bound and unbound surfaces,
plans kept by `execute` or not, and prepared calls."""

import dataclasses

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.delegate import frame_step
from onecopy.delegate._frame_run import FrameRun
from onecopy.delegate.frame_step import FrameStep
from onecopy.export import export_program

SHAPES = {"forward": (1, 4, 16, 32), "half": (1, 2, 16, 32)}  # 64-byte rows: dense surfaces
CALLS = 60


class ScaleBias(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


@pytest.fixture(scope="module")
def frames_program(tmp_path_factory):
    methods = {name: torch.export.export(ScaleBias(), (torch.zeros(shape, dtype=torch.float16),))
               for name, shape in SHAPES.items()}
    program = export_program(methods, memory_planned_outputs=False)
    return program.save(tmp_path_factory.mktemp("frame_step") / "frames.onecopy")


def script(seed):
    """The calls, drawn once: (method, input kind, output kind, way, bound)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
    return [(pick(list(SHAPES)), pick(["surface", "plain", "strided"]), pick(["surface", "plain"]),
             pick(["execute", "repeat", "prepare"]), bool(rng.integers(2))) for _ in range(CALLS)]


def run_script(path, surfaces, calls, seed):
    """Every call of `calls`, on a fresh load of the program and fresh surfaces: what each returned and recorded,
    and the type of each prepared call's run."""
    rng = np.random.default_rng(seed)
    outcome, runs = [], []
    with Runtime().load_program(path) as program:
        made = {}
        for name, shape in SHAPES.items():
            rows = shape[1] * shape[2]
            made[name] = {(bound, role): surfaces(rows, shape[3], "float16") for bound in (True, False)
                          for role in ("in", "out")}
            method = program.load_method(name)
            method.bind_surface(made[name][True, "in"])
            method.bind_surface(made[name][True, "out"])
        for name, source, target, way, bound in calls:
            shape = SHAPES[name]
            method = program.load_method(name)
            data = rng.standard_normal(shape).astype(np.float16)
            if source == "surface":
                x = made[name][bound, "in"].array().reshape(shape)
            elif source == "plain":
                x = np.empty(shape, np.float16)
            else:  # every other element of a wider array: copied through its strides
                x = np.empty((*shape[:-1], 2 * shape[-1]), np.float16)[..., ::2]
            x[...] = data
            y = made[name][bound, "out"].array().reshape(shape) if target == "surface" else np.empty(shape, np.float16)
            if way == "prepare":
                call = method.prepare([x], outputs=[y])
                runs.append(type(call.run).__name__)
                produced = [call.run(), call.run()]
            else:
                produced = [method.execute([x], outputs=[y]) for _ in range(2 if way == "repeat" else 1)]
            for (result,) in produced:
                np.testing.assert_array_equal(result, data * 2 + 1)
            outcome.append(([r[0].copy() for r in produced], dataclasses.astuple(method.last_copy_stats)))
    return outcome, runs


@pytest.mark.parametrize("seed", [1, 2])
def test_the_accelerator_runs_the_definition(frames_program, surfaces, monkeypatch, seed):
    calls = script(seed)
    monkeypatch.setattr(frame_step, "ACCELERATED", True)
    accelerated, accelerated_runs = run_script(frames_program, surfaces, calls, seed)
    monkeypatch.setattr(frame_step, "ACCELERATED", False)
    defined, defined_runs = run_script(frames_program, surfaces, calls, seed)
    assert len(accelerated) == len(defined) == CALLS
    for (got, stats), (want, want_stats) in zip(accelerated, defined):
        assert stats == want_stats
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    # Both forms ran frame steps (bound input and output), and nothing else differed between the two runs.
    assert FrameRun.__name__ in accelerated_runs and FrameStep.__name__ in defined_runs
    assert [r.replace(FrameRun.__name__, "step") for r in accelerated_runs] == [
        r.replace(FrameStep.__name__, "step") for r in defined_runs]
    assert any(stats[0] == 0 and stats[1] == 0 for _, stats in defined)  # some calls copied nothing
    assert any(stats[0] > 0 for _, stats in defined)  # and some copied their input


def test_a_kept_plan_repeats_through_the_chosen_form(frames_program, surfaces, monkeypatch):
    """`execute` repeating a kept plan runs the frame step `ACCELERATED` chose when the plan was made."""
    for accelerated, kind in ((True, FrameRun), (False, FrameStep)):
        monkeypatch.setattr(frame_step, "ACCELERATED", accelerated)
        with Runtime().load_program(frames_program) as program:
            shape = SHAPES["forward"]
            src, dst = surfaces(64, 32, "float16"), surfaces(64, 32, "float16")
            forward = program.load_method("forward")
            forward.bind_surface(src)
            forward.bind_surface(dst)
            forward.execute([src.array().reshape(shape)], outputs=[dst.array().reshape(shape)])
            assert isinstance(forward._local.repeats[0][1], kind)
