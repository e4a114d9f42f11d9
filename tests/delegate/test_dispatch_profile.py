"""Method.profile / onecopy.delegate.dispatch_profile: a method's engine function run under IREE's profiler, its
time read dispatch by dispatch."""

import json

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.delegate.dispatch_profile import summarize
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.export import CompileSpec, Partitioner, export_program

SECONDS = 0.2


def _events(calls: int, starts_us=(0.0, 60.0), durations_us=(50.0, 30.0), ready_lead_us=20.0) -> list[str]:
    """What `iree-profile queue` and `dispatch --dispatch_events` print for `calls` calls of `main`, each with two
    dispatches (ends 10 us apart from the next start), the call ready `ready_lead_us` before its first dispatch."""
    lines = [json.dumps({"type": "queue_summary"})]
    names = ["main$async_dispatch_0_matmul_1x64x64_f32", "_encoding_0_encode_1x64xf32_to_1x64xf32"]
    for call in range(calls):
        base = 1_000_000 * (call + 1)
        lines.append(json.dumps({"type": "queue_event", "op": "alloca", "submission_id": 2 * call,
                                 "host_time_ns": base - 50_000, "ready_host_time_ns": base - 50_000}))
        lines.append(json.dumps({"type": "queue_event", "op": "execute", "submission_id": 2 * call + 1,
                                 "host_time_ns": base - 30_000, "ready_host_time_ns": base - ready_lead_us * 1e3}))
        for name, start, duration in zip(names, starts_us, durations_us):
            begin = base + int(start * 1e3)
            lines.append(json.dumps({
                "type": "host_dispatch_event", "submission_id": 2 * call + 1, "key": name, "valid": True,
                "executable_id": 1, "function_ordinal": 0, "start_host_time_ns": begin,
                "end_host_time_ns": begin + int(duration * 1e3), "duration_ns": int(duration * 1e3)}))
    return lines


def test_summarize_reads_each_dispatch_the_gaps_and_the_wake():
    profile = summarize(_events(10), function="main", driver="local-task", workers=2, call_ms=0.5)
    assert profile.calls == 8  # the first fifth left out
    assert [r.name for r in profile.rows] == ["dispatch_0_matmul_1x64x64_f32",
                                              "_encoding_0_encode_1x64xf32_to_1x64xf32"]  # the slowest first
    assert [r.per_call for r in profile.rows] == [1.0, 1.0]
    assert profile.rows[0].ms_per_call == pytest.approx(0.05)
    assert profile.rows[0].share == pytest.approx(50 / 80)
    assert profile.dispatches == 2
    assert profile.dispatch_ms == pytest.approx(0.08)
    assert profile.span_ms == pytest.approx(0.09)
    assert profile.gaps_ms == pytest.approx(0.01)
    assert profile.gap_p90_us == pytest.approx(10.0)
    assert profile.wake_us == pytest.approx(20.0)
    assert profile.call_ms == pytest.approx(1.0)  # a call every millisecond, whatever the benchmark said
    text = "\n".join(profile.lines())
    assert "workers started 20 us after the call was ready" in text and "dispatch_0_matmul_1x64x64_f32" in text
    assert json.loads(json.dumps(profile.to_dict()))["rows"][1]["name"].startswith("_encoding_0")


def test_a_call_of_several_submissions_is_read_as_one_call():
    # 10 calls of 2 submissions each (the events of 20 one-submission calls, paired), 1 ms apart.
    profile = summarize(_events(20), function="main", driver="local-task", workers=2, call_ms=2.0, calls_run=10)
    assert profile.calls == 8 and profile.dispatches == 4
    assert [r.per_call for r in profile.rows] == [2.0, 2.0]
    assert profile.dispatch_ms == pytest.approx(0.16)
    assert profile.call_ms == pytest.approx(2.0)
    # Knowing nothing of the calls, each submission reads as one.
    assert summarize(_events(20), function="main", driver="local-task", workers=2, call_ms=2.0).calls == 16


def test_summarize_without_dispatches_is_an_error():
    with pytest.raises(DelegateError, match="no dispatch of 'main'"):
        summarize([json.dumps({"type": "queue_summary"})], function="main", driver="local-sync", workers=None,
                  call_ms=0.1)


@pytest.mark.parametrize("executor, driver", [("parallel", "local-task"), ("inline", "local-sync")])
def test_a_methods_profile_names_the_dispatches_its_layers_run(small_program_path, executor, driver):
    with Runtime().load_program(small_program_path,
                                backend_options={"IreeBackend": {"executor": executor}}) as program:
        method = program.load_method("forward")
        x = np.ones((1, 64), np.float32)
        before = method.execute([x])[0]
        profile = method.profile([x], seconds=SECONDS)
        np.testing.assert_array_equal(method.execute([x])[0], before)  # the method is untouched by it
    assert profile.function == "main" and profile.driver == driver  # one module per method: its function "main"
    assert (profile.workers is None) == (driver == "local-sync")
    assert profile.calls > 0
    # three Linear layers: three matmuls a call, whatever dispatches IREE formed them in
    assert sum(r.per_call for r in profile.rows if "matmul" in r.name) == 3
    assert sum(r.per_call for r in profile.rows) == profile.dispatches
    assert sum(r.share for r in profile.rows) == pytest.approx(1.0)
    assert 0 < profile.dispatch_ms <= profile.span_ms
    assert profile.span_ms == pytest.approx(profile.dispatch_ms + profile.gaps_ms, rel=1e-6)
    assert profile.call_ms >= profile.span_ms


def test_an_aot_program_and_its_packed_weights_profile(small_vmfb_program_path):
    with Runtime().load_program(small_vmfb_program_path) as program:
        profile = program.load_method("prefill").profile(seconds=SECONDS)  # example inputs of its shapes
    assert profile.function == "main"
    assert sum(r.per_call for r in profile.rows if "matmul" in r.name) == 3


@pytest.mark.parametrize("stateful_program", [("vmfb", True)], indirect=True)  # packed weights, one module
def test_a_stateful_method_profiles_from_zeroed_state(stateful_program):
    path, _, _ = stateful_program
    with Runtime().load_program(path) as program:
        decode = program.load_method("decode")
        state = program.create_state()
        decode.execute([np.ones((1, 16), np.float32), np.array([2])], state=state)
        kept = {name: state.read(name) for name in state.names()}
        profile = decode.profile(seconds=SECONDS)
        after = {name: state.read(name) for name in state.names()}
    assert profile.function.startswith("decode") and profile.calls > 0
    for name in kept:  # the profile ran in another process: no state of this one moved
        np.testing.assert_array_equal(after[name], kept[name])


def test_a_method_of_several_instructions_is_refused_with_the_way_out(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    methods = {"forward": torch.export.export(model, (torch.zeros(1, 4),))}
    path = export_program(methods, partitioner=Partitioner(skip_ops=("aten.relu.default",)),
                          compile_spec=CompileSpec(packaging="mlir")).save(tmp_path / "split.onecopy")
    with Runtime().load_program(path) as program, pytest.raises(InvalidArgument, match="one delegate call.*skip_ops"):
        program.load_method("forward").profile(seconds=SECONDS)


def test_bad_seconds_are_refused(small_program_path):
    with Runtime().load_program(small_program_path) as program, pytest.raises(InvalidArgument, match="positive"):
        program.load_method("forward").profile(seconds=0)


def test_a_destination_passing_method_with_dynamic_outputs_profiles_on_given_inputs(tmp_path):
    # Its outputs are arguments of the engine function: profile sizes them from the inputs (T = 5: 10 and 4 rows).
    class CatAndSlice(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x]) * 2, x[1:] + 1

    ep = torch.export.export(CatAndSlice(), (torch.zeros(4, 8),),
                             dynamic_shapes=({0: torch.export.Dim("T", min=3, max=64)},))
    path = export_program({"forward": ep}, memory_planned_outputs=False).save(tmp_path / "dynamic.onecopy")
    with Runtime().load_program(path) as program:
        forward = program.load_method("forward")
        profile = forward.profile([np.ones((5, 8), np.float32)], seconds=SECONDS)
        assert profile.calls > 0 and profile.dispatches > 0
        with pytest.raises(InvalidArgument, match="dynamic input shapes"):
            forward.profile(seconds=SECONDS)
