"""Per-session State on a replica: one State per session id, at most `max_sessions`, least recently used first out.

Ray Serve does not promise that the requests of one session reach the same replica. The deployment asks Ray to
route them there (the session id is the request's multiplexed model id, which Ray's router prefers to send to the
replica that registered it), and this store makes every other case an error instead of a wrong answer: a request
for a session this replica does not hold (evicted by the bound, its replica replaced, or routed to another replica
under load) raises `SessionNotFound` unless it starts the session. It never runs on a fresh State silently, which
would answer as if the conversation so far had not happened.

One State is used by one call at a time (the engine's rule): calls of one session wait for each other; calls of
different sessions run side by side. Nothing here needs Ray.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from onecopy.errors import InvalidArgument, SessionNotFound

__all__ = ["SessionStore", "DEFAULT_MAX_SESSIONS"]

DEFAULT_MAX_SESSIONS = 64
# Evicted ids remembered per live session, so that an error can say "evicted" rather than "unknown".
_FORGOTTEN_PER_SESSION = 4


class _Session:
    __slots__ = ("state", "lock", "users")

    def __init__(self, state: Any):
        self.state = state
        self.lock = threading.Lock()
        self.users = 0  # calls holding or waiting for this session: never evicted while > 0


class SessionStore:
    """Session id -> State, bounded. `create_state()` makes a State (the program's `create_state`)."""

    def __init__(self, create_state: Callable[[], Any], max_sessions: int = DEFAULT_MAX_SESSIONS, *,
                 where: str = "this replica"):
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 1:
            raise InvalidArgument(f"max_sessions must be an int >= 1, got {max_sessions!r}.")
        self._create_state = create_state
        self.max_sessions = max_sessions
        self._where = where
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    @property
    def session_ids(self) -> list[str]:
        """Least recently used first."""
        with self._lock:
            return list(self._sessions)

    @contextmanager
    def use(self, session_id: str, *, new: bool = False) -> Iterator[Any]:
        """The session's State, held for one call. `new`: start the session (again: its State starts over)."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidArgument(f"A session id is a non-empty str, got {session_id!r}.")
        session = self._acquire(session_id, new)
        try:
            with session.lock:
                yield session.state
        finally:
            with self._lock:
                session.users -= 1
                self._evict_over_bound()

    def drop(self, session_id: str) -> bool:
        """End a session now (its State is released when its last call returns). False if it was not here."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        return session is not None

    def _acquire(self, session_id: str, new: bool) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and not new:
                self._sessions.move_to_end(session_id)
                session.users += 1
                return session
            if not new:
                raise self._not_found(session_id)
        # Made outside the store's lock: a State allocates its cache (megabytes), other sessions need not wait.
        state = self._create_state()
        with self._lock:
            session = _Session(state)
            session.users = 1
            self._sessions[session_id] = session  # a restart replaces the old State; its calls keep theirs
            self._sessions.move_to_end(session_id)
            self._evicted.pop(session_id, None)
            self._evict_over_bound()
            return session

    def _evict_over_bound(self) -> None:
        """Drop least recently used sessions no call is using, until the bound holds (sessions all in use may
        exceed it for as long as their calls run)."""
        excess = len(self._sessions) - self.max_sessions
        if excess <= 0:
            return
        for session_id in [k for k, s in self._sessions.items() if s.users == 0][:excess]:
            del self._sessions[session_id]
            self._evicted[session_id] = None
        while len(self._evicted) > _FORGOTTEN_PER_SESSION * self.max_sessions:
            self._evicted.popitem(last=False)

    def _not_found(self, session_id: str) -> SessionNotFound:
        if session_id in self._evicted:
            why = (f"it was evicted: {self._where} keeps the {self.max_sessions} most recently used sessions "
                   "(deploy with a larger max_sessions to keep more)")
        else:
            why = ("it was never started here: its replica may have been replaced, or Ray routed this request to "
                   "another replica")
        return SessionNotFound(
            f"Session '{session_id}' is not on {self._where} (pid {os.getpid()}): {why}. Start it again with "
            "new_session=True (HTTP header onecopy-new-session: 1) and replay its inputs."
        )
