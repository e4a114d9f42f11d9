"""load_program(prefer=...): which delegate runs a method with an OpenVINO alternative, chosen once per machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.delegate.precision import native_bf16_flags
from onecopy.delegate.targets import cpu_flags
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.runtime import agreement, selection
from onecopy.runtime.method_meta import TensorMeta


def _torch(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_bad_prefer_value_is_refused_naming_the_choices(conv_programs):
    with pytest.raises(InvalidArgument, match=r"prefer='fast' is not one of 'memory', 'latency'"):
        Runtime().load_program(conv_programs[1], prefer="fast")


@pytest.mark.parametrize("programs, model, shape", [("conv_programs", "conv_net", (1, 3, 16, 16)),
                                                     ("mlp_programs", "small_model", (1, 64))])
def test_latency_times_once_records_the_choice_and_later_loads_restore_it(programs, model, shape, request, tmp_path):
    path, net = request.getfixturevalue(programs)[1], request.getfixturevalue(model)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    timed = selection.selections_timed()
    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        forward = program.load_method("forward")
        _close(forward.execute([x])[0], _torch(net, x))
        first = forward.method_meta.choice
    assert selection.selections_timed() == timed + 1
    assert set(first.latency_ms) == {"IreeBackend", "OpenVinoBackend"} and first.note == ""
    assert set(first.memory_mb) == {"IreeBackend", "OpenVinoBackend"}
    assert forward.method_meta.delegates[0].backend == first.backend
    (record,) = (tmp_path / "choices").glob("*.json")
    assert json.loads(record.read_text())["backend"] == first.backend

    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        forward = program.load_method("forward")
        _close(forward.execute([x])[0], _torch(net, x))
        assert forward.method_meta.choice == first
    assert selection.selections_timed() == timed + 1  # restored: nothing timed


def test_a_recorded_openvino_choice_runs_openvino_and_matches_torch(conv_programs, conv_net, tmp_path):
    path = conv_programs[1]
    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        program.load_method("forward")
    (record,) = (tmp_path / "choices").glob("*.json")
    raw = json.loads(record.read_text())
    with Runtime(cache_dir=tmp_path).load_program(path) as program:
        alternative = program.method_meta("forward").alternatives[0].index
    record.write_text(json.dumps({**raw, "backend": "OpenVinoBackend", "delegate": alternative}))
    timed = selection.selections_timed()
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        forward = program.load_method("forward")
        assert [d.backend for d in forward.method_meta.delegates] == ["OpenVinoBackend"]
        (y,) = forward.execute([x])
        out = np.empty_like(y)
        forward.execute([x], outputs=[out])
        _close(out, _torch(conv_net, x))
        _close(y, _torch(conv_net, x))
    assert selection.selections_timed() == timed


def test_memory_never_imports_openvino(conv_programs):
    script = (
        "import sys, numpy as np\n"
        "from onecopy import Runtime\n"
        f"p = Runtime().load_program({str(conv_programs[1])!r})\n"
        "f = p.load_method('forward')\n"
        "f.execute([np.zeros((1, 3, 16, 16), np.float32)])\n"
        "assert f.method_meta.choice is None and f.method_meta.delegates[0].backend == 'IreeBackend'\n"
        "print('openvino' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_damaged_openvino_ir_fails_the_latency_load_with_a_clear_error(conv_programs, tmp_path):
    data = bytearray(conv_programs[1].read_bytes())
    with Runtime().load_program(conv_programs[1]) as program:
        index = program.method_meta("forward").alternatives[0].index
        key = program.definition.delegates[index].manifest["model"]
        offset, length = program.named_data.location(key)
    data[offset + length // 2: offset + length // 2 + 8] = b"<<<<<<<<"
    damaged = tmp_path / "damaged.onecopy"
    damaged.write_bytes(bytes(data))
    with Runtime(cache_dir=tmp_path).load_program(damaged, prefer="latency") as program:
        with pytest.raises(DelegateError, match=r"Method 'forward', delegate 1 \(OpenVINO\): the OpenVINO IR stored "
                                                r"in the program is not valid xml .*re-export it"):
            program.load_method("forward")


def test_latency_without_openvino_names_the_extra_to_install(conv_programs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    with Runtime(cache_dir=tmp_path).load_program(conv_programs[1], prefer="latency") as program:
        with pytest.raises(DelegateError, match=r"pip install 'onecopy\[openvino\]'"):
            program.load_method("forward")


@pytest.mark.skipif(not any(flag in cpu_flags() for flag in native_bf16_flags()),
                    reason="this CPU has no native bf16: precision='bf16' is refused here")
def test_bf16_latency_runs_both_engines_in_bf16_and_records_a_choice_of_its_own(conv_programs, conv_net, tmp_path,
                                                                               caplog):
    path = conv_programs[1]
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        program.load_method("forward")
    with caplog.at_level("INFO", logger="onecopy"), \
            Runtime(cache_dir=tmp_path).load_program(path, prefer="latency", precision="bf16") as program:
        forward = program.load_method("forward")
        got = forward.execute([x])[0]
        choice = forward.method_meta.choice
    assert "OpenVINO delegate loaded (bf16" in caplog.text  # timed in bf16, as IREE is
    assert choice.note == ""  # OpenVINO bf16 within bf16's tolerance of IREE bf16
    want = _torch(conv_net, x)
    np.testing.assert_allclose(got, want, atol=3e-2 * float(np.abs(want).max()))
    assert len(list((tmp_path / "choices").glob("*.json"))) == 2  # fp32's and bf16's, side by side


def test_delegates_are_timed_warm_interleaved_and_for_the_budget(monkeypatch):
    calls: list[str] = []

    def run(name, ms):
        def call(arrays):
            calls.append(name)
            time.sleep(ms / 1e3)
            return [np.zeros(2, np.float32)]
        return call

    monkeypatch.setattr(selection, "TIMING_BUDGET_S", 0.2)
    inputs = [TensorMeta((2,), np.dtype("float32"), True)]
    started = time.perf_counter()
    latency, rejected = selection.time_delegates({"iree": run("iree", 4), "openvino": run("openvino", 1)}, "iree",
                                                 inputs)
    elapsed = time.perf_counter() - started
    assert rejected == {} and latency["openvino"] < latency["iree"]
    # The check (the reference's outputs on the random inputs and their mirror, then the other's), a warm-up each
    assert calls[:6] == ["iree", "iree", "openvino", "openvino", "iree", "openvino"]
    timed = calls[6:]
    rounds = len(timed) // 2
    assert elapsed >= 0.2 and selection.MIN_RUNS <= rounds <= 0.2 / 0.005 + 1  # the budget, in rounds of >= 5 ms
    assert timed[:4] == ["iree", "openvino", "openvino", "iree"]  # the order alternates round by round


def _runs(reference, other):
    """time_delegates' runs: each maps the inputs to its outputs, without a delegate."""
    return {"iree": lambda arrays: [reference(*arrays)], "openvino": lambda arrays: [other(*arrays)]}


def _quick(monkeypatch):
    monkeypatch.setattr(selection, "TIMING_BUDGET_S", 0.0)
    monkeypatch.setattr(selection, "MIN_RUNS", 1)


def test_integer_outputs_must_be_equal_whatever_their_scale(monkeypatch):
    # Compared as floats within 1e-4 of the outputs' scale, a count of 100000 passed for 100001.
    _quick(monkeypatch)
    inputs = [TensorMeta((2,), np.dtype("float32"), True)]
    big = np.array([100000, 5], np.int64)
    _, rejected = selection.time_delegates(_runs(lambda x: big, lambda x: big + [0, 1]), "iree", inputs)
    assert rejected == {"openvino": "output 0 differs from iree's in 1 of 2 elements (integers must be equal)"}
    flags = np.array([True, False])
    _, rejected = selection.time_delegates(_runs(lambda x: flags, lambda x: ~flags), "iree", inputs)
    assert rejected == {"openvino": "output 0 differs from iree's in 2 of 2 elements (integers must be equal)"}
    _, rejected = selection.time_delegates(_runs(lambda x: big, lambda x: big.copy()), "iree", inputs)
    assert rejected == {}


@pytest.mark.parametrize("want, got", [(np.int64, np.int32), (np.float32, np.float64), (np.uint8, np.int8)])
def test_an_output_of_another_dtype_is_not_kept_even_with_the_same_values(monkeypatch, want, got):
    _quick(monkeypatch)
    inputs = [TensorMeta((3,), np.dtype("float32"), True)]
    values = np.array([1, 2, 3])
    _, rejected = selection.time_delegates(_runs(lambda x: values.astype(want), lambda x: values.astype(got)),
                                           "iree", inputs)
    assert rejected == {"openvino": f"output 0 is {np.dtype(got)}, iree's {np.dtype(want)}"}


def test_a_floor_division_that_truncates_is_caught_where_the_bounds_allow_negatives(monkeypatch):
    # OpenVINO's integer floor division rounds toward zero: only negative dividends show it.
    _quick(monkeypatch)
    inputs = [TensorMeta((1, 8), np.dtype("float32"), True), TensorMeta((16,), np.dtype("int64"), True)]
    runs = _runs(lambda x, b: np.floor_divide(b, 4), lambda x, b: (np.trunc(b / 4)).astype(np.int64))
    _, rejected = selection.time_delegates(runs, "iree", inputs, bounds={1: [-9, 9]})
    assert rejected["openvino"].startswith("output 0 differs from iree's in ")
    # The limitation: without bounds that allow negatives, the input is never negative, and this goes unseen.
    assert selection.time_delegates(runs, "iree", inputs, bounds={1: [0, 9]})[1] == {}
    assert selection.time_delegates(runs, "iree", inputs)[1] == {}


def test_the_mirrored_inputs_show_what_the_first_draw_missed(monkeypatch):
    _quick(monkeypatch)
    inputs = [TensorMeta((1,), np.dtype("int32"), True)]
    first = agreement.random_inputs(inputs, bounds={0: [-5, 5]})[0]
    assert first[0] != 0  # the draw is seeded: 0 would be its own mirror
    sign = np.sign(first[0])  # an engine right for the first draw's sign only
    runs = _runs(lambda b: np.floor_divide(b, 2), lambda b: np.where(np.sign(b) == sign, b // 2, b // 2 + 1))
    _, rejected = selection.time_delegates(runs, "iree", inputs, bounds={0: [-5, 5]})
    assert rejected == {"openvino": "output 0 differs from iree's in 1 of 1 elements (integers must be equal) "
                                    "on the mirrored inputs"}


@pytest.fixture(scope="module")
def floor_division_program(tmp_path_factory):
    """A method whose second output is an int64 floor division, exported with the OpenVINO alternative, its integer
    input recorded as bounded to [-9, 9] (as onecopy.llm records a token id's bounds)."""
    pytest.importorskip("openvino")
    import msgspec

    from onecopy.export import CompileSpec, export_program
    from onecopy.program.file import ProgramFile

    class FloorDivision(torch.nn.Module):
        def forward(self, x, bucket):
            return x * 2 + 1, torch.div(bucket, 4, rounding_mode="floor")

    ep = torch.export.export(FloorDivision(), (torch.zeros(1, 64), torch.zeros(16, dtype=torch.int64)))
    program = export_program({"forward": ep}, compile_spec=CompileSpec(delegates=("iree", "openvino")))
    definition = program.definition
    bounded = [msgspec.structs.replace(m, input_bounds={1: [-9, 9]}) for m in definition.methods]
    path = tmp_path_factory.mktemp("floor") / "floor.onecopy"
    return ProgramFile(msgspec.structs.replace(definition, methods=bounded), program.data).save(path)


def test_latency_does_not_keep_openvino_where_its_integer_results_are_wrong(floor_division_program, tmp_path):
    with Runtime(cache_dir=tmp_path).load_program(floor_division_program, prefer="latency") as program:
        forward = program.load_method("forward")
        choice = forward.method_meta.choice
        bucket = np.array([-9, -7, -1, 0, 1, 5, 9, 3, -4, -5, 2, 8, -8, 4, 6, -3], np.int64)
        _, got = forward.execute([np.zeros((1, 64), np.float32), bucket])
    assert choice.backend == "IreeBackend" and [d.backend for d in forward.method_meta.delegates] == ["IreeBackend"]
    assert choice.note.startswith("OpenVinoBackend not kept: output 1 differs from IreeBackend's in ")
    assert choice.note.endswith("(integers must be equal)")
    np.testing.assert_array_equal(got, np.floor_divide(bucket, 4))
