"""ModelSet: a shared model's functions each on their executor; the twin made once, when first needed, and closed
before the model holding the cache entry. Engine-free fakes here; tests/delegate/test_executors.py runs real ones."""

import threading

import pytest

from onecopy.delegate.model_set import ModelSet


class FakeModel:
    def __init__(self, driver: str, closed: list, made: list):
        self.driver, self.closed, self.made = driver, closed, made
        self.load_state = "specialized"

    def on(self, driver: str) -> "FakeModel":
        twin = FakeModel(driver, self.closed, self.made)
        self.made.append(twin)
        return twin

    def function(self, name: str, *, outputs_in_place: bool = False, result_dtypes=(), where=None):
        return (self, name, outputs_in_place, tuple(result_dtypes))

    def close(self) -> None:
        self.closed.append(self)


@pytest.fixture
def models():
    closed, made = [], []
    first = FakeModel("local-task", closed, made)
    return ModelSet(first, {"b1": "local-sync", "b8": "local-task"}), first, closed, made


def test_each_function_runs_on_the_model_of_its_executor(models):
    models_set, first, _, made = models
    assert models_set.function("b8") == (first, "b8", False, ())
    assert made == []  # nothing asked for the other executor yet: no second model
    model, name, in_place, dtypes = models_set.function("b1", outputs_in_place=True, result_dtypes=["uint8"])
    assert model.driver == "local-sync" and (name, in_place, dtypes) == ("b1", True, ("uint8",)) and made == [model]
    assert models_set.model_for("other") is first  # a function with no choice of its own runs on the first
    assert models_set.load_state == "specialized"


def test_the_twin_is_made_once_under_concurrent_requests(models):
    models_set, _, _, made = models
    barrier = threading.Barrier(8)
    got = []

    def ask():
        barrier.wait()
        got.append(models_set.model_for("b1"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(m is made[0] for m in got)


def test_close_closes_the_twins_before_the_model_holding_the_cache_entry(models):
    models_set, first, closed, made = models
    models_set.model_for("b1")
    models_set.close()
    assert closed == [made[0], first]
    with pytest.raises(RuntimeError, match="closed"):
        models_set.model_for("b8")
