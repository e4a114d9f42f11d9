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
from onecopy.runtime import selection
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
    assert calls[:4] == ["iree", "openvino", "iree", "openvino"]  # the check, then a warm-up call each
    timed = calls[4:]
    rounds = len(timed) // 2
    assert elapsed >= 0.2 and selection.MIN_RUNS <= rounds <= 0.2 / 0.005 + 1  # the budget, in rounds of >= 5 ms
    assert timed[:4] == ["iree", "openvino", "openvino", "iree"]  # the order alternates round by round
