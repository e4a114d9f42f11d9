"""A shared multifunction model whose functions run each on the executor measured fastest for it.

A shared model (backend option `share_multifunction_model`) serves every function of a module. Its functions need
not agree on an executor: a vision program's B=1 runs faster on the calling thread and its B=8 on IREE's task
workers (MobileNetV3-small here: B=1 2.6 vs 3.0 ms, B=8 19.1 vs 13.5 ms), and one executor for both would slow one
of them down by up to 1.4x. So a `ModelSet` holds the model loaded on the executor most of them chose and, the
first time a function that chose the other one is asked for, the same model on that executor
(`LoadedModel.on`): the same code and weights, mapped once, with VM contexts of its own.

A module holding state is never split: a State is VM contexts on one device, and every function that reads or
updates it must run in them (onecopy.delegate.state).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onecopy.delegate.engine import EngineFunction, LoadedModel

__all__ = ["ModelSet"]


class ModelSet:
    """`first` (the model on its executor) and, made when first needed, its twins on the executors `drivers`
    (function name -> HAL driver) names for some functions; the others run on `first`. Thread-safe."""

    def __init__(self, first: LoadedModel, drivers: Mapping[str, str]):
        self.first = first
        self.drivers = dict(drivers)
        self.load_state = first.load_state
        self._models: dict[str, LoadedModel] = {first.driver: first}
        self._lock = threading.Lock()

    def model_for(self, function: str) -> LoadedModel:
        driver = self.drivers.get(function, self.first.driver)
        with self._lock:
            model = self._models.get(driver)
            if model is None:
                if not self._models:
                    raise RuntimeError("the model set was closed")
                model = self._models[driver] = self.first.on(driver)
            return model

    def function(self, name: str, *, outputs_in_place: bool = False, result_dtypes: Sequence[str] = (),
                 where: str | None = None) -> EngineFunction:
        return self.model_for(name).function(name, outputs_in_place=outputs_in_place, result_dtypes=result_dtypes,
                                             where=where)

    @property
    def models(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._models.values())

    def close(self) -> None:
        """Close the twins, then `first`, which holds the cache entry their bytes come from."""
        with self._lock:
            models, self._models = self._models, {}
        for model in models.values():
            if model is not self.first:
                model.close()
        self.first.close()
