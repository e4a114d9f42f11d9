"""The serve pieces that need no Ray: codec, session store, batching plan, errors as HTTP statuses."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from onecopy.errors import ExecutionError, InvalidArgument, RequestError, RequestTooLarge, SessionNotFound
from onecopy.runtime.method_meta import MethodMeta, TensorMeta
from onecopy.serve.batching import batch_refusal, group_requests, joined_call_differs, split_outputs
from onecopy.serve.codec import JSON, NPZ, check_declared_length, decode_inputs, encode_outputs, request_format
from onecopy.serve.server import MethodNotFound, ProgramServer, error_body, http_status, plan
from onecopy.serve.sessions import SessionStore

F32 = np.dtype(np.float32)


def meta(*inputs, outputs=None) -> MethodMeta:
    tensors = lambda shapes, dtype=F32: tuple(TensorMeta(tuple(s), dtype, True) for s in shapes)  # noqa: E731
    return MethodMeta("m", tensors(inputs), tensors(outputs or inputs), (), ())


def npz(*arrays, **named) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, *arrays, **named)
    return buffer.getvalue()


# codec

def test_npz_inputs_come_in_input_order_past_ten():
    arrays = [np.full((1,), i, np.float32) for i in range(12)]
    decoded = decode_inputs(npz(*arrays), NPZ, meta(*[[1]] * 12).inputs, "POST /m", limit=1 << 20)
    assert [int(a[0]) for a in decoded] == list(range(12))


def test_npz_members_named_as_the_method_inputs_go_by_name():
    named = (TensorMeta((1,), F32, True, "ids"), TensorMeta((1,), F32, True, "mask"))
    one, two = np.ones(1, np.float32), np.full(1, 2, np.float32)
    decoded = decode_inputs(npz(mask=two, ids=one), NPZ, named, "POST /m", limit=1 << 20)  # archive order: mask, ids
    assert [float(a[0]) for a in decoded] == [1.0, 2.0]
    decoded = decode_inputs(npz(b=two, a=one), NPZ, named, "POST /m", limit=1 << 20)  # other names: archive order
    assert [float(a[0]) for a in decoded] == [2.0, 1.0]


def test_json_inputs_take_the_method_dtype_and_refuse_fractions_for_integers():
    m = meta(["b", 2])
    (x,) = decode_inputs(b'{"inputs": [[[1, 2], [3, 4.5]]]}', JSON, m.inputs, "POST /m", limit=1 << 20)
    assert x.dtype == np.float32 and x.tolist() == [[1, 2], [3, 4.5]]
    ints = (TensorMeta(("b",), np.dtype(np.int64), True),)
    with pytest.raises(RequestError, match=r"POST /m: input 0 holds fractional numbers; the method takes int64"):
        decode_inputs(b'{"inputs": [[1.5]]}', JSON, ints, "POST /m", limit=1 << 20)


def ints(dtype, shape=("b",)):
    return (TensorMeta(shape, np.dtype(dtype), True),)


@pytest.mark.parametrize("dtype, body, message", [
    (np.uint8, b'[300, -1]', r"holds 300 at \[0\], outside uint8's range \[0, 255\]"),
    (np.uint8, b'[1, -1]', r"holds -1 at \[1\], outside uint8's range \[0, 255\]"),
    (np.int32, b'[[1, 2], [2147483648, 0]]',
     r"holds 2147483648 at \[1, 0\], outside int32's range \[-2147483648, 2147483647\]"),
    (np.int32, b'[-2147483649]', r"holds -2147483649 at \[0\], outside int32's range"),
    # 2**63 alone (numpy: uint64), beside an int64 (numpy: float64, which read as "fractional" before), below int64
    (np.int64, b'[9223372036854775808]', r"holds 9223372036854775808 at \[0\], outside int64's range "
                                          r"\[-9223372036854775808, 9223372036854775807\]"),
    (np.int64, b'[1, 9223372036854775808]', r"holds 9223372036854775808 at \[1\], outside int64's range"),
    (np.int64, b'[-9223372036854775809]', r"holds -9223372036854775809 at \[0\], outside int64's range"),
    (np.uint64, b'[1, 18446744073709551616]', r"holds 18446744073709551616 at \[1\], outside uint64's range"),
    (np.float16, b'[100000.0, 1]', r"holds 100000.0 at \[0\], outside float16's range \[-65504, 65504\]: it "
                                   r"would become inf"),
    (np.float16, b'[1, -70000]', r"holds -70000 at \[1\], outside float16's range"),
    (np.float32, b'[1e39]', r"holds 1e\+39 at \[0\], outside float32's range"),
    (np.float32, b'[1' + b'0' * 400 + b']', r"holds 100000000000\.\.\. \(401 digits\) at \[0\], outside float32's"),
    (np.float64, b'[1e400]', r"holds a number beyond float64's range"),
])
def test_json_values_outside_the_input_dtype_are_refused_never_wrapped(dtype, body, message):
    with pytest.raises(RequestError, match=r"^POST /m: input 0 " + message):
        decode_inputs(b'{"inputs": [' + body + b']}', JSON, ints(dtype), "POST /m", limit=1 << 20)


def test_json_values_at_the_edges_of_the_input_dtype_are_taken_exactly():
    def one(dtype, body):
        (x,) = decode_inputs(b'{"inputs": [' + body + b']}', JSON, ints(dtype), "POST /m", limit=1 << 20)
        assert x.dtype == dtype
        return x.tolist()

    assert one(np.uint8, b"[255, 0]") == [255, 0]
    assert one(np.int32, b"[2147483647, -2147483648]") == [2147483647, -2147483648]
    assert one(np.int64, b"[9223372036854775807, -9223372036854775808]") == [2**63 - 1, -(2**63)]
    assert one(np.uint64, b"[18446744073709551615, 1]") == [2**64 - 1, 1]
    assert one(np.float16, b"[65504, -65504.0]") == [65504.0, -65504.0]
    assert one(np.int8, b"[true, 3]") == [1, 3]
    with pytest.raises(RequestError, match=r"input 0 holds fractional numbers; the method takes int64"):
        one(np.int64, b"[2.0, 9223372036854775808]")


def test_json_carries_nan_and_infinities_as_strings_both_ways():
    y = np.array([np.nan, np.inf, -np.inf, 1.5, -0.0], np.float32)
    body = encode_outputs([y, np.array(np.nan), np.array([1, 2])], JSON)
    assert body == (b'{"outputs":[["NaN","Infinity","-Infinity",1.5,-0.0],"NaN",[1,2]],'
                    b'"dtypes":["float32","float64","int64"],"shapes":[[5],[],[2]]}')
    (x,) = decode_inputs(b'{"inputs": [["NaN", "Infinity", "-Infinity", 1.5, -0.0]]}', JSON, ints(np.float32),
                         "POST /m", limit=1 << 20)
    np.testing.assert_array_equal(x, y)
    assert x.dtype == np.float32 and np.signbit(x[4])
    for bad, dtype in ((b'["nan"]', np.float32), (b'["NaN"]', np.int32), (b"[null, 1]", np.float32)):
        with pytest.raises(RequestError, match=r"input 0 holds (<U\d+|object) values; expected numbers for"):
            decode_inputs(b'{"inputs": [' + bad + b']}', JSON, ints(dtype), "POST /m", limit=1 << 20)


@pytest.mark.parametrize("body, message", [
    (b"not json", r"POST /m: the body is not JSON"),
    (b'{"input": []}', r"POST /m: the JSON body is not \{\"inputs\": \[...\]\}"),
    (b'{"inputs": [[[1, 2], [3]]]}', r"POST /m: input 0 is not a rectangular nested list"),
    (b'{"inputs": [["a"]]}', r"POST /m: input 0 holds <U1 values; expected numbers for float32"),
    (b'{"inputs": []}', r"POST /m: the request holds 0 inputs; the method takes 1"),
])
def test_bad_json_bodies_say_what_is_wrong(body, message):
    with pytest.raises(RequestError, match=message):
        decode_inputs(body, JSON, meta(["b", 2]).inputs, "POST /m", limit=1 << 20)


def test_npz_that_is_not_npz_or_holds_objects_is_refused():
    with pytest.raises(RequestError, match=r"not a readable npz of plain arrays"):
        decode_inputs(b"PK\x03\x04garbage", NPZ, meta([1]).inputs, "POST /m", limit=1 << 20)
    with pytest.raises(RequestError, match=r"not a readable npz of plain arrays"):
        decode_inputs(npz(np.array([{"a": 1}], dtype=object)), NPZ, meta([1]).inputs, "POST /m", limit=1 << 20)


def test_an_npz_member_that_is_not_an_array_is_a_bad_request():
    """np.load returns a member that is not a whole .npy file as bytes; the method refused it as dtype |S5 (a
    422 advising a cast) instead of the body being called what it is."""
    import zipfile

    for name, data in (("a.txt", b"hello"), ("arr_0.npy", b"junk")):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr(name, data)
        with pytest.raises(RequestError, match=rf"POST /m: the npz member '{name.removesuffix('.npy')}' is not a "
                                               r"\.npy array"):
            decode_inputs(buffer.getvalue(), NPZ, meta([1]).inputs, "POST /m", limit=1 << 20)


def test_json_nested_past_what_can_be_read_is_a_bad_request_not_a_replica_fault():
    """Lists nested thousands deep made msgspec raise RecursionError: a 500 "the replica failed"."""
    deep = b'{"inputs": [' + b"[" * 5000 + b"1" + b"]" * 5000 + b"]}"
    with pytest.raises(RequestError, match=r"POST /m: the JSON nests deeper than it can be read") as caught:
        decode_inputs(deep, JSON, meta([1]).inputs, "POST /m", limit=1 << 20)
    assert http_status(caught.value) == 400


def test_requests_over_the_limit_are_refused_declared_sent_or_unpacked():
    with pytest.raises(RequestTooLarge, match=r"POST /m: the request holds 2000 bytes, over this deployment's limit of 1000"):
        check_declared_length("2000", 1000, "POST /m")
    with pytest.raises(RequestTooLarge):
        decode_inputs(b"x" * 1001, JSON, meta([1]).inputs, "POST /m", limit=1000)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, np.zeros(100_000, np.float32))  # ~1 KB that unpacks to 400 KB
    with pytest.raises(RequestTooLarge):
        decode_inputs(buffer.getvalue(), NPZ, meta([100_000]).inputs, "POST /m", limit=100_000)


def test_content_types():
    assert request_format("application/x-npz", "w") == NPZ
    assert request_format("application/json; charset=utf-8", "w") == JSON
    with pytest.raises(RequestError, match=r"content type 'text/csv' is not served; send application/x-npz"):
        request_format("text/csv", "POST /m")


def test_answers_come_back_in_the_request_format():
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    with np.load(io.BytesIO(encode_outputs([y], NPZ))) as back:
        np.testing.assert_array_equal(back["arr_0"], y)
    assert encode_outputs([y], JSON) == b'{"outputs":[[[0.0,1.0,2.0],[3.0,4.0,5.0]]],"dtypes":["float32"],"shapes":[[2,3]]}'


# sessions

class FakeState:
    made = 0

    def __init__(self) -> None:
        FakeState.made += 1
        self.steps = 0


def test_a_session_keeps_its_state_and_an_unknown_one_is_not_made_silently():
    store = SessionStore(FakeState, max_sessions=2)
    with store.use("a", new=True) as state:
        state.steps += 1
    with store.use("a") as state:
        assert state.steps == 1
    with pytest.raises(SessionNotFound, match=r"Session 'b' is not on this replica \(pid \d+\): it was never started "
                                              r"here.*Start it again with new_session=True"):
        with store.use("b"):
            pass


def test_least_recently_used_sessions_are_evicted_and_say_so():
    store = SessionStore(FakeState, max_sessions=2)
    for sid in ("a", "b"):
        with store.use(sid, new=True):
            pass
    with store.use("a"):
        pass  # b is now the least recently used
    with store.use("c", new=True):
        pass
    assert store.session_ids == ["a", "c"]
    with pytest.raises(SessionNotFound, match=r"Session 'b' .*it was evicted: this replica keeps the 2 most recently "
                                              r"used sessions \(deploy with a larger max_sessions"):
        with store.use("b"):
            pass
    with store.use("b", new=True) as state:  # started again: a fresh State
        assert state.steps == 0


def test_a_session_in_use_is_not_evicted_until_its_call_returns():
    store = SessionStore(FakeState, max_sessions=1)
    with store.use("a", new=True):
        with store.use("b", new=True):
            assert set(store.session_ids) == {"a", "b"}  # over the bound while both are in use
        assert store.session_ids == ["a"]  # b's call returned: b went, a is still in use
    assert len(store) == 1


def test_calls_of_one_session_run_one_at_a_time():
    store = SessionStore(FakeState, max_sessions=4)
    with store.use("a", new=True):
        pass
    inside, most = [0], [0]
    lock = threading.Lock()

    def call():
        for _ in range(50):
            with store.use("a") as state:
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                state.steps += 1
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.use("a") as state:
        assert state.steps == 200 and most[0] == 1


def test_session_store_arguments():
    with pytest.raises(InvalidArgument, match=r"max_sessions must be an int >= 1, got 0"):
        SessionStore(FakeState, max_sessions=0)
    with pytest.raises(InvalidArgument, match=r"A session id is a non-empty str, got ''"):
        with SessionStore(FakeState).use("", new=True):
            pass


# batching

def test_only_methods_with_one_dynamic_first_dimension_everywhere_are_batched():
    assert batch_refusal(meta(["b", 16], outputs=[["b", 8]])) is None
    assert "first input's first dimension is static (1)" in batch_refusal(meta([1, 16]))
    assert "not every input and output" in batch_refusal(meta(["b", 16], outputs=[[1, 8]]))
    assert "beyond the first dimension" in batch_refusal(meta(["b", "b"]))


def test_requests_are_grouped_by_signature_within_the_range_and_split_back():
    rows = lambda n, dt=np.float32, w=4: [np.full((n, w), n, dt)]  # noqa: E731
    batch = [rows(1), rows(2), rows(3, np.float64), rows(70), rows(2, w=5), rows(1)]
    groups = group_requests(batch, (1, 64))
    assert sorted(g.members for g in groups) == [[0, 1, 5], [2], [3], [4]]
    joined = next(g for g in groups if len(g.members) == 3)
    (x,) = joined.inputs(batch)
    assert x.shape == (4, 4)
    parts = split_outputs([x * 2], joined.rows)
    assert [p[0].shape[0] for p in parts] == [1, 2, 1] and parts[1][0][0, 0] == 4
    assert sum(len(g.members) for g in group_requests([rows(40), rows(40)], (1, 64))) == 2
    assert len(group_requests([rows(40), rows(40)], (1, 64))) == 2  # 80 rows would be over the range


def test_the_joined_call_check_tells_rows_that_mix_from_rows_alone():
    m = meta(["b", 3], outputs=[["b", 3]])
    calls = []

    def run(f):
        def call(inputs):
            calls.append(inputs[0].shape[0])
            return [f(inputs[0])]
        return call

    assert joined_call_differs(run(lambda x: x * 2), m, {"b": [1, 64]}, (1, 64)) is None
    assert calls == [3, 1, 2]  # the joined call, then each request alone: three calls in all
    why = joined_call_differs(run(lambda x: x - x.mean(0, keepdims=True)), m, {"b": [1, 64]}, (1, 64))
    assert why.startswith("its rows depend on each other: two requests of 1 and 2 random rows joined into one call "
                          "did not each get what it gets alone (request 0's output 0: ")
    assert joined_call_differs(run(lambda x: np.cumsum(x, 0)), m, {"b": [1, 64]}, (1, 64)) is not None
    assert joined_call_differs(run(lambda x: x * x.shape[0]), m, {"b": [2, 64]}, (2, 64)) is not None
    # rounding of another batch size is not a difference; an integer one is
    assert joined_call_differs(run(lambda x: x * (1 + 1e-6 * x.shape[0])), m, {"b": [1, 64]}, (1, 64)) is None
    im = MethodMeta("m", (TensorMeta(("b", "t"), np.dtype(np.int64), True),),
                    (TensorMeta(("b",), np.dtype(np.int64), True),), (), ())
    assert joined_call_differs(run(lambda x: x.sum(1)), im, {"b": [1, 8], "t": [1, None]}, (1, 8)) is None
    assert "differs from the lone call's in 1 of 1 elements" in joined_call_differs(run(lambda x: x.sum(1) + x.shape[0]), im,
                                                          {"b": [1, 8], "t": [1, None]}, (1, 8))

    def fails(inputs):
        raise ValueError("index 1 is out of bounds")

    assert joined_call_differs(fails, m, {"b": [1, 64]}, (1, 64)) == (
        "its check of joined requests (1 and 2 rows, random values) failed: ValueError: index 1 is out of bounds")
    calls.clear()
    assert joined_call_differs(run(lambda x: x - x.mean(0)), m, {"b": [2, 3]}, (2, 3)) is None  # never joined
    assert calls == []


def test_errors_map_to_client_statuses_with_the_sentence_and_no_traceback():
    assert http_status(MethodNotFound("x")) == 404
    assert http_status(RequestTooLarge("x")) == 413
    assert http_status(SessionNotFound("x")) == 409
    assert http_status(ExecutionError("x")) == 422
    assert http_status(RequestError("x")) == 400
    assert http_status(RuntimeError("x")) == 500
    assert error_body(ExecutionError("Input 0 has dtype float64")) == b'{"error":"Input 0 has dtype float64","type":"ExecutionError"}'


# a replica without Ray, on a real program

def test_plan_refuses_what_cannot_be_served(tiny_program_path):
    with pytest.raises(InvalidArgument, match=r"has no method 'nope'; it has forward, single"):
        plan(tiny_program_path, methods=["nope"])
    with pytest.raises(InvalidArgument, match=r"max_batch_size=4 would batch no method: 'single': its first input's "
                                              r"first dimension is static \(1\).*torch.export.Dim"):
        plan(tiny_program_path, methods=["single"], max_batch_size=4)
    with pytest.raises(InvalidArgument, match=r"max_request_bytes must be an int >= 1, got 0"):
        plan(tiny_program_path, max_request_bytes=0)
    config = plan(tiny_program_path, max_batch_size=4)
    assert config.batched == ("forward",) and "static" in config.not_batched["single"]


def test_a_batch_answers_each_request_as_it_would_alone(tiny_program_path, tiny_model, rng):
    import torch

    server = ProgramServer(tiny_program_path, plan(tiny_program_path, max_batch_size=8))
    try:
        assert server.batched == ("forward",)  # its rows are its own: the replica's check keeps it batched
        xs = [rng.standard_normal((n, 16), dtype=np.float32) for n in (1, 3, 2)]
        alone = [server.execute("forward", [x])[0] for x in xs]
        batch = [[x] for x in xs] + [[xs[0].astype(np.float64)]]
        outcomes = server.execute_batch("forward", batch)
        for outcome, expected in zip(outcomes, alone):
            np.testing.assert_array_equal(outcome.result()[0], expected)
        with pytest.raises(ExecutionError, match=r"Input 0 of method 'forward' has dtype float64; expected float32"):
            outcomes[3].result()
        with torch.no_grad():
            np.testing.assert_allclose(alone[1], tiny_model(torch.from_numpy(xs[1])).numpy(), rtol=1e-5, atol=1e-6)
        with pytest.raises(MethodNotFound, match=r"'tiny.onecopy' serves no method 'nope'; it serves forward, single"):
            server.execute("nope", [xs[0]])
        assert server.sessions is None  # no stateful method: no store
    finally:
        server.close()


def test_a_method_whose_rows_mix_is_served_unbatched_and_each_request_gets_its_own_answer(
        mixing_program_path, rng, caplog):
    config = plan(mixing_program_path, max_batch_size=8)
    assert config.batched == ("center", "scale")  # the shapes allow both
    with caplog.at_level("WARNING", logger="onecopy"):
        server = ProgramServer(mixing_program_path, config)
    try:
        assert server.batched == ("scale",)
        warnings = [r.getMessage() for r in caplog.records if "is not batched" in r.getMessage()]
        assert len(warnings) == 1 and "method 'center'" in warnings[0] and "rows depend on each other" in warnings[0]
        described = server.describe()["methods"]
        assert described["center"]["batched"] is False
        assert "rows depend on each other" in described["center"]["not_batched_because"]
        assert described["scale"]["batched"] is True and "not_batched_because" not in described["scale"]
        xs = [rng.standard_normal((n, 3), dtype=np.float32) for n in (2, 1, 3)]
        for name in ("center", "scale"):
            alone = [server.execute(name, [x])[0] for x in xs]
            for outcome, expected in zip(server.execute_batch(name, [[x] for x in xs]), alone):
                np.testing.assert_array_equal(outcome.result()[0], expected)
        np.testing.assert_allclose(server.execute("center", [xs[0]])[0], xs[0] - xs[0].mean(0, keepdims=True),
                                   rtol=1e-5, atol=1e-6)
        counts = server.describe()["methods"]
        assert (counts["center"]["requests"], counts["center"]["calls"]) == (7, 7)  # every request alone
        assert (counts["scale"]["requests"], counts["scale"]["calls"]) == (6, 4)  # the batch of 3: one call
    finally:
        server.close()


def test_a_stateful_method_runs_on_its_session_state(tiny_program_path, monkeypatch, rng):
    """The wiring for State, with a fake in place of the engine's (program.create_state, execute(state=))."""
    from onecopy.runtime import Program
    from onecopy.serve import server as server_module

    monkeypatch.setattr(server_module, "uses_state", lambda meta: meta.name == "forward")
    monkeypatch.setattr(Program, "create_state", lambda self: FakeState(), raising=False)
    server = ProgramServer(tiny_program_path, plan(tiny_program_path, max_sessions=1))

    class Counting:
        method_meta = server.methods["forward"].method_meta
        name = "forward"

        def execute(self, inputs, state):
            state.steps += 1
            return [np.array(state.steps)]

    try:
        server.methods["forward"] = Counting()
        x = rng.standard_normal((1, 16), dtype=np.float32)
        with pytest.raises(InvalidArgument, match=r"Method 'forward' of 'tiny.onecopy' uses State: call it with a "
                                                  r"session id, handle.options\(multiplexed_model_id=SESSION\)"):
            server.execute("forward", [x])
        assert server.execute("forward", [x], session="s", new_session=True)[0] == 1
        assert server.execute("forward", [x], session="s")[0] == 2
        server.execute("forward", [x], session="t", new_session=True)  # evicts s (max_sessions=1)
        with pytest.raises(SessionNotFound, match=r"Session 's' is not on this replica of 'tiny.onecopy'.*evicted"):
            server.execute("forward", [x], session="s")
        assert server.execute("single", [x], session="s")[0].shape == (1, 8)  # stateless: the session is ignored
    finally:
        server.close()


@pytest.fixture(scope="module")
def stateful_path(tmp_path_factory):
    from onecopy.export import Partitioner, export_program
    from tests.conftest import accumulator_methods

    return export_program(accumulator_methods(), partitioner=Partitioner(multifunction=True)).save(
        tmp_path_factory.mktemp("serve") / "accumulator.onecopy")


def test_sessions_keep_their_own_engine_state_across_prefill_and_decode(stateful_path, rng):
    """Two sessions interleaved on one replica give what each gives on a State of its own, called alone."""
    from onecopy import Runtime

    server = ProgramServer(stateful_path, plan(stateful_path, max_sessions=2))
    prompts = {s: rng.standard_normal((2, 16), dtype=np.float32) for s in "ab"}
    steps = {s: rng.standard_normal((1, 16), dtype=np.float32) for s in "ab"}
    try:
        assert server.is_stateful("prefill") and server.is_stateful("decode")
        got = {s: [server.execute("prefill", [prompts[s], np.array([0, 1])], session=s, new_session=True)]
               for s in "ab"}
        for s in "ab":
            got[s].append(server.execute("decode", [steps[s], np.array([2])], session=s))
        server.execute("decode", [steps["a"], np.array([3])], session="c", new_session=True)  # evicts a (LRU)
        with pytest.raises(SessionNotFound, match=r"Session 'a' is not on this replica"):
            server.execute("decode", [steps["a"], np.array([3])], session="a")
    finally:
        server.close()
    with Runtime().load_program(stateful_path) as program:
        prefill, decode = program.load_method("prefill"), program.load_method("decode")
        for s in "ab":
            alone = program.create_state()
            expected = [prefill.execute([prompts[s], np.array([0, 1])], state=alone),
                        decode.execute([steps[s], np.array([2])], state=alone)]
            for step, (mine, theirs) in enumerate(zip(got[s], expected)):
                for a, b in zip(mine, theirs):
                    np.testing.assert_array_equal(a, b, err_msg=f"session {s}, step {step}")
            assert int(got[s][1][1]) == 2  # the session's own step counter: prefill, then decode


def test_the_serve_command_checks_the_program_before_starting_ray(tmp_path, capsys):
    from onecopy.cli import build_parser, main

    args = build_parser().parse_args(["serve", "m.onecopy", "--replicas", "2", "--port", "8123"])
    assert (args.replicas, args.port, args.host) == (2, 8123, "127.0.0.1")
    assert main(["serve", str(tmp_path / "missing.onecopy")]) == 2
    assert "onecopy serve: error:" in capsys.readouterr().err


def test_deployment_stays_a_function_after_its_module_is_imported():
    pytest.importorskip("ray", reason="Ray Serve is not installed; pip install 'onecopy[serve]' to run this")
    import onecopy.serve
    import onecopy.serve.replica  # noqa: F401

    assert callable(onecopy.serve.deployment)
