import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from onecopy import Runtime, Surface
from onecopy.delegate._frame_run import FrameRun
from onecopy.delegate.binding import SurfaceBinding
from onecopy.delegate.engine import hal_device
from onecopy.errors import ExecutionError, InvalidArgument
from onecopy.export import Partitioner, export_program
from tests.conftest import eager

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (1, 4, 16, 32)  # 64 rows of 32 fp16 values: 64-byte rows, a dense surface


class ScaleBias(torch.nn.Module):
    """A frame model: y = x * 2 + 1 (per element), fp16."""

    def forward(self, x):
        return x * 2 + 1


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def export_frame(model, shape, **kwargs):
    ep = torch.export.export(model, (torch.zeros(shape, dtype=torch.float16),))
    return export_program({"forward": ep}, memory_planned_outputs=False, **kwargs)


@pytest.fixture(scope="module")
def scale_bias(tmp_path_factory):
    return export_frame(ScaleBias(), SHAPE).save(tmp_path_factory.mktemp("frames") / "scale_bias.onecopy")


@pytest.fixture(scope="module")
def add_one(tmp_path_factory):
    return export_frame(AddOne(), SHAPE).save(tmp_path_factory.mktemp("frames") / "add_one.onecopy")


def frame(surface, shape=SHAPE):
    return surface.array().reshape(shape)


def pointer(array):
    return array.__array_interface__["data"][0]


def bound_forward(program, *surfaces):
    """The program's `forward`, with `surfaces` bound to it."""
    forward = program.load_method("forward")
    for surface in surfaces:
        forward.bind_surface(surface)
    return forward


def test_in_place_input_and_output_copy_nothing(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    assert src.dense and dst.dense
    src.array()[:] = np.arange(64 * 32, dtype=np.float16).reshape(64, 32) % 100
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        generation = dst.generation
        (y,) = forward.execute([frame(src)], outputs=[frame(dst)])
        stats = forward.last_copy_stats
        assert pointer(y) == dst.base_address  # the result is the surface itself
        assert stats.copied == 0
        assert stats.in_place_in == stats.in_place_out == 64 * 32 * 2
        np.testing.assert_array_equal(dst.array(), src.array() * 2 + 1)
        assert dst.generation == generation + 1  # written under the surface's write lock


def test_repeated_calls_on_new_views_of_bound_surfaces_reuse_the_plan_and_stay_in_place(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    plain = np.zeros(SHAPE, np.float16)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        plans = set()
        for value in (1, 2, 3):
            src.array()[:] = value
            out = frame(dst)  # a new view object each frame, same memory and layout
            (y,) = forward.execute([frame(src)], outputs=[out])
            plans.update(id(call) for call in forward._local.repeats)
            assert y is out  # the caller's own array comes back, not the one the plan was made with
            assert forward.last_copy_stats.copied == 0
            assert forward.last_copy_stats.in_place_in == forward.last_copy_stats.in_place_out == out.nbytes
            np.testing.assert_array_equal(dst.array(), np.full((64, 32), value * 2 + 1, np.float16))
        assert len(plans) == 1
        # The very same arrays again: matched at once, written in place.
        x, out = frame(src), frame(dst)
        for value in (4, 5):
            src.array()[:] = value
            (y,) = forward.execute([x], outputs=[out])
            assert y is out and forward.last_copy_stats.copied == 0
            np.testing.assert_array_equal(out, np.full(SHAPE, value * 2 + 1, np.float16))
        assert {id(call) for call in forward._local.repeats} == plans
        # Another layout (a plain array as output) plans anew, and that output is copied into; a plan that holds
        # a caller's own array is not kept (it would keep the array alive).
        (y,) = forward.execute([frame(src)], outputs=[plain])
        assert y is plain and forward.last_copy_stats.copied_out == plain.nbytes
        np.testing.assert_array_equal(plain, np.full(SHAPE, 11, np.float16))
        assert {id(call) for call in forward._local.repeats} == plans


def test_a_repeated_call_rechecks_what_can_change_in_place(scale_bias, surfaces):
    """An array's shape and dtype can be reassigned and its writeable flag cleared: a kept plan never skips the
    checks those would fail."""
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        x, out = frame(src), frame(dst)
        forward.execute([x], outputs=[out])
        x.shape = (1, 1, 64, 32)
        with pytest.raises(ExecutionError, match=r"Input 0 .* has shape \[1, 1, 64, 32\]; expected \[1, 4, 16, 32\]"):
            forward.execute([x], outputs=[out])
        x.shape = SHAPE
        out.flags.writeable = False
        with pytest.raises(ExecutionError, match="Output 0 .* is read-only"):
            forward.execute([x], outputs=[out])
        out = frame(dst)
        x.dtype = np.int16
        with pytest.raises(ExecutionError, match="Input 0 .* has dtype int16; expected float16"):
            forward.execute([x], outputs=[out])


def test_double_buffering_keeps_one_plan_per_buffer_pair(scale_bias, surfaces):
    pairs = [(surfaces(64, 32), surfaces(64, 32)) for _ in range(2)]
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        for src, dst in pairs:
            forward.bind_surface(src)
            forward.bind_surface(dst)
        frames = [(frame(src), frame(dst)) for src, dst in pairs]
        for step in range(6):
            src, dst = pairs[step % 2]
            x, out = frames[step % 2]
            src.array()[:] = step
            (y,) = forward.execute([x], outputs=[out])
            assert y is out and forward.last_copy_stats.copied == 0
            np.testing.assert_array_equal(out, np.full(SHAPE, step * 2 + 1, np.float16))
        assert len(forward._local.repeats) == 2


def test_a_kept_plan_on_a_closed_surface_fails_the_call(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        x, out = frame(src), frame(dst)
        forward.execute([x], outputs=[out])
        src.close()
        with pytest.raises(ExecutionError, match="closed"):
            forward.execute([x], outputs=[out])


def test_without_binding_the_same_call_copies(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    src.array()[:] = 3
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        forward.execute([frame(src)], outputs=[frame(dst)])
        assert forward.last_copy_stats.copied_in == forward.last_copy_stats.copied_out == 64 * 32 * 2
        assert forward.last_copy_stats.in_place_in == 0
        np.testing.assert_array_equal(dst.array(), np.full((64, 32), 7, np.float16))


def test_a_view_of_a_bound_surface_in_another_dtype_is_copied_not_misread(scale_bias, surfaces):
    wide = surfaces(32, 32, "float32")  # same bytes as 64 x 32 fp16, other dtype
    wide.array()[:] = 0
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        forward.bind_surface(wide)
        as_fp16 = wide.array().view(np.float16).reshape(SHAPE)
        as_fp16[:] = (np.arange(as_fp16.size) % 7).astype(np.float16).reshape(SHAPE)
        assert pointer(as_fp16) == wide.base_address
        (y,) = forward.execute([as_fp16], outputs=[np.empty(SHAPE, np.float16)])
        np.testing.assert_array_equal(y, as_fp16 * 2 + 1)
        assert forward.last_copy_stats.copied_in == as_fp16.nbytes


def test_a_slice_at_a_bound_surfaces_address_is_copied_not_misread(scale_bias, surfaces):
    tall = surfaces(128, 32)
    tall.array()[:] = (np.arange(128 * 32) % 11).astype(np.float16).reshape(128, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        forward.bind_surface(tall)
        head = tall.array()[:64].reshape(SHAPE)
        (y,) = forward.execute([head], outputs=[np.empty(SHAPE, np.float16)])
        np.testing.assert_array_equal(y, head * 2 + 1)
        assert forward.last_copy_stats.copied_in == head.nbytes and forward.last_copy_stats.in_place_in == 0


@pytest.fixture(scope="module")
def square(tmp_path_factory):
    """y = x * 2 + 1 on a 32 x 32 fp16 frame, where a transposed view has the surface's shape."""
    return export_frame(ScaleBias(), (32, 32)).save(tmp_path_factory.mktemp("frames") / "square.onecopy")


@pytest.mark.parametrize("prepared", [False, True])
def test_a_transposed_view_of_a_bound_surface_is_read_through_its_strides(square, surfaces, prepared):
    """The view starts at the surface's base address with its shape and dtype: only its strides say that the
    elements come in another order. In place, the engine would read the surface row by row (max error 19 before
    matching compared strides)."""
    src, dst = surfaces(32, 32), surfaces(32, 32)
    values = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float16)
    src.array()[:] = values
    with Runtime().load_program(square) as program:
        forward = bound_forward(program, src, dst)
        transposed = src.array().T
        assert pointer(transposed) == src.base_address and transposed.shape == (32, 32)
        call = (forward.prepare([transposed], outputs=[dst.array()]).run if prepared
                else lambda: forward.execute([transposed], outputs=[dst.array()]))
        for _ in range(3):  # a kept plan, if any, must give the same answer
            (y,) = call()
            np.testing.assert_array_equal(y, values.T * 2 + 1)
        stats = forward.last_copy_stats
        assert stats.copied_in == 32 * 32 * 2 and stats.in_place_in == 0
        assert stats.in_place_out == 32 * 32 * 2  # the output still is the surface itself
        # The plain view right after: in place again, and right.
        (y,) = forward.execute([src.array()], outputs=[dst.array()])
        np.testing.assert_array_equal(y, values * 2 + 1)
        assert forward.last_copy_stats.copied == 0


def test_a_transposed_view_of_a_bound_output_surface_is_written_through_its_strides(square, surfaces):
    src, dst = surfaces(32, 32), surfaces(32, 32)
    values = np.random.default_rng(1).standard_normal((32, 32)).astype(np.float16)
    src.array()[:] = values
    with Runtime().load_program(square) as program:
        forward = bound_forward(program, src, dst)
        for _ in range(2):
            forward.execute([src.array()], outputs=[dst.array().T])
            np.testing.assert_array_equal(dst.array().T, values * 2 + 1)
        stats = forward.last_copy_stats
        assert stats.in_place_in == 32 * 32 * 2 and stats.copied_out == 32 * 32 * 2 and stats.in_place_out == 0


def test_padded_rows_are_copied_through_their_stride(tmp_path, surfaces):
    shape = (1, 1, 8, 360)
    program_path = export_frame(ScaleBias(), shape).save(tmp_path / "wide.onecopy")
    src, dst = surfaces(8, 360), surfaces(8, 360)
    assert src.bytes_per_row == 768 and not src.dense
    values = (np.arange(8 * 360) % 50).astype(np.float16).reshape(8, 360)
    src.array()[:] = values
    dst.array(include_padding=True)[:] = -1  # padding must stay as it was
    with Runtime().load_program(program_path) as program:
        forward = bound_forward(program, src, dst)
        forward.execute([src.array().reshape(shape)], outputs=[dst.array().reshape(shape)])
        stats = forward.last_copy_stats
    np.testing.assert_array_equal(dst.array(), values * 2 + 1)
    assert (dst.array(include_padding=True)[:, 360:] == -1).all()
    assert stats.copied_in == stats.copied_out == 8 * 360 * 2 and stats.in_place_in == 0


def test_changing_the_argument_shape_remakes_the_view(surfaces):
    surface = surfaces(64, 32)
    binding = SurfaceBinding(surface, "test")
    device = hal_device("local-task")
    first = binding.buffer_view(device, (64, 32), np.dtype(np.float16), "input 0")
    assert binding.buffer_view(device, (64, 32), np.dtype(np.float16), "input 0") is first
    assert binding.views_made == 1
    second = binding.buffer_view(device, (1, 4, 16, 32), np.dtype(np.float16), "input 0")
    assert second is not first and list(second.shape) == [1, 4, 16, 32]
    assert binding.views_made == 2


def test_two_models_chained_through_one_surface_copy_nothing(scale_bias, add_one, surfaces):
    src, middle, dst = surfaces(64, 32), surfaces(64, 32), surfaces(64, 32)
    src.array()[:] = 5
    with Runtime().load_program(scale_bias) as first, Runtime().load_program(add_one) as second:
        a, b = first.load_method("forward"), second.load_method("forward")
        for surface in (src, middle):
            a.bind_surface(surface)
        for surface in (middle, dst):
            b.bind_surface(surface)
        a.execute([frame(src)], outputs=[frame(middle)])
        b.execute([frame(middle)], outputs=[frame(dst)])
        assert a.last_copy_stats.copied == 0 and b.last_copy_stats.copied == 0
    assert (middle.array() == 11).all() and (dst.array() == 12).all()


def test_a_frame_written_by_another_process_is_run_in_place(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    result = subprocess.run([sys.executable, "-m", "tests.surface.surface_child", "write", src.name, "4"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        forward.execute([frame(src)], outputs=[frame(dst)])
        assert forward.last_copy_stats.copied == 0
    assert (dst.array() == 9).all()


def test_bound_surfaces_option_binds_by_name_for_a_single_delegate_method(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    src.array()[:] = 1
    options = {"IreeBackend": {"bound_surfaces": f"{src.name}, {dst.name}"}}
    with Runtime().load_program(scale_bias, backend_options=options) as program:
        forward = program.load_method("forward")
        bound = forward.bound_surfaces
        assert set(bound) == {src.name, dst.name}
        forward.execute([frame(bound[src.name])], outputs=[frame(bound[dst.name])])
        assert forward.last_copy_stats.copied == 0
    assert (dst.array() == 3).all()


def test_bound_surfaces_option_is_refused_for_planned_outputs_or_several_instructions(small_methods, surfaces, tmp_path):
    name = surfaces(64, 32).name
    planned = export_program(small_methods).to_bytes()
    with Runtime().load_program(planned, backend_options={"IreeBackend": {"bound_surfaces": name}}) as program:
        with pytest.raises(InvalidArgument, match=r"option bound_surfaces cannot apply to method 'forward': its outputs are memory planned; export with memory_planned_outputs=False"):
            program.load_method("forward")
    broken = export_program(small_methods, partitioner=Partitioner(skip_ops=("aten.relu.default",)),
                            memory_planned_outputs=False).to_bytes()
    with Runtime().load_program(broken, backend_options={"IreeBackend": {"bound_surfaces": name}}) as program:
        with pytest.raises(InvalidArgument, match=r"it runs 6 instructions \(delegate_call 0, host_op aten.relu.default, .*\), not this delegate's call alone"):
            program.load_method("forward")


def test_unplanned_outputs_need_caller_storage(scale_bias):
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        assert not forward.method_meta.outputs[0].memory_planned
        with pytest.raises(ExecutionError, match=r"Output 0 of method 'forward' is not memory planned .*pass its storage with outputs="):
            forward.execute([np.zeros(SHAPE, np.float16)])


def test_closing_a_bound_surface_fails_the_next_call_cleanly(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        held = frame(src)  # the caller still holds a view of the closed surface: its memory stays valid
        forward.execute([held], outputs=[frame(dst)])  # a kept plan: the next call reruns it
        src.close()
        for _ in range(2):
            with pytest.raises(ExecutionError, match=r"input 0 is bound surface '.*', which was closed") as error:
                forward.execute([held], outputs=[frame(dst)])
        with dst.lock(readonly=False):  # the failed calls gave back what they had taken
            pass
        # The error's advice is something the API can do (there is no unbind): open the surface again and bind
        # it, or pass a plain array.
        message = str(error.value)
        assert "unbind" not in message
        assert f"Surface.open('{src.name}')" in message and "bind_surface()" in message and "plain array" in message
        held[:] = 3
        with Surface.open(src.name) as again:
            forward.bind_surface(again)
            forward.execute([frame(again)], outputs=[frame(dst)])
            stats = forward.last_copy_stats
            assert (stats.copied_in, stats.in_place_in) == (0, frame(again).nbytes)
        assert (frame(dst) == 7).all()
        forward.execute([np.full(SHAPE, 2, np.float16)], outputs=[frame(dst)])  # a plain array: copied in
        assert (frame(dst) == 5).all()


def test_binding_a_closed_or_foreign_object_is_refused(scale_bias, surfaces):
    surface = surfaces(64, 32)
    surface.close()
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        with pytest.raises(InvalidArgument, match=r"surface '.*' is closed; open it again before binding it"):
            forward.bind_surface(surface)
        with pytest.raises(InvalidArgument, match=r"bind_surface takes an onecopy.Surface, got ndarray"):
            forward.bind_surface(np.zeros(4))


def test_a_surface_locked_by_a_writer_elsewhere_cannot_be_bound(scale_bias, surfaces):
    surface = surfaces(64, 32)
    child = subprocess.Popen([sys.executable, "-m", "tests.surface.surface_child", "hold", surface.name, "write"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with Runtime().load_program(scale_bias) as program:
            with pytest.raises(InvalidArgument, match=r"surface '.*' cannot be bound"):
                program.load_method("forward").bind_surface(surface)
    finally:
        child.kill()
        child.communicate()


def test_dlpack_views_of_bound_surfaces_are_used_in_place(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    src.array()[:] = 2
    x = torch.from_dlpack(frame(src))  # a torch tensor over the surface's memory
    y = torch.from_dlpack(frame(dst))
    assert x.data_ptr() == src.base_address and y.data_ptr() == dst.base_address
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        forward.execute([x], outputs=[y])
        assert forward.last_copy_stats.copied == 0
    assert (y == 5).all()


def test_a_prepared_call_reruns_on_each_new_frame_in_place(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        call = forward.prepare([frame(src)], outputs=[frame(dst)])
        for value in (1.0, 3.0, -2.0):  # a new frame each time, written where the engine reads it
            with src.lock() as pixels:
                pixels[:] = value
            generation = dst.generation
            (y,) = call.run()
            assert pointer(y) == dst.base_address
            np.testing.assert_array_equal(dst.array(), np.full((64, 32), value * 2 + 1, np.float16))
            assert call.last_copy_stats.copied == 0 and call.last_copy_stats.in_place_out == dst.nbytes
            assert dst.generation == generation + 1  # locked for writing around each run
        assert forward.last_copy_stats.copied == 0


def test_frame_steps_run_natively_and_still_report_and_log_what_they_moved(scale_bias, surfaces, caplog):
    """A prepared call on bound surfaces, and an execute repeating a kept plan, run as one FrameRun (C): the
    stats they record and the debug log are the Python path's."""
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        call = forward.prepare([frame(src)], outputs=[frame(dst)])
        assert isinstance(call.run, FrameRun)
        with caplog.at_level(logging.DEBUG, logger="onecopy"):
            call.run()
            for _ in range(2):  # planned (Python), then the kept plan's FrameRun
                forward.execute([frame(src)], outputs=[frame(dst)])
        assert isinstance(forward._local.repeats[0][1], FrameRun)  # (snapshots, run) of the kept plan
        logged = [r.getMessage() for r in caplog.records if "copied in" in r.getMessage()]
        assert logged == [f"method forward: copied in 0 B, out 0 B; in place in {src.nbytes} B, out {dst.nbytes} B"] * 3
        stats = forward.last_copy_stats
        assert (stats.copied, stats.in_place_in, stats.in_place_out) == (0, src.nbytes, dst.nbytes)
        stats.in_place_in = 1  # the caller's copy: the runs record one CopyStats, the same each time
        assert forward.last_copy_stats.in_place_in == src.nbytes


def test_a_prepared_call_on_plain_arrays_copies_their_content_at_each_run(scale_bias):
    x, out = np.zeros(SHAPE, np.float16), np.empty(SHAPE, np.float16)
    with Runtime().load_program(scale_bias) as program:
        call = program.load_method("forward").prepare([x], outputs=[out])
        for value in (1.0, 5.0):
            x[:] = value
            (y,) = call.run()
            assert y is out
            np.testing.assert_array_equal(out, np.full(SHAPE, value * 2 + 1, np.float16))
            assert call.last_copy_stats.copied_in == x.nbytes and call.last_copy_stats.copied_out == out.nbytes


class Flip(torch.nn.Module):
    """Each output row reads another input row: run in place over its own input it would read rows it wrote."""

    def forward(self, x):
        return torch.flip(x, [2]) + 1


@pytest.mark.parametrize("prepared", [False, True])
def test_one_surface_as_input_and_output_is_written_after_the_engine_read_it(surfaces, prepared):
    src = surfaces(64, 32)
    with Runtime().load_program(export_frame(Flip(), SHAPE).to_bytes()) as program:
        forward = bound_forward(program, src)
        for value in range(2):  # the checked call, then the kept one
            frame(src)[:] = np.arange(64 * 32, dtype=np.float16).reshape(SHAPE) % 512 + value
            want = eager(Flip(), frame(src).copy())[0]
            call = forward.prepare([frame(src)], outputs=[frame(src)]).run if prepared else (
                lambda: forward.execute([frame(src)], outputs=[frame(src)]))
            generation = src.generation
            (y,) = call()
            assert src.generation == generation + 1  # written under its write lock, copy included
            assert pointer(y) == pointer(frame(src))
            np.testing.assert_array_equal(frame(src), want)
            stats = forward.last_copy_stats
            assert (stats.in_place_in, stats.in_place_out, stats.copied_out) == (src.nbytes, 0, src.nbytes)


def test_a_prepared_call_made_before_a_surface_was_bound_then_runs_on_it_in_place(scale_bias, surfaces):
    """Prepared on the surfaces' memory while nothing was bound: copied in and out. Once both are bound, the same
    prepared call reads and writes them in place (the planning `execute` does for bound surfaces)."""
    src, dst = surfaces(64, 32), surfaces(64, 32)
    with Runtime().load_program(scale_bias) as program:
        forward = program.load_method("forward")
        call = forward.prepare([frame(src)], outputs=[frame(dst)])
        frame(src)[:] = 1.0
        call.run()
        assert forward.last_copy_stats.copied_in == frame(src).nbytes
        forward.bind_surface(src)
        forward.bind_surface(dst)
        frame(src)[:] = 7.0
        (y,) = call.run()
        np.testing.assert_array_equal(frame(dst), np.full(SHAPE, 15.0, np.float16))
        assert pointer(y) == pointer(frame(dst))
        stats = forward.last_copy_stats
        assert (stats.copied_in, stats.in_place_in, stats.in_place_out) == (0, frame(src).nbytes, frame(dst).nbytes)


def test_a_prepared_call_fails_cleanly_once_its_surface_or_program_is_closed(scale_bias, surfaces):
    src, dst = surfaces(64, 32), surfaces(64, 32)
    program = Runtime().load_program(scale_bias)
    forward = bound_forward(program, src, dst)
    call = forward.prepare([frame(src)], outputs=[frame(dst)])
    call.run()
    src.close()
    with pytest.raises(ExecutionError, match=f"input 0 is bound surface '{src.name}', which was closed"):
        call.run()
    with Surface.open(src.name) as again:  # what the error advises: open it again, bind it, prepare again
        forward.bind_surface(again)
        frame(again)[:] = 1
        forward.prepare([frame(again)], outputs=[frame(dst)]).run()
        assert (frame(dst) == 3).all()
    program.close()
    with pytest.raises(ExecutionError, match="belongs to a closed program"):
        call.run()


def test_a_prepared_call_of_a_method_with_a_graph_break_runs_it_whole(small_methods, small_model, rng):
    program = export_program(small_methods, partitioner=Partitioner(skip_ops=("aten.relu.default",)))
    with Runtime().load_program(program.to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        x = rng.standard_normal((1, 64), dtype=np.float32)
        call = forward.prepare([x])
        for _ in range(2):
            x[:] = rng.standard_normal((1, 64), dtype=np.float32)
            np.testing.assert_array_equal(call.run()[0], forward.execute([x])[0])


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_call_waits_for_a_bound_surface_another_process_locked_then_runs(scale_bias, surfaces, mode):
    """The output surface is written under its write lock: a reader or writer elsewhere makes the call wait (the
    locks the engine took at once are held meanwhile), and it runs in place once that process lets go."""
    import threading

    from tests.surface.conftest import Holder

    import os

    # Named so that the input comes first in the locking order: it is taken at once, then the call waits.
    src, dst = (surfaces(64, 32, name=f"waits-{os.getpid()}-{mode}-{tag}") for tag in "ab")
    src.array()[:] = 3
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        x, out = frame(src), frame(dst)
        forward.execute([x], outputs=[out])  # planned and kept: the wait below is the kept plan's
        out[...] = 0
        done = threading.Event()
        errors = []

        def call():
            try:
                forward.execute([x], outputs=[out])
            except Exception as e:  # reported by the main thread
                errors.append(e)
            done.set()

        with Holder(dst.name, mode) as holder:
            thread = threading.Thread(target=call)
            thread.start()
            assert not done.wait(0.3), "the call ran while another process held the output surface"
            assert src._lock.held() == "1 read lock(s)"  # taken at once, held while the output's is awaited
            holder.kill()
            assert done.wait(30)
            thread.join(30)
        assert not errors
        assert forward.last_copy_stats.copied == 0
        np.testing.assert_array_equal(out, np.full(SHAPE, 7, np.float16))
        assert src._lock.held() is None and dst._lock.held() is None



def _permuted_views(surface):
    """Every view of a 64 x 32 fp16 surface shaped [1, 4, 16, 32] that starts at its base address and covers all its
    bytes: the surface's memory read as [1, 4, 16, 32] with the last three axes stored in another order. Only the
    identity is the surface's own layout."""
    import itertools

    whole = surface.array()
    views = []
    for order in itertools.permutations(range(3)):
        stored = whole.reshape((1, *(SHAPE[1 + a] for a in order)))
        view = stored.transpose((0, *(1 + order.index(a) for a in range(3))))
        assert view.shape == SHAPE and pointer(view) == surface.base_address
        views.append(view)
    return views


def test_random_views_of_bound_surfaces_give_exact_results_on_every_path(scale_bias, surfaces):
    """Calls on views of the bound surfaces in every storage order, in random sequence, so that kept plans,
    prepared calls and first calls all meet views that share an address but not a layout."""
    rng = np.random.default_rng(7)
    src, dst = surfaces(64, 32), surfaces(64, 32)
    src.array()[:] = rng.standard_normal((64, 32)).astype(np.float16)
    ins, outs = _permuted_views(src), _permuted_views(dst)
    with Runtime().load_program(scale_bias) as program:
        forward = bound_forward(program, src, dst)
        prepared = {}
        for step in range(60):
            i, o = rng.integers(len(ins)), rng.integers(len(outs))
            x, out = ins[i], outs[o]
            dst.array()[:] = np.nan
            if step % 3 == 2:
                call = prepared.setdefault((i, o), forward.prepare([x], outputs=[out]))
                call.run()
            else:
                forward.execute([x], outputs=[out])
            np.testing.assert_array_equal(out, x * 2 + 1, err_msg=f"input view {i}, output view {o}, step {step}")
            stats = forward.last_copy_stats
            assert (stats.in_place_in, stats.copied_in) == ((x.nbytes, 0) if i == 0 else (0, x.nbytes))
            assert (stats.in_place_out, stats.copied_out) == ((out.nbytes, 0) if o == 0 else (0, out.nbytes))
