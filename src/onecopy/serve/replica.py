"""A onecopy program as a Ray Serve application: replicas that share one copy of the weights per node.

    from ray import serve
    from onecopy.serve import deployment
    handle = serve.run(deployment("model.onecopy", replicas=2))
    (y,) = handle.remote("forward", [x]).result()                 # numpy in, numpy out
    # HTTP: POST /forward (npz or JSON), GET / lists the methods (see onecopy.serve.codec)

Each replica loads the program with the shared specialization cache ($ONECOPY_CACHE_DIR or the user cache dir)
and, for a multifunction program, the shared loaded model: the first replica of a node specializes the program,
the others restore it, and all of them map the same weight pages (`benchmarks/serve.py` measures the PSS).

Stateful methods keep one State per session on a replica. The session id is the request's multiplexed model id:
`handle.options(multiplexed_model_id=SESSION).remote(method, inputs, new_session=True)` starts a session, later
calls leave `new_session` out; over HTTP, the headers `serve_multiplexed_model_id: SESSION` and
`onecopy-new-session: 1`. Ray routes a session's requests to the replica that holds it, but only as a preference:
a request that reaches a replica without its session (evicted beyond `max_sessions`, its replica replaced, or sent
elsewhere under load) fails with `SessionNotFound` (HTTP 409) and the client starts the session again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from onecopy.errors import InvalidArgument
from onecopy.serve.codec import (
    DEFAULT_MAX_REQUEST_BYTES,
    JSON,
    check_declared_length,
    decode_inputs,
    encode_json,
    encode_outputs,
    request_format,
    too_large,
)
from onecopy.serve.server import (
    NEW_SESSION_HEADER,
    ProgramServer,
    ServeConfig,
    error_body,
    http_status,
    plan,
)
from onecopy.serve.sessions import DEFAULT_MAX_SESSIONS

__all__ = ["deployment", "OnecopyReplica"]

log = logging.getLogger("onecopy")

# Ray Serve's default: enough requests in flight per replica to keep its engine busy while one is decoded.
_MAX_ONGOING_REQUESTS = 8


class OnecopyReplica:
    """One replica: a `ProgramServer` behind Ray Serve's handle and HTTP entry points."""

    def __init__(self, program_path: str, config: ServeConfig):
        self._server = ProgramServer(program_path, config)
        self._limit = config.max_request_bytes
        # One batch queue per batched method: requests of different methods never share a call.
        # (the methods the plan batches that this replica measured giving each request what it would alone)
        self._batchers = {name: self._batcher(name, config) for name in self._server.batched}
        self._register_session = None
        if self._server.sessions is not None:
            async def session_here(session_id: str) -> str:
                # Registers the id with Ray's router (it prefers this replica for it from now on) and evicts in
                # the same order as the store, which holds the State itself.
                return session_id

            self._register_session = serve.multiplexed(max_num_models_per_replica=config.max_sessions)(session_here)

    def _batcher(self, name: str, config: ServeConfig):
        server = self._server

        async def run(batch: list) -> list:
            return await asyncio.to_thread(server.execute_batch, name, batch)

        return serve.batch(max_batch_size=config.max_batch_size, batch_wait_timeout_s=config.batch_wait_timeout_s)(run)

    async def __call__(self, method: Any, inputs: Sequence[Any] | None = None, *, new_session: bool = False) -> Any:
        """`handle.remote(method, inputs)` -> the outputs (numpy); an HTTP request -> an HTTP response."""
        if isinstance(method, Request):
            return await self._http(method)
        if inputs is None:
            raise InvalidArgument(f"handle.remote({method!r}) needs the inputs too: handle.remote(method, [x, ...]).")
        return await self._run(method, inputs, new_session)

    def describe(self) -> dict[str, Any]:
        """`handle.describe.remote()`: what `GET /` answers (methods, their method_meta, this replica's pid and
        request counts)."""
        return self._server.describe()

    async def _run(self, name: str, inputs: Sequence[Any], new_session: bool) -> list:
        server = self._server
        server.method(name)  # an unknown method fails here, before anything is queued
        session = serve.get_multiplexed_model_id() or None
        if session and server.is_stateful(name):
            if self._register_session is not None:
                await self._register_session(session)
            return await asyncio.to_thread(server.execute, name, inputs, session=session, new_session=new_session)
        batcher = self._batchers.get(name)
        if batcher is not None:
            return (await batcher(list(inputs))).result()
        return await asyncio.to_thread(server.execute, name, inputs)

    async def _http(self, request: Request) -> Response:
        try:
            path = request.scope.get("path", "/")
            root = request.scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            name = path.strip("/")
            if request.method == "GET":
                described = self._server.describe()
                if name:
                    self._server.method(name)
                    described = described["methods"][name]
                return Response(encode_json(described), media_type=JSON)
            if request.method != "POST":
                return Response(encode_json({"error": f"{request.method} is not served; POST /<method> runs one, "
                                                      "GET / lists them.", "type": "RequestError"}),
                                status_code=405, media_type=JSON, headers={"allow": "GET, POST"})
            where = f"POST /{name}"
            meta = self._server.method(name).method_meta
            fmt = request_format(request.headers.get("content-type"), where)
            check_declared_length(request.headers.get("content-length"), self._limit, where)
            body = await self._read_body(request, where)
            inputs = decode_inputs(body, fmt, meta.inputs, where, limit=self._limit)
            new_session = request.headers.get(NEW_SESSION_HEADER, "").strip().lower() in ("1", "true", "yes")
            outputs = await self._run(name, inputs, new_session)
            return Response(encode_outputs(outputs, fmt), media_type=fmt)
        except Exception as e:
            status = http_status(e)
            if status >= 500:
                log.exception("serve: %s %s failed", request.method, request.url.path)
            return Response(error_body(e), status_code=status, media_type=JSON)

    async def _read_body(self, request: Request, where: str) -> bytes:
        """The body, read no further than the limit (a client may send more than its Content-Length said, or
        none at all)."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._limit:
                raise too_large(where, len(body), self._limit)
        return bytes(body)

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()


def deployment(
    program_path: str | os.PathLike[str],
    *,
    replicas: int = 1,
    methods: Sequence[str] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
    max_batch_size: int | None = None,
    batch_wait_timeout_s: float = 0.005,
    ray_actor_options: Mapping[str, Any] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_sessions: int = DEFAULT_MAX_SESSIONS,
    name: str = "onecopy",
) -> serve.Application:
    """A Ray Serve application serving `program_path`'s methods (all of them, or `methods`) from `replicas`
    replicas. Run it with `serve.run(app)`, which returns the handle.

    Args:
        program_path: a program file every node that runs a replica can read at this path.
        backend_options: given to `load_program` (the shared loaded model is turned on for multifunction programs).
        max_batch_size: join up to this many concurrent requests to a method into one call. Applies to methods
            whose inputs and outputs all have the same dynamic first dimension (a torch.export.Dim) and whose
            rows do not depend on each other (each replica checks it as it starts: random requests joined into
            one call and each alone); the others run request by request (logged, and said by `GET /`). Fails
            when no method has such shapes.
        batch_wait_timeout_s: how long a batch waits for more requests once it has one.
        ray_actor_options: each replica's Ray actor options (e.g. {"num_cpus": 1}).
        max_request_bytes: larger HTTP requests are refused with 413, before their body is read when they say
            their length.
        max_sessions: States kept per replica for stateful methods, least recently used evicted first.

    Raises:
        InvalidArgument: an argument is wrong for this program (unknown method, nothing to batch, bad number).
        ProgramFormatError: the file is not a onecopy program.
    """
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise InvalidArgument(f"onecopy.serve.deployment('{program_path}'): replicas must be an int >= 1, got {replicas!r}.")
    # Absolute: each replica opens the file from its own working directory.
    path = Path(program_path).resolve()
    config = plan(path, methods=methods, backend_options=backend_options, max_batch_size=max_batch_size,
                  batch_wait_timeout_s=batch_wait_timeout_s, max_request_bytes=max_request_bytes,
                  max_sessions=max_sessions)
    ongoing = max(_MAX_ONGOING_REQUESTS, 2 * (max_batch_size or 0))  # room for a batch to fill while one runs
    options: dict[str, Any] = {"name": name, "num_replicas": replicas, "max_ongoing_requests": ongoing}
    if ray_actor_options is not None:
        options["ray_actor_options"] = dict(ray_actor_options)
    return serve.deployment(OnecopyReplica, **options).bind(str(path), config)
