"""The export-time compile check: a portable module is compiled here as its first load will be, and an op IREE
cannot compile goes to a host kernel (a graph break) or fails the export naming op, node, method and source
line, so that the first load is never where a compile failure shows."""

from __future__ import annotations

import logging
import time

from onecopy.delegate.targets import select_target
from onecopy.errors import DelegateError, ExportError, UnsupportedOperator
from onecopy.export.compile_spec import CompileSpec
from onecopy.export.culprits import find_culprits, reason, source_line
from onecopy.export.lowering import CompileFailed, LoweredBundle, check_compiles, lower
from onecopy.export.method_plan import DelegatePartition, host_can_take
from onecopy.export.parameters import ParameterTable
from onecopy.export.partitioner import op_name
from onecopy.export.state import held_states
from onecopy.export.symbols import rename_symbols
from onecopy.runtime.host_kernels import has_host_kernel

__all__ = ["lower_checked", "move_to_host"]

log = logging.getLogger("onecopy")


def lower_checked(group: list[tuple[DelegatePartition, str]], table: ParameterTable, spec: CompileSpec) -> LoweredBundle:
    """Lower one module and, for a portable bundle, compile it as its first load here will: an export that passes
    is a program that loads. Raises `CompileFailed` for the caller to find the op to blame."""
    where = "; ".join(p.staged(function).where for p, function in group)
    names = {k: v for p, _ in group for k, v in p.names.items()}
    try:
        held = held_states(group)
        bundle = lower([p.staged(function) for p, function in group], table.tensors, spec, held)
    except CompileFailed:
        raise
    except ExportError as e:
        renamed = rename_symbols(str(e), names)  # turbine's messages speak of torch's s31, the user wrote T
        if renamed != str(e):
            raise ExportError(renamed) from e
        raise
    if spec.packaging == "mlir" and spec.check_compiles:
        try:
            target = select_target(spec.compute_units, where)
        except DelegateError as e:  # e.g. compute_units="gpu" exported on a machine without one
            log.info("%s: not checked at export, no target for compute units '%s' here: %s", where, spec.compute_units, e)
            return bundle
        started = time.perf_counter()
        check_compiles(bundle, any(p.parameters for p, _ in group) or any(s.initial for s in held), target, where)
        log.debug("%s: compiles for %s (checked in %.0f ms)", where, target.name, (time.perf_counter() - started) * 1e3)
    return bundle


def move_to_host(
    failure: CompileFailed, partitions: list[DelegatePartition], table: ParameterTable, on_host: dict[str, set[str]]
) -> None:
    """Find the ops IREE cannot compile in the module that failed; those with a host kernel go to the host (a
    graph break, as `skip_ops` makes), any other fails the export naming op, node, method and source line."""
    # IREE bounds some buffers by a dimension's largest size: an unbounded one can be what fails.
    unbounded = sorted({p.names[s] for p in partitions for s, (_, high) in p.ranges.items() if high is None and s in p.names})
    hint = (f" Dimension(s) {', '.join(unbounded)} have no upper bound: torch.export.Dim(..., max=...) may let IREE "
            "compile it." if unbounded else "")
    culprits = find_culprits(partitions, failure, table.tensors)
    if not culprits:
        raise ExportError(
            f"{rename_symbols(str(failure), {k: v for p in partitions for k, v in p.names.items()})} No single operator was "
            "found to blame: the failure comes from ops together. Leave some on the host with "
            f"Partitioner(skip_ops=(...)) and a registered host kernel, or change the model.{hint}"
        ) from failure
    for culprit in culprits:
        name, node = op_name(culprit.node), culprit.node
        at = source_line(node)
        where = f"Method '{culprit.method}': IREE cannot compile operator '{name}' (node '{node.name}'" + (
            f" at {at})" if at else ")") + f" for {failure.target.name}: {reason(culprit.error)}."
        if not has_host_kernel(name) or node.name in on_host[culprit.method]:
            raise UnsupportedOperator(
                f"{where} Register a host kernel with onecopy.runtime.register_host_kernel('{name}', fn) (the export "
                f"then leaves this op on the host: a graph break, as Partitioner(skip_ops=('{name}',)) does for "
                f"every node of the op), or change the model to avoid it.{hint}"
            ) from failure
        if not all(host_can_take(a) for a in (*node.args, *node.kwargs.values())):
            raise UnsupportedOperator(
                f"{where} Its host kernel cannot run it either: it takes a size computed at run time or a list of "
                f"values. Export the method with static shapes, or change the model to avoid it.{hint}"
            ) from failure
        log.warning("%s It runs on the host kernel registered for it (a graph break).", where)
        on_host[culprit.method].add(node.name)
