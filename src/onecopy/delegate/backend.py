"""IreeBackend: turns a manifest into a delegate running one function of an IREE module."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.delegate import quarantine
from onecopy.delegate.binding import SurfaceBinding
from onecopy.delegate.cache import CacheEntry
from onecopy.delegate.cpus import worker_count
from onecopy.delegate.dispatch_profile import profile_model
from onecopy.delegate.engine import EngineFunction, LoadedModel
from onecopy.delegate.executors import BUSY_RETIMES, caller_wait_mode, choose, measured_busy, merge, stale
from onecopy.delegate.invocation import Invocation, call, call_copied
from onecopy.delegate.manifest import Manifest, bundle_key, missing_named_data, parse_manifest, split_bundle_key
from onecopy.delegate.model_set import ModelSet
from onecopy.delegate.resolution import Resolved, resolve
from onecopy.delegate.shared_models import shared_models
from onecopy.delegate.specialize import AotCode, Specialization, encode, manifest_signatures, recalibrate, specialize
from onecopy.delegate.targets import CPU_EXECUTORS
from onecopy.delegate.tuning import signatures
from onecopy.errors import DelegateError, ExecutionError, InvalidArgument, ProgramFormatError
from onecopy.program import NamedData
from onecopy.runtime.backend import Backend, DelegateHandle, DelegateSummary, RunReport
from onecopy.runtime.copy_stats import CopyStats
from onecopy.runtime.init_context import InitContext

__all__ = ["IreeBackend", "IreeDelegate", "specialize"]

log = logging.getLogger("onecopy")


def _named(named_data: NamedData, key: str, what: str, where: str) -> memoryview:
    try:
        return named_data[key]
    except KeyError:
        raise DelegateError(f"{where}: {what} '{key}' is missing from the program's named data. Re-export it.") from None


def _code(context: InitContext, key: str, what: str) -> memoryview:
    """`_named`, for bytes the engine will run or compile: checked against their sha256 first. Loading a program
    hashes nothing (its weights are hundreds of MB), but damaged code can crash IREE's loader (a segfault, seen
    with three flipped bytes of a vmfb), and code is small: a bundle costs ~0.1 ms per 100 KB, once per load."""
    where, named_data = context.where, context.named_data
    view = _named(named_data, key, what, where)
    try:
        named_data.verify(key)
    except ProgramFormatError:
        source = context.program_path or "<bytes>"
        raise ProgramFormatError(
            f"{where}: {what} '{key}' does not match its recorded sha256: the program file '{source}' is damaged; "
            "re-copy or re-export it (`onecopy verify FILE` lists every problem)."
        ) from None
    return view


def _aot_code(context: InitContext, manifest: Manifest, bundle: str) -> AotCode:
    """The vmfb code and parameter encoder `manifest` holds under `bundle` (a `bundle_key`), checked as read."""
    _, precision = split_bundle_key(bundle)
    return AotCode(precision, _code(context, manifest.bundle[bundle], "bundle"),
                   _code(context, manifest.encoders[bundle], f"parameter encoder for {bundle}"))


def _recalibrated(context: InitContext, resolved: Resolved, entry: CacheEntry, code: bytes | memoryview,
                  encoded: Mapping[str, memoryview], parameters: Mapping[str, memoryview],
                  state_zeros: Mapping[str, int], serves: Sequence[str] | None,
                  busy_retimes: int | None = None) -> dict | None:
    """Backend option `recalibrate`, figures timed with the calling thread waiting otherwise (`executors.stale`)
    or while other processes took the cores (`executors.measured_busy`; `busy_retimes`: how many times that has
    been timed again, this time included): time the functions this load serves (all of the module's for a shared
    model) on both CPU executors again, and keep the figures in the restored entry, beside those other loads
    measured (onecopy.delegate.executors.merge). Returns the record this load picks its executor from."""
    manifest, where = resolved.manifest, context.where
    try:
        if manifest.packaging == "vmfb":
            found = manifest_signatures(manifest.signatures or {})
        else:
            found = signatures(_code(context, manifest.bundle["portable"], "bundle"))
    except ValueError as e:
        log.info("%s: executors not calibrated again: %s", where, e)
        return entry.executors
    found = [s for s in found if serves is None or s.name in serves]
    record = recalibrate(code, found, encoded, parameters, resolved.target, where, state_zeros)
    if not record.get("functions"):  # nothing could be timed: keep what the entry says
        return entry.executors
    if busy_retimes is not None:
        record["busy_retimes"] = busy_retimes
    assert resolved.cache is not None and resolved.cache_key is not None  # an entry was restored from it
    meta = resolved.cache.update_meta(resolved.cache_key, lambda meta: {**meta, "executors": merge(meta.get("executors"), record)})
    return meta.get("executors") if meta is not None else record


class IreeDelegate(DelegateHandle):
    """Runs one function of a loaded model. Thread-safe: each call runs in a VM context of its own."""

    def __init__(self, model: LoadedModel, function: EngineFunction, manifest: Manifest,
                 release: Callable[[], None], shared: bool, where: str):
        self.where = where
        self.model: LoadedModel | None = model
        self._function: EngineFunction | None = function
        self._release: Callable[[], None] | None = release
        self.function = manifest.function
        self.manifest = manifest
        self.shared = shared
        self.owned_surfaces: list[Any] = []
        self._state_names = tuple(e.name for e in manifest.states)

    def execute(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None], stats: CopyStats
    ) -> list[np.ndarray]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        try:
            return call(function, inputs, outputs, stats)
        except (ValueError, IndexError) as e:
            # IREE raises these (not RuntimeError) for a call its function refuses (argument count, rank or
            # size) or results it has not: what a header that disagrees with the code it describes leads to.
            raise ExecutionError(
                f"{self.where}: the engine refused the call of '{self.function}': {e}. The program's header does "
                "not match its code (damaged or edited?); `onecopy verify FILE` checks it, re-export it."
            ) from e

    def prepare(
        self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None]
    ) -> Callable[[CopyStats], list[np.ndarray]]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        return Invocation(function, inputs, outputs)  # planned once, run many times (one plan per thread)

    def copied_call(
        self, inputs: Sequence[np.ndarray], outputs: int
    ) -> Callable[[Sequence[np.ndarray], CopyStats], list[np.ndarray]]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        if function.outputs_in_place:  # needs output storage: not a call that returns its results
            return super().copied_call(inputs, outputs)
        return function.copied_call(inputs, outputs)

    def checked_call(self, inputs: Sequence[np.ndarray], outputs: int, report: RunReport
                     ) -> Callable[..., list[np.ndarray] | None] | None:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        if function.outputs_in_place:
            return None
        return function.copied_call(inputs, outputs, report)

    def profile(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], seconds: float) -> Any:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        arguments = [*inputs, *outputs] if function.outputs_in_place else list(inputs)
        return profile_model(function.model, self.function, arguments, seconds=seconds)

    def bind_surface(self, surface: Any) -> None:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        function.bind(SurfaceBinding(surface, f"{self.where}"))

    def destroy(self) -> None:
        release, self._release = self._release, None
        function, self._function = self._function, None
        if function is not None and function.bindings:
            quarantine.hold([obj for b in function.bindings.values() for obj in b.handed_to_engine])
        self.model = None
        if release is not None:
            release()
        surfaces, self.owned_surfaces = self.owned_surfaces, []
        for surface in surfaces:
            surface.close()

    # Program state (onecopy.delegate.state): the module's states live in a VM context per `State`.
    @property
    def state_names(self) -> tuple[str, ...]:
        return self._state_names

    def state_copied_call(self, inputs: Sequence[np.ndarray], outputs: int
                          ) -> Callable[[Sequence[np.ndarray], CopyStats, Any], list[np.ndarray]]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        return function.copied_call(inputs, outputs)  # its `state` argument: an EngineState (its context)

    def state_domain(self) -> Any:
        model = self.model
        if model is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        return model

    def create_state(self) -> Any:
        from onecopy.delegate.state import EngineState

        return EngineState(self.state_domain(), self.manifest.states, self.where)

    def execute_with_state(self, state: Any, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray | None],
                           stats: CopyStats) -> list[np.ndarray]:
        function = self._function
        if function is None:
            raise DelegateError(f"Delegate '{self.function}' was destroyed; load the program again.")
        context = state.context
        if context is None:
            raise DelegateError(f"{self.where}: the state was closed; create a new one with program.create_state().")
        return call_copied(function, inputs, outputs, stats, context)

    @property
    def device(self) -> str:
        model = self.model
        return model.driver if model is not None else "destroyed"

    @property
    def runs_on(self) -> str:
        model = self.model
        if model is None:
            return "IREE (destroyed)"
        executor = {"local-sync": "the calling thread", "local-task": "IREE's task workers"}.get(model.driver)
        workers = f", {model.workers} of them" if model.workers is not None else ""
        return f"IREE {model.driver} ({executor}{workers})" if executor else f"IREE {model.driver}"

    @property
    def bound_surfaces(self) -> dict[str, Any]:
        function = self._function
        return {b.surface.name: b.surface for b in function.bindings.values()} if function is not None else {}

    @property
    def has_bound_surfaces(self) -> bool:
        function = self._function
        return function is not None and bool(function.bindings)



def _method_output_dtypes(context: InitContext, parsed: Manifest) -> list[str]:
    """Each result's dtype for a manifest written before manifests recorded them (`Manifest.output_dtypes`): when
    this delegate's call is its method's only instruction, its results are the method's outputs, whose dtypes the
    method records. Without it such a program's uint8 and bool results came back as int8 (IREE's integer buffers
    carry no sign). A partition's results feeding host ops have no record to read: they stay as the engine gives
    them, as they always came back from such files."""
    meta = context.method_meta()
    if meta.instructions == (f"delegate_call {context.delegate_index}",) and len(meta.outputs) == len(
            parsed.output_names):
        return [t.dtype.name for t in meta.outputs]
    return []


class IreeBackend(Backend):
    name = "IreeBackend"
    options = {
        "compute_units": str,
        "cache_dir": str,
        "max_cache_bytes": int,
        "share_multifunction_model": bool,
        "bound_surfaces": str,
        "tune": bool,
        "executor": str,
        "threads": int,
        "recalibrate": bool,
    }

    @staticmethod
    def _bound_surfaces(context: InitContext) -> list[Any]:
        """Open the surfaces named by option `bound_surfaces` (comma-separated), for callers that only have a
        program file and options. Only a method that is this delegate's call alone, on caller-provided outputs,
        can take them: anything else would put host work or planned memory between the surface and the engine."""
        names = [n.strip() for n in str(context.backend_options.get("bound_surfaces", "")).split(",") if n.strip()]
        if not names:
            return []
        meta = context.method_meta()
        reasons = []
        if len(meta.instructions) != 1:
            reasons.append(f"it runs {len(meta.instructions)} instructions ({', '.join(meta.instructions)}), not "
                           "this delegate's call alone")
        if any(o.memory_planned for o in meta.outputs):
            reasons.append("its outputs are memory planned; export with memory_planned_outputs=False")
        if reasons:
            raise InvalidArgument(
                f"{context.where}: backend 'IreeBackend' option bound_surfaces cannot apply to method "
                f"'{meta.name}': {'; '.join(reasons)}."
            )
        from onecopy.surface import Surface

        return [Surface.open(name) for name in names]

    def describe(self, manifest: Mapping[str, Any], where: str) -> DelegateSummary:
        parsed = parse_manifest(manifest, where)
        return DelegateSummary(parsed.function, parsed.packaging, parsed.export_hash)

    def verify_manifest(self, manifest: Mapping[str, Any], named_data: Collection[str], where: str) -> list[str]:
        try:
            parsed = parse_manifest(manifest, where)
        except DelegateError as e:
            return [str(e)]
        return [f"{where}: {problem}" for problem in missing_named_data(parsed, named_data)]

    def init(self, context: InitContext, manifest: Mapping[str, Any]) -> IreeDelegate:
        where = context.where
        parsed = parse_manifest(manifest, where)
        options = context.backend_options
        share = options.get("share_multifunction_model", False)
        if share and not parsed.multifunction:
            raise InvalidArgument(
                f"{where}: backend 'IreeBackend' option share_multifunction_model=True needs a program exported "
                "with Partitioner(multifunction=True): this delegate has a module of its own, so there is no model "
                "to share. Re-export with multifunction=True, or drop the option."
            )
        resolved = resolve(context, parsed)
        started = time.perf_counter()
        # The functions of a module holding state must run in the same VM contexts (a State's), so every delegate
        # of it uses one loaded model: shared, whatever the option says (a shared model shares weights, never
        # state: each State has contexts of its own).
        if share or parsed.states:
            table_key = resolved.table_key()
            model, loaded_here = shared_models.acquire(table_key, lambda: self._load(context, resolved, serves=None))
            state = model.load_state if loaded_here else "restored"
            release: Callable[[], None] = lambda: shared_models.release(table_key)
        else:
            model = self._load(context, resolved, serves=[parsed.function])
            state = model.load_state
            release = model.close
        try:
            function = model.function(parsed.function, outputs_in_place=parsed.outputs_in_place,
                                      result_dtypes=parsed.output_dtypes or _method_output_dtypes(context, parsed),
                                      where=where)
        except BaseException:
            release()
            raise
        if log.isEnabledFor(logging.INFO):
            packed = function.model.encoded_bytes
            log.info(
                "kind=%s %s key=%s ms=%.1f %s function=%s target=%s precision=%s driver=%s%s%s",
                parsed.packaging, state, resolved.key_prefix, (time.perf_counter() - started) * 1e3, where,
                parsed.function, resolved.target.name, resolved.precision, function.model.driver,
                " shared" if share else "",
                f" packed={packed / 2**20:.1f}MiB huge={function.model.huge_page_bytes() / 2**20:.1f}MiB" if packed else "",
            )
        delegate = IreeDelegate(function.model, function, parsed, release, share, where)  # the model running it
        try:
            for surface in self._bound_surfaces(context):
                delegate.owned_surfaces.append(surface)  # opened here, so closed with the delegate
                delegate.bind_surface(surface)
        except BaseException:
            delegate.destroy()
            raise
        return delegate

    @staticmethod
    def _load(context: InitContext, resolved: Resolved, serves: Sequence[str] | None) -> LoadedModel | ModelSet:
        """Build the model: vmfb code in place from the program file, with the weights its encoder packs restored
        from the cache entry (or encoded into it); mlir code and packed weights restored from the cache entry (or
        specialized into it). Parameters always come from the program's mapping, never copied. `serves`: the
        functions the model will run (None: any of its module, a shared model), which pick its executor; a shared
        model without state whose functions chose different executors is a ModelSet."""
        where, manifest, target = context.where, resolved.manifest, resolved.target
        entry: CacheEntry | None = None
        encoded: dict[str, memoryview] = {}
        parameters = {
            name: _named(context.named_data, key, f"parameter '{name}'", where)
            for name, key in manifest.parameters.items()
        }
        state_zeros = {e.parameter: e.nbytes for e in manifest.states}  # what a context's states start from
        # `produce(scratch)` makes what the cache entry holds: for mlir the module and its packed weights
        # (specialize, writing the compiler's side files under `scratch`), for vmfb the packed weights only (its
        # encoder; the module runs in place from the program file).
        produce: Callable[[Path | None], Specialization] | None
        if manifest.packaging == "vmfb":
            encoder_key = manifest.encoders.get(resolved.bundle)
            if encoder_key is None:  # nothing packed ahead of time (older program, non-CPU target, no data tiling)
                produce = None
            else:
                _named(context.named_data, encoder_key, f"parameter encoder for {resolved.bundle}", where)
                # Its bytes are checked when it runs (once per machine), not on the loads that restore its output.
                produce = lambda scratch: encode(
                    _aot_code(context, manifest, resolved.bundle), parameters, target, where,
                    functions=manifest.signatures, state_zeros=state_zeros,
                    fp32=_aot_code(context, manifest, resolved.fp32_bundle) if resolved.fp32_bundle else None)
        else:
            source_key = manifest.bundle["portable"]
            _named(context.named_data, source_key, "bundle", where)
            produce = lambda scratch: specialize(_code(context, source_key, "bundle"), parameters, target, where, scratch,
                                                 tune=resolved.tuned, precision=resolved.precision,
                                                 state_zeros=state_zeros)
        state = "restored"
        calibration: dict | None = None
        tuning: dict | None = None
        module: bytes | memoryview | None = None  # mlir: the specialized module
        if produce is not None:
            if resolved.cache is None:
                result = produce(None)
                module, state, calibration, tuning = result.module, "specialized", result.executors, result.tuning
                encoded = {name: memoryview(array) for name, array in result.encoded.items()}
            else:
                entry, state = resolved.cache.get_or_specialize(
                    resolved.cache_key,  # type: ignore[arg-type]
                    produce,
                    program=str(context.program_path or "<bytes>"),
                    packaging=manifest.packaging,
                    compute_units=resolved.units,
                    target=target.name,
                    export_hash=manifest.export_hash,
                    precision=resolved.precision,
                )
                module, encoded, calibration = entry.module(), entry.encoded(), entry.executors
                tuning = entry.tuning
        code: bytes | memoryview | None = module
        if manifest.packaging == "vmfb":
            # Read (its bytes checked) once the entry says which code its weights were packed for: the load's
            # precision, or fp32 where that measured faster.
            chosen = (tuning or {}).get("chosen_precision", resolved.precision)
            try:
                code = _code(context, manifest.bundle[bundle_key(target.name, chosen)], "bundle")
            except BaseException:  # a damaged file: the restored entry is released, as below
                if entry is not None:
                    entry.close()
                raise
        if state == "restored" and entry is not None and code:
            timed = serves if serves is not None else list((calibration or {}).get("functions") or ())
            again = bool(context.backend_options.get("recalibrate"))
            if not again and not resolved.driver and stale(calibration, timed, worker_count()):
                # Figures of another wait of the calling thread (onecopy.delegate.executors): once, kept.
                log.info("%s: executors were timed with the calling thread waiting otherwise than it now does "
                         "(%s): timing them again", where, caller_wait_mode())
                again = True
            retimes = None
            if not again and not resolved.driver and measured_busy(calibration, worker_count()):
                # Timed while others took the cores: again, counted, BUSY_RETIMES times at most.
                assert calibration is not None
                retimes = int(calibration.get("busy_retimes", 0)) + 1
                log.info("%s: executors were timed while other processes or threads took %.2f cores: timing them "
                         "again (%d of at most %d)", where, calibration["other_cpu"], retimes, BUSY_RETIMES)
                again = True
            if again:
                calibration = _recalibrated(context, resolved, entry, code, encoded, parameters, state_zeros,
                                            serves, retimes)
        if code is None:  # an mlir key's entry without a module: onecopy never writes one
            if entry is not None:
                entry.close()
            raise DelegateError(f"{where}: the cache entry {resolved.key_prefix} holds no module; run `onecopy cache "
                                "clear` and load again.")
        driver, drivers = resolved.driver, {}
        if not driver:
            functions = serves if serves is not None else list((calibration or {}).get("functions") or ())
            driver = CPU_EXECUTORS[choose(calibration, functions, worker_count()) or "parallel"]
            if serves is None and not manifest.states:  # a shared model without state: each function its own
                drivers = {f: CPU_EXECUTORS[chosen] for f in functions
                           if (chosen := choose(calibration, [f], worker_count())) is not None}
        try:
            model = LoadedModel(code, parameters, target, where, encoded=encoded, keepalive=entry,
                                state_zeros=state_zeros, driver=driver,
                                workers=resolved.workers)
        except BaseException:
            if entry is not None:
                entry.close()
            raise
        model.load_state = state
        return ModelSet(model, drivers) if any(d != driver for d in drivers.values()) else model
