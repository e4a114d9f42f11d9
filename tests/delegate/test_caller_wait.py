"""The calling thread waits for IREE's workers as SCHED_BATCH, for the call only, and is left as it was."""

import logging
import os
import threading

import numpy as np
import pytest

import onecopy.delegate.caller_wait as caller_wait
from onecopy import Runtime
from onecopy.delegate.caller_wait import BatchWaitContext

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")


class Recording:
    """Stands for a VM context: records the calling thread's policy while `invoke` runs."""

    def __init__(self, fail: bool = False):
        self.seen: list[int] = []
        self.fail = fail
        self.other = "kept"

    def invoke(self, function, arguments, results):
        self.seen.append(os.sched_getscheduler(0))
        if self.fail:
            raise RuntimeError("engine failure")


@pytest.fixture
def switching(monkeypatch):
    monkeypatch.setattr(caller_wait, "_enabled", True)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    yield
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_the_caller_waits_as_batch_for_the_call_only(switching):
    context = Recording()
    wrapped = BatchWaitContext(context)
    wrapped.invoke(None, None, None)
    assert context.seen == [os.SCHED_BATCH]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert wrapped.other == "kept"  # everything but invoke is the context's own


def test_the_policy_comes_back_when_the_engine_fails(switching):
    context = Recording(fail=True)
    with pytest.raises(RuntimeError, match="engine failure"):
        BatchWaitContext(context).invoke(None, None, None)
    assert context.seen == [os.SCHED_BATCH]


def test_a_thread_with_a_policy_of_its_own_is_left_alone(switching):
    context, policies = Recording(), []

    def thread():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # the user's choice for this thread
        BatchWaitContext(context).invoke(None, None, None)
        policies.append(os.sched_getscheduler(0))

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    assert context.seen == [os.SCHED_BATCH] and policies == [os.SCHED_BATCH]  # batch before, during and after
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # and only that thread's policy was ever touched


def test_a_system_that_refuses_the_switch_turns_it_off_once(switching, monkeypatch, caplog):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(caller_wait.os, "sched_setscheduler", refuse)
    context = Recording()
    with caplog.at_level(logging.INFO, logger="onecopy"):
        BatchWaitContext(context).invoke(None, None, None)
        BatchWaitContext(context).invoke(None, None, None)
    assert context.seen == [os.SCHED_OTHER, os.SCHED_OTHER]  # the calls ran, the policy untouched
    assert not caller_wait.enabled()
    assert sum("keep the caller's scheduling policy" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("executor, wrapped", [("parallel", True), ("inline", False)])
def test_only_calls_on_the_workers_switch_the_caller(small_program_path, small_model, rng, executor, wrapped):
    from tests.conftest import eager

    x = rng.standard_normal((1, 64), dtype=np.float32)
    with Runtime().load_program(small_program_path, backend_options={"IreeBackend": {"executor": executor}}) as program:
        forward = program.load_method("forward")
        (delegate,) = forward._delegates.values()
        context = delegate.model.checkout()
        delegate.model.checkin(context)
        assert isinstance(context, BatchWaitContext) is (wrapped and caller_wait.enabled())
        np.testing.assert_allclose(forward.execute([x])[0], eager(small_model, x)[0], rtol=1e-4, atol=1e-5)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
