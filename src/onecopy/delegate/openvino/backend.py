"""OpenVinoBackend: runs a method whole with OpenVINO, its weights read in place from the program file.

The IR's constants point into a copy-on-write `np.memmap` of the program file (`ir.place_constants`): OpenVINO
needs a writeable buffer, and copy-on-write pages stay the page cache's until written, so reading the model adds
no memory. `compile_model` then packs its own copy of the weights for its kernels (as IREE's data tiling does);
`onecopy inspect` reports what a load added. Compiled models are cached in `<onecopy cache dir>/openvino`
(OpenVINO's `CACHE_DIR`), so a second process compiles from there.

Inference runs in fp32 (`INFERENCE_PRECISION_HINT: f32`): OpenVINO's default on bf16-capable CPUs is bf16, which
changes answers by ~1e-2. `load_program(..., precision="bf16")` asks for it, as does the backend option
`inference_precision="bf16"` (which, when given, decides).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from onecopy.delegate.cache_key import cache_disabled, default_cache_dir
from onecopy.delegate.openvino.ir import place_constants
from onecopy.delegate.openvino.manifest import BACKEND, missing_named_data, parse_manifest
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.runtime.backend import Backend, DelegateHandle, DelegateSummary
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.init_context import InitContext

__all__ = ["OpenVinoBackend", "OpenVinoDelegate", "import_openvino", "PRECISIONS"]

log = logging.getLogger("onecopy")

PRECISIONS = {"f32": "f32", "bf16": "bf16"}
_core_lock = threading.Lock()
_core: Any = None


def import_openvino(where: str) -> Any:
    try:
        import openvino
    except ImportError as e:
        raise DelegateError(f"{where}: the OpenVINO delegate needs the openvino package; install it with "
                            "`pip install 'onecopy[openvino]'`, or load with prefer=\"memory\".") from e
    return openvino


def _shared_core(ov: Any) -> Any:
    global _core
    with _core_lock:
        if _core is None:
            _core = ov.Core()
        return _core


class _Requests:
    """The compiled model's infer requests: one per call in flight, made when a call finds none free and kept for
    the next (each holds its own intermediate tensors, so calls from several threads run side by side; a single
    caller makes one). Closing drops the model and the weights it reads once the last call in flight returns."""

    def __init__(self, compiled: Any, weights: np.ndarray) -> None:
        self._compiled: Any = compiled
        self._weights: np.ndarray | None = weights  # the model reads its constants from here: mapped while it lives
        self._free: list[Any] = []
        self._busy = 0
        self._closed = False
        self._lock = threading.Lock()
        self.made = 0

    @contextlib.contextmanager
    def request(self) -> Iterator[Any]:
        with self._lock:
            if self._closed:
                raise InvalidArgument("The OpenVINO delegate was destroyed (its program is closed); load it again.")
            if self._free:
                request = self._free.pop()
            else:
                request = self._compiled.create_infer_request()
                self.made += 1
            self._busy += 1
        try:
            yield request
        finally:
            with self._lock:
                self._busy -= 1
                if not self._closed:
                    self._free.append(request)
                elif self._busy == 0:
                    self._release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            if self._busy == 0:
                self._release()

    def _release(self) -> None:
        self._compiled = None
        self._weights = None


class OpenVinoDelegate(DelegateHandle):
    function = "openvino"

    def __init__(self, compiled: Any, weights: np.ndarray, outputs: int) -> None:
        self._requests = _Requests(compiled, weights)
        self._outputs = outputs

    @property
    def runs_on(self) -> str:
        return "OpenVINO CPU"

    def execute(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None], stats: CopyStats
                ) -> list[np.ndarray]:
        arrays = []
        for a in inputs:
            a = np.asarray(a)
            if not a.flags.c_contiguous:  # OpenVINO shares C-contiguous inputs; others are copied
                a = np.ascontiguousarray(a)
                stats.copied_in += a.nbytes
            arrays.append(a)
        with self._requests.request() as request:
            results = request.infer(arrays, share_inputs=True, share_outputs=False)  # outputs: copies of its own
            produced = [results[i] for i in range(self._outputs)]
        out = []
        for value, given in zip(produced, outputs):
            if given is not None:
                np.copyto(given, value)
                value = given
            stats.copied_out += value.nbytes
            out.append(value)
        return out

    def destroy(self) -> None:
        self._requests.close()


def _compile_lock(cache: Path, export_hash: str) -> Any:
    """A file lock held around `compile_model` with OpenVINO's CACHE_DIR, one per model (its export hash):
    OpenVINO writes its cache blob in place and maps it to import it, so processes (or threads) that loaded one
    program at once read a blob another was still writing: SIGBUS in 2 of 30 processes started together, and
    wrong answers seen once. Under the lock the first compiles and writes the blob whole; the others import it.
    The specialization cache's own per-key file lock (`KeyLocks`), in the OpenVINO cache's locks/ folder."""
    from onecopy.delegate.cache_lock import KeyLocks

    locks = cache / "locks"
    locks.mkdir(exist_ok=True)
    return KeyLocks(locks).across_processes(export_hash[:32])


class OpenVinoBackend(Backend):
    name: ClassVar[str] = BACKEND
    options: ClassVar[Mapping[str, type]] = {"inference_precision": str, "num_threads": int}

    def engine_version(self) -> str:
        return f"openvino {import_openvino('The OpenVINO backend').__version__}"

    def describe(self, manifest: Mapping[str, Any], where: str) -> DelegateSummary:
        return DelegateSummary(export_hash=parse_manifest(manifest, where).export_hash)

    def verify_manifest(self, manifest, named_data, where):
        try:
            parsed = parse_manifest(manifest, where)
        except DelegateError as e:
            return [str(e)]
        return [f"{where}: {text}" for text in missing_named_data(parsed, named_data)]

    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> OpenVinoDelegate:
        where = f"{context.where} (OpenVINO)"
        parsed = parse_manifest(manifest, where)
        missing = missing_named_data(parsed, set(context.named_data))
        if missing:
            raise DelegateError(f"{where}: {missing[0]}. Re-export the program.")
        # load_program(precision="bf16") asks every delegate for bf16 compute; the backend option, when given, decides.
        precision = context.backend_options.get("inference_precision", "bf16" if context.precision == "bf16" else "f32")
        if precision not in PRECISIONS:
            raise InvalidArgument(f"backend_options['{BACKEND}']['inference_precision'] is '{precision}'; expected "
                                  f"one of {', '.join(PRECISIONS)}.")
        ov = import_openvino(where)
        started = time.perf_counter()
        try:
            xml_text = bytes(context.named_data[parsed.model]).decode()
        except UnicodeDecodeError as e:
            raise DelegateError(f"{where}: the OpenVINO IR stored in the program is not text; the program is "
                                "damaged: re-export it.") from e
        weights, locations = self._weights(context, parsed.weights)
        xml_text = place_constants(xml_text, locations, where)
        try:
            model = _shared_core(ov).read_model(model=xml_text, weights=ov.Tensor(weights, shared_memory=True))
        except RuntimeError as e:
            raise DelegateError(f"{where}: OpenVINO cannot read the IR stored in the program ({str(e).splitlines()[0]}); "
                                "the program is damaged: re-export it.") from e
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": PRECISIONS[str(precision)]}
        if "num_threads" in context.backend_options:
            config["INFERENCE_NUM_THREADS"] = int(context.backend_options["num_threads"])
        compiling: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if not cache_disabled():
            cache = (context.cache_dir or default_cache_dir()) / "openvino"
            cache.mkdir(parents=True, exist_ok=True)
            config["CACHE_DIR"] = str(cache)
            compiling = _compile_lock(cache, parsed.export_hash)
        with compiling:
            compiled = _shared_core(ov).compile_model(model, "CPU", config)
        if len(compiled.outputs) != len(parsed.output_names):
            raise DelegateError(f"{where}: the OpenVINO IR has {len(compiled.outputs)} outputs but the manifest "
                                f"names {len(parsed.output_names)}; re-export the program.")
        log.info("method %s: OpenVINO delegate loaded (%s, export hash %s) in %.3f s", context.method_name,
                 precision, parsed.export_hash[:12], time.perf_counter() - started)
        return OpenVinoDelegate(compiled, weights, len(parsed.output_names))

    @staticmethod
    def _weights(context: InitContext, layers: Mapping[str, str]) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
        """The buffer OpenVINO reads constants from and each layer's (offset, length) in it: the program file
        itself, copy-on-write mapped; a program loaded from bytes has no file, so its constants are copied once."""
        if context.program_path is not None:
            return (np.memmap(context.program_path, dtype=np.uint8, mode="c"),
                    {layer: context.named_data.location(key) for layer, key in layers.items()})
        keys = list(dict.fromkeys(layers.values()))
        places, offset = {}, 0
        for key in keys:
            offset = -(-offset // 64) * 64
            places[key] = (offset, len(context.named_data[key]))
            offset += len(context.named_data[key])
        buffer = np.zeros(max(offset, 1), dtype=np.uint8)
        for key, (start, length) in places.items():
            buffer[start:start + length] = np.frombuffer(context.named_data[key], dtype=np.uint8)
        log.info("method %s: program loaded from bytes: the OpenVINO delegate's constants copied (%d B)",
                 context.method_name, offset)
        return buffer, {layer: places[key] for layer, key in layers.items()}
