"""What one replica does, without Ray: load a program once, run its methods for calls and HTTP requests, keep a
State per session for stateful methods, and turn every error into an answer a client can act on.

`replica.py` wraps a `ProgramServer` in a Ray Serve deployment; tests drive one directly.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.errors import (
    ExecutionError,
    InvalidArgument,
    OnecopyError,
    RequestError,
    RequestTooLarge,
    SessionNotFound,
)
from onecopy.delegate.manifest import BACKEND as IREE_BACKEND, parse_manifest
from onecopy.runtime import Runtime
from onecopy.runtime.agreement import TOLERANCES
from onecopy.runtime.method_meta import MethodMeta, TensorMeta
from onecopy.serve.batching import (
    Group,
    batch_dim_range,
    batch_refusal,
    group_requests,
    joined_call_differs,
    split_outputs,
)
from onecopy.serve.codec import DEFAULT_MAX_REQUEST_BYTES, encode_json
from onecopy.serve.sessions import DEFAULT_MAX_SESSIONS, SessionStore

__all__ = ["ServeConfig", "plan", "ProgramServer", "Outcome", "MethodNotFound", "http_status",
           "error_body", "uses_state"]

log = logging.getLogger("onecopy")

NEW_SESSION_HEADER = "onecopy-new-session"
# Ray Serve's own header: its router sends requests with one id to the replica that registered it (best effort).
SESSION_HEADER = "serve_multiplexed_model_id"


class MethodNotFound(InvalidArgument):
    """(HTTP 404) a request named a method the deployment does not serve."""


@dataclass(frozen=True)
class ServeConfig:
    """How a deployment serves its program (see `onecopy.serve.deployment`)."""

    methods: tuple[str, ...] | None = None
    backend_options: Mapping[str, Mapping[str, Any]] | None = None
    max_batch_size: int | None = None
    batch_wait_timeout_s: float = 0.005
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_sessions: int = DEFAULT_MAX_SESSIONS
    # Decided by `plan` from the program's method_meta: the methods batched, and why each other one is not. Each
    # replica then measures whether the batched ones give each request what it would alone
    # (`ProgramServer.batched`); those that do not run request by request there too.
    batched: tuple[str, ...] = ()
    not_batched: Mapping[str, str] = field(default_factory=dict)


def uses_state(meta: MethodMeta) -> bool:
    """Whether a method reads and updates program State (a KV cache kept in the engine)."""
    return meta.stateful


def backend_options_for(program: Any, given: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The caller's backend options, with the shared loaded model on for a multifunction program: all replicas
    of a node (and all delegates of a replica) then use one loaded module and one mapping of the weights."""
    options = {name: dict(values) for name, values in (given or {}).items()}
    multifunction = any(
        d.backend == IREE_BACKEND and parse_manifest(d.manifest, f"Program '{program.source}', delegate {i}").multifunction
        for i, d in enumerate(program.definition.delegates)
    )
    if multifunction:
        options.setdefault("IreeBackend", {}).setdefault("share_multifunction_model", True)
    return options


def describe_method(meta: MethodMeta, *, batched: bool, why_not: str | None, stateful: bool) -> dict[str, Any]:
    def tensor(t: TensorMeta) -> dict[str, Any]:
        return {"shape": list(t.shape), "dtype": str(t.dtype)}

    described = {
        "inputs": [tensor(t) for t in meta.inputs],
        "outputs": [tensor(t) for t in meta.outputs],
        "instructions": list(meta.instructions),
        "delegates": [{"function": d.function, "packaging": d.packaging} for d in meta.delegates],
        "stateful": stateful,
        "batched": batched,
    }
    if why_not is not None:
        described["not_batched_because"] = why_not
    return described


def plan(program_path: str | os.PathLike[str], *, methods: Sequence[str] | None = None,
         backend_options: Mapping[str, Mapping[str, Any]] | None = None, max_batch_size: int | None = None,
         batch_wait_timeout_s: float = 0.005, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
         max_sessions: int = DEFAULT_MAX_SESSIONS) -> ServeConfig:
    """Check a deployment's arguments against the program and decide which methods are batched. Reads the
    program's definition only (no delegate is loaded), so that a wrong argument fails where the deployment is
    created, not in every replica."""
    where = f"onecopy.serve.deployment('{program_path}')"
    for option, value, low in (("max_batch_size", max_batch_size, 1), ("max_request_bytes", max_request_bytes, 1),
                               ("max_sessions", max_sessions, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise InvalidArgument(f"{where}: {option} must be an int >= {low}, got {value!r}.")
    if not isinstance(batch_wait_timeout_s, (int, float)) or batch_wait_timeout_s < 0:
        raise InvalidArgument(f"{where}: batch_wait_timeout_s must be a number >= 0, got {batch_wait_timeout_s!r}.")
    if isinstance(methods, str):
        raise InvalidArgument(f"{where}: methods is a list of names, e.g. methods=['{methods}'].")
    with Runtime().load_program(program_path) as program:
        names = tuple(methods) if methods is not None else tuple(program.method_names)
        if not names:
            raise InvalidArgument(f"{where}: methods=[] serves nothing; leave it None to serve every method.")
        batched: list[str] = []
        not_batched: dict[str, str] = {}
        for name in names:
            meta = program.method_meta(name)  # an unknown name raises, naming the methods there are
            if max_batch_size is None:
                continue
            why = ("it uses State (a session's calls run in order, each on its own State)" if uses_state(meta)
                   else batch_refusal(meta))
            if why is None:
                batched.append(name)
            else:
                not_batched[name] = why
    if max_batch_size is not None and not batched:
        raise InvalidArgument(
            f"{where}: max_batch_size={max_batch_size} would batch no method: "
            + "; ".join(f"'{n}': {why}" for n, why in not_batched.items())
            + ". Export a method with a dynamic first dimension (torch.export.Dim) or leave max_batch_size None."
        )
    for name, why in not_batched.items():
        log.warning("serve: method '%s' of %s is not batched: %s", name, program_path, why)
    return ServeConfig(tuple(names), backend_options, max_batch_size, float(batch_wait_timeout_s),
                       max_request_bytes, max_sessions, tuple(batched), not_batched)


class Outcome:
    """A result or the error it raised: one per request of a batch, so a bad request fails alone."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value = value
        self.error = error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class ProgramServer:
    """A loaded program serving its methods. `execute` and `execute_batch` may be called from several threads."""

    def __init__(self, program_path: str | os.PathLike[str], config: ServeConfig, *, runtime: Runtime | None = None):
        self.config = config
        self.path = Path(program_path)
        runtime = runtime or Runtime()  # the shared specialization cache: $ONECOPY_CACHE_DIR or the user's
        with runtime.load_program(self.path) as probe:
            options = backend_options_for(probe, config.backend_options)
        self.program = runtime.load_program(self.path, backend_options=options)
        try:
            names = config.methods if config.methods is not None else tuple(self.program.method_names)
            self.methods = {name: self.program.load_method(name) for name in names}
            self._stateful = {name: uses_state(m.method_meta) for name, m in self.methods.items()}
            self._ranges = {
                name: batch_dim_range(self.methods[name].method_meta, self._symbols(name)) for name in config.batched
            }
            # The methods this replica batches: those of the plan whose requests, joined into one call, each got
            # what they got alone (measured now; the shapes cannot say whether a method's rows mix).
            self.not_batched: dict[str, str] = dict(config.not_batched)
            tolerance = TOLERANCES.get(getattr(self.program, "precision", "fp32"), max(TOLERANCES.values()))
            bounds = {m.name: m.input_bounds for m in self.program.definition.methods}
            for name in config.batched:
                method = self.methods[name]
                why = joined_call_differs(method.execute, method.method_meta, self._symbols(name), self._ranges[name],
                                          tolerance=tolerance, bounds=bounds.get(name))
                if why is not None:
                    self.not_batched[name] = why
                    log.warning("serve: method '%s' of %s is not batched: %s; each request runs alone",
                                name, self.path, why)
            self.batched: tuple[str, ...] = tuple(n for n in config.batched if n not in self.not_batched)
            self.sessions: SessionStore | None = None
            if any(self._stateful.values()):
                self.sessions = SessionStore(self.program.create_state, config.max_sessions,
                                             where=f"this replica of '{self.path.name}'")
        except BaseException:
            self.program.close()
            raise
        # Requests answered and engine calls made per method (GET / shows them: batching joins requests).
        self._counts = {name: [0, 0] for name in self.methods}
        self._counts_lock = threading.Lock()

    def _count(self, name: str, requests: int, calls: int) -> None:
        with self._counts_lock:
            counts = self._counts[name]
            counts[0] += requests
            counts[1] += calls

    def _symbols(self, name: str) -> Mapping[str, Sequence[int | None]]:
        definition = next(m for m in self.program.definition.methods if m.name == name)
        return definition.symbols

    def close(self) -> None:
        self.program.close()

    def is_stateful(self, name: str) -> bool:
        return self._stateful[self.method(name).name]

    def method(self, name: str):
        try:
            return self.methods[name]
        except (KeyError, TypeError):
            raise MethodNotFound(
                f"'{self.path.name}' serves no method {name!r}; it serves {', '.join(self.methods)} (GET / lists them)."
            ) from None

    def describe(self) -> dict[str, Any]:
        return {
            "program": self.path.name,
            "replica": {"pid": os.getpid()},
            "max_request_bytes": self.config.max_request_bytes,
            "methods": {
                name: describe_method(m.method_meta, batched=name in self.batched, why_not=self.not_batched.get(name),
                                      stateful=self._stateful[name])
                | {"requests": self._counts[name][0], "calls": self._counts[name][1]}
                for name, m in self.methods.items()
            },
        }

    def execute(self, name: str, inputs: Sequence[Any], *, session: str | None = None,
                new_session: bool = False) -> list[np.ndarray]:
        """Run one request. A stateful method runs on the session's State; other methods ignore `session`."""
        method = self.method(name)
        self._count(name, 1, 1)
        if not self._stateful[name]:
            return method.execute(inputs)
        if not session:
            raise InvalidArgument(
                f"Method '{name}' of '{self.path.name}' uses State: call it with a session id, "
                "handle.options(multiplexed_model_id=SESSION).remote(...) or the HTTP header "
                f"{SESSION_HEADER}: SESSION, and new_session=True on the session's first call."
            )
        assert self.sessions is not None
        with self.sessions.use(session, new=new_session) as state:
            return method.execute(inputs, state=state)

    def execute_batch(self, name: str, batch: Sequence[Sequence[Any]]) -> list[Outcome]:
        """Run requests of one batched method as few calls as their shapes allow; each gets what it would alone.
        A method this replica does not batch (`batched`) runs each request alone."""
        method = self.method(name)
        outcomes: list[Outcome] = [Outcome() for _ in batch]
        self._count(name, len(batch), 0)
        if name in self.batched:
            groups = group_requests(batch, self._ranges[name])
        else:
            groups = [_alone(index) for index in range(len(batch))]
        for group in groups:
            if len(group.members) > 1:
                try:
                    self._count(name, 0, 1)
                    joined = method.execute(group.inputs(batch))
                except OnecopyError:
                    pass  # one of them is wrong: run each alone, so that only it fails
                else:
                    for member, outputs in zip(group.members, split_outputs(joined, group.rows)):
                        outcomes[member].value = outputs
                    continue
            for member in group.members:
                self._count(name, 0, 1)
                try:
                    outcomes[member].value = method.execute(batch[member])
                except Exception as e:
                    outcomes[member].error = e
        return outcomes


def _alone(index: int) -> Group:
    group = Group()
    group.members.append(index)
    group.rows.append(0)
    return group


def http_status(error: BaseException) -> int:
    """The HTTP status of an error: 4xx for anything the request did wrong, 500 for the replica's own faults."""
    if isinstance(error, MethodNotFound):
        return 404
    if isinstance(error, RequestTooLarge):
        return 413
    if isinstance(error, SessionNotFound):
        return 409
    if isinstance(error, ExecutionError):
        return 422  # a well-formed request with inputs the method cannot take (shape, dtype, count)
    if isinstance(error, (RequestError, InvalidArgument)):
        return 400
    return 500


def error_body(error: BaseException) -> bytes:
    """The error's one sentence, as JSON; never a traceback (that goes to the replica's log)."""
    if isinstance(error, OnecopyError):
        message = str(error)
    else:
        message = f"The replica failed on this request ({type(error).__name__}: {error}); see the replica's log."
    return encode_json({"error": message, "type": type(error).__name__})
