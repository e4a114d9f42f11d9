"""How the calling thread waits while its call runs on IREE's task workers: as SCHED_BATCH, for the call only.

Why. A call on the workers (`local-task`) parks the calling thread in IREE's semaphore wait. The worker that
finishes the call wakes the caller and only then marks the wait done; the caller, once awake, spins until that
mark (a pause loop in IREE 3.13's semaphore wait: 80% of the caller's perf samples). On a machine with few cores the woken caller is put on the
waker's core and preempts it, and then spins on the one core where the waker could make the mark, until the
scheduler's tick moves one of them. Measured on 2 vCPUs (built-in model, prefill B=16 on 2 workers): the caller
used 35-40% of a core during its calls, 80% of it in that spin, and one call in five took 2-3x the median.

A SCHED_BATCH thread never preempts on wakeup (the fair scheduler leaves batch tasks to the tick), so the waker
finishes its bookkeeping, then the caller runs: mean 3.0 -> 1.8 ms, p90 5-6 -> 1.9 ms, the caller's CPU 0.35 ->
0.07 of a core, in one process, interleaved. Moving a thread between SCHED_OTHER and SCHED_BATCH needs no
privilege and keeps its nice value (SCHED_IDLE, which would also do, cannot be undone without privilege). The
two switches cost ~3.3 us a call here (kernel work; the policy is read first, 0.2 us).

Concurrent callers gain too: two threads calling prefill in a loop on one shared model made 504 calls/s against
359 (one process, interleaved windows); switching only a call with no other in flight gave 367, so every call on
the workers switches its own caller.

What it touches: the calling thread's policy, switched only while a call runs on the workers and only from
SCHED_OTHER (a thread the user gave another policy is left alone), restored whatever happens. The calling thread
(`local-sync`) runs its calls itself and is never switched. `ONECOPY_CALLER_WAIT=normal` turns it off (for
comparisons); where the system refuses the switch (a seccomp filter, not Linux) it is off, logged once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["BatchWaitContext", "enabled"]

log = logging.getLogger("onecopy")

_BATCH = getattr(os, "SCHED_BATCH", None)
_OTHER = getattr(os, "SCHED_OTHER", None)
_PARAM = os.sched_param(0) if hasattr(os, "sched_param") else None
_enabled = _BATCH is not None and os.environ.get("ONECOPY_CALLER_WAIT", "batch") != "normal"


def enabled() -> bool:
    """Whether calls on the workers switch their calling thread (on this system, in this process)."""
    return _enabled


def _enter() -> bool:
    """Switch the calling thread to SCHED_BATCH if it is in SCHED_OTHER; whether it was switched."""
    global _enabled
    try:
        if os.sched_getscheduler(0) != _OTHER:
            return False
        os.sched_setscheduler(0, _BATCH, _PARAM)
        return True
    except OSError as e:  # refused here: keep the default policy from now on
        _enabled = False
        log.info("calls on IREE's workers keep the caller's scheduling policy: switching it failed (%s)", e)
        return False


def _leave() -> None:
    try:
        os.sched_setscheduler(0, _OTHER, _PARAM)
    except OSError as e:  # not expected: SCHED_BATCH -> SCHED_OTHER needs no privilege
        log.warning("could not restore the calling thread's scheduling policy after a call: %s", e)


class BatchWaitContext:
    """A VM context whose `invoke` runs with the calling thread in SCHED_BATCH (see the module docstring);
    everything else is the wrapped context's."""

    __slots__ = ("context",)

    def __init__(self, context: Any):
        self.context = context

    def invoke(self, function: Any, arguments: Any, results: Any) -> None:
        switched = _enabled and _enter()
        try:
            self.context.invoke(function, arguments, results)
        finally:
            if switched:
                _leave()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)
