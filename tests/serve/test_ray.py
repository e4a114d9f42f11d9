"""onecopy.serve on a real local Ray: two replicas, the handle, HTTP (npz and JSON), batching, bad requests, and
replicas killed while loading and after starting. One Ray + Serve instance for the whole module."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed; pip install 'onecopy[serve]' to run these")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed; pip install 'onecopy[serve]' to run these")

from onecopy.runtime import Runtime  # noqa: E402
from onecopy.serve import deployment  # noqa: E402

pytestmark = [
    # Ray leaves sockets of its own to the collector at shutdown: not ours to fix.
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

LIMIT = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def handle(base_url, tiny_program_path):
    app = deployment(tiny_program_path, replicas=2, max_batch_size=8, batch_wait_timeout_s=0.05,
                     max_request_bytes=LIMIT, ray_actor_options={"num_cpus": 0.5})
    return serve.run(app, name="tiny", route_prefix="/")


@pytest.fixture(scope="module")
def local(tiny_program_path):
    """The same program in this process: what each request must equal."""
    with Runtime().load_program(tiny_program_path) as program:
        yield {name: program.load_method(name) for name in program.method_names}


def http(url: str, body: bytes | None = None, content_type: str = "application/json", method: str | None = None,
         headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers.get("content-type"), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read()


def npz(*arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, *arrays)
    return buffer.getvalue()


def test_the_handle_runs_every_method(handle, local, rng):
    x = rng.standard_normal((5, 16), dtype=np.float32)
    (y,) = handle.remote("forward", [x]).result()
    np.testing.assert_array_equal(y, local["forward"].execute([x])[0])
    (y1,) = handle.remote("single", [x[:1]]).result()
    np.testing.assert_array_equal(y1, local["single"].execute([x[:1]])[0])


def test_http_answers_npz_with_npz_and_json_with_json(handle, base_url, local, rng):
    x = rng.standard_normal((3, 16), dtype=np.float32)
    expected = local["forward"].execute([x])[0]
    status, ctype, body = http(f"{base_url}/forward", npz(x), "application/x-npz")
    assert (status, ctype) == (200, "application/x-npz")
    with np.load(io.BytesIO(body)) as answer:
        np.testing.assert_array_equal(answer["arr_0"], expected)
    status, ctype, body = http(f"{base_url}/forward", json.dumps({"inputs": [x.tolist()]}).encode())
    assert (status, ctype) == (200, "application/json")
    answer = json.loads(body)
    assert answer["dtypes"] == ["float32"] and answer["shapes"] == [[3, 8]]
    np.testing.assert_allclose(np.array(answer["outputs"][0], np.float32), expected, rtol=1e-6)
    status, _, body = http(f"{base_url}/")
    listing = json.loads(body)
    assert status == 200 and set(listing["methods"]) == {"forward", "single"}
    assert listing["methods"]["forward"]["batched"] is True
    assert "static (1)" in listing["methods"]["single"]["not_batched_because"]


def test_concurrent_requests_are_batched_and_each_gets_its_unbatched_result(handle, local, rng):
    xs = [rng.standard_normal((1 + i % 3, 16), dtype=np.float32) for i in range(24)]
    responses = [handle.remote("forward", [x]) for x in xs]  # all in flight at once
    for x, response in zip(xs, responses):
        np.testing.assert_array_equal(response.result()[0], local["forward"].execute([x])[0])
    # Both replicas answer GET /; between them, fewer engine calls than requests means requests were joined.
    # Ray routes an idle handle's calls by its own preference (one replica can get 40 in a row): ask several at
    # once, so that queue-length routing spreads them, until each replica has answered.
    counts = {}
    for _ in range(20):
        for described in [r.result() for r in [handle.describe.remote() for _ in range(8)]]:
            counts[described["replica"]["pid"]] = described["methods"]["forward"]
        if len(counts) == 2:
            break
    assert len(counts) == 2, "the describe calls reached one replica only"
    requests = sum(c["requests"] for c in counts.values())
    calls = sum(c["calls"] for c in counts.values())
    assert requests >= 24 and calls < requests


@pytest.mark.parametrize("path, body, ctype, status, message", [
    ("/nope", b'{"inputs": [[1]]}', "application/json", 404, "'tiny.onecopy' serves no method 'nope'; it serves forward, single"),
    ("/single", b'{"inputs": [[[1, 2]]]}', "application/json", 422, "Input 0 of method 'single' has shape [1, 2]; expected [1, 16]"),
    ("/single", npz(np.zeros((1, 16), np.float64)), "application/x-npz", 422, "Input 0 of method 'single' has dtype float64; expected float32"),
    ("/forward", b'{"inputs": [[1, 2]', "application/json", 400, "POST /forward: the body is not JSON"),
    ("/forward", b"PK\x03\x04junk", "application/x-npz", 400, "POST /forward: the body is not a readable npz"),
    ("/forward", b"x", "text/csv", 400, "content type 'text/csv' is not served"),
    ("/forward", npz(np.zeros((1100, 16), np.float32)), "application/x-npz", 413, f"over this deployment's limit of {LIMIT}"),
    ("/forward", json.dumps({"inputs": [[[1e39] + [0.0] * 15]]}).encode(), "application/json", 400,
     "POST /forward: input 0 holds 1e+39 at [0, 0], outside float32's range [-3.4028235e+38, 3.4028235e+38]"),
])
def test_bad_requests_get_a_4xx_with_the_onecopy_sentence(handle, base_url, path, body, ctype, status, message):
    got, got_type, answer = http(base_url + path, body, ctype)
    assert (got, got_type) == (status, "application/json"), answer
    error = json.loads(answer)["error"]
    assert message in error and "Traceback" not in error


def test_json_answers_write_nan_and_infinities_as_strings(handle, base_url, local):
    x = np.zeros((2, 16), np.float32)
    x[0, 0] = np.nan
    expected = local["forward"].execute([x])[0]
    assert np.isnan(expected[0]).all() and np.isfinite(expected[1]).all()
    rows = [["NaN"] + [0.0] * 15, [0.0] * 16]
    status, _, body = http(f"{base_url}/forward", json.dumps({"inputs": [rows]}).encode())
    assert status == 200, body
    (got,) = json.loads(body)["outputs"]
    assert got[0] == ["NaN"] * 8
    np.testing.assert_allclose(np.array(got[1], np.float32), expected[1], rtol=1e-6)


@pytest.fixture(scope="module")
def mixing(base_url, mixing_program_path):
    """`center` (rows mix) and `scale` with max_batch_size, on one replica, under /mix."""
    app = deployment(mixing_program_path, replicas=1, max_batch_size=8, batch_wait_timeout_s=0.05,
                     ray_actor_options={"num_cpus": 0.5}, name="mix")
    return serve.run(app, name="mix", route_prefix="/mix")


def test_a_method_whose_rows_mix_is_not_batched_and_each_request_gets_its_own_answer(mixing, base_url, rng):
    status, _, body = http(f"{base_url}/mix/")
    methods = json.loads(body)["methods"]
    assert status == 200 and methods["scale"]["batched"] is True
    assert methods["center"]["batched"] is False
    assert "rows depend on each other" in methods["center"]["not_batched_because"]
    xs = [rng.standard_normal((1 + i % 3, 3), dtype=np.float32) for i in range(12)]
    responses = [mixing.remote("center", [x]) for x in xs]  # all in flight at once
    for x, response in zip(xs, responses):
        np.testing.assert_allclose(response.result()[0], x - x.mean(0, keepdims=True), rtol=1e-5, atol=1e-6)
    counts = mixing.describe.remote().result()["methods"]["center"]
    assert counts["requests"] == counts["calls"] == 12


def test_the_handle_raises_the_onecopy_error(handle, rng):
    from onecopy.errors import ExecutionError, InvalidArgument

    with pytest.raises(InvalidArgument, match=r"serves no method 'nope'"):
        handle.remote("nope", [np.zeros((1, 16), np.float32)]).result()
    with pytest.raises(ExecutionError, match=r"has dtype float64; expected float32"):
        handle.remote("forward", [np.zeros((2, 16), np.float64)]).result()


def replica_pids(app: str) -> set[int]:
    """Live replica processes of an application, by the title Ray gives them (ray::ServeReplica:<app>:...)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"ServeReplica:{app}:".encode() in cmdline:
            found.add(int(entry.name))
    return found


def test_a_replica_killed_while_loading_or_after_starting_is_replaced_and_serves(handle, tiny_program_path, tmp_path, rng):
    # A cache of its own: the first replica specializes the program (seconds), so it is killed while loading.
    app = deployment(tiny_program_path, replicas=1, ray_actor_options={"num_cpus": 0.5},
                     backend_options={"IreeBackend": {"cache_dir": str(tmp_path / "cache")}})
    started: dict[str, object] = {}
    runner = threading.Thread(target=lambda: started.setdefault("handle", serve.run(app, name="phoenix",
                                                                                    route_prefix="/phoenix")))
    runner.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and time.monotonic() < deadline:
        for pid in replica_pids("phoenix"):
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.05)
    assert killed is not None, "no replica of 'phoenix' appeared within 60 s"
    entries = list((tmp_path / "cache").glob("v1/entries/*/entry.json"))
    assert not entries, "the replica had finished loading before it was killed"
    runner.join(timeout=120)
    phoenix = started["handle"]
    x = rng.standard_normal((2, 16), dtype=np.float32)
    expected = phoenix.remote("forward", [x]).result()[0]
    (second,) = replica_pids("phoenix")
    assert second != killed
    os.kill(second, signal.SIGKILL)  # now one that had started and served
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            (y,) = phoenix.remote("forward", [x]).result(timeout_s=10)
        except Exception:
            time.sleep(0.5)
            continue
        np.testing.assert_array_equal(y, expected)
        break
    else:
        pytest.fail("no replica of 'phoenix' served within 90 s of the kill")
    assert replica_pids("phoenix") - {killed, second}
    serve.delete("phoenix")


@pytest.fixture(scope="module")
def stateful(base_url, tmp_path_factory):
    """The Accumulator's prefill + decode (three states) on one replica, under /acc."""
    from onecopy.export import Partitioner, export_program
    from tests.conftest import accumulator_methods

    path = export_program(accumulator_methods(), partitioner=Partitioner(multifunction=True)).save(
        tmp_path_factory.mktemp("serve") / "accumulator.onecopy")
    app = deployment(path, replicas=1, max_sessions=4, ray_actor_options={"num_cpus": 0.5}, name="acc")
    return serve.run(app, name="acc", route_prefix="/acc"), path


def test_sessions_over_the_handle_and_http_keep_their_state_in_the_replica(stateful, base_url, rng):
    handle, path = stateful
    prompt = rng.standard_normal((2, 16), dtype=np.float32)
    step = rng.standard_normal((1, 16), dtype=np.float32)
    with Runtime().load_program(path) as program:
        alone = program.create_state()
        expected = [program.load_method("prefill").execute([prompt, np.array([0, 1])], state=alone),
                    program.load_method("decode").execute([step, np.array([2])], state=alone)]
    session = handle.options(multiplexed_model_id="chat-1")
    first = session.remote("prefill", [prompt, np.array([0, 1])], new_session=True).result()
    body = json.dumps({"inputs": [step.tolist(), [2]]}).encode()
    status, _, answer = http(f"{base_url}/acc/decode", body,
                             headers={"serve_multiplexed_model_id": "chat-1"})
    assert status == 200, answer
    second = [np.asarray(o) for o in json.loads(answer)["outputs"]]
    for got, want in zip([first, second], expected):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
        assert int(np.asarray(got[1])) == int(want[1])
    status, _, answer = http(f"{base_url}/acc/decode", body, headers={"serve_multiplexed_model_id": "nobody"})
    assert status == 409 and b"Session 'nobody' is not on this replica" in answer
