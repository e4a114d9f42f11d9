"""Partitioner: decides which nodes of a method the IREE delegate takes and which stay on the host.

The delegate takes every ATen/prims node except those named in `skip_ops`; ops IREE cannot import (custom ops,
higher-order ops) stay on the host too. Host nodes split a method into partitions (a "graph break"): each maximal
run of delegate nodes, in graph order, is one partition. Every host op needs a host kernel; otherwise export
fails here, naming the op, rather than at run time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from onecopy.errors import InvalidArgument, UnsupportedOperator
from onecopy.runtime.host_kernels import has_host_kernel

__all__ = ["Partitioner", "Partition", "op_name"]

# Namespaces whose ops iree-turbine imports and IREE lowers (after the core ATen decompositions), and onecopy's
# own (onecopy.export.engine_ops: custom ops turbine expands into the MLIR they carry).
_ENGINE_NAMESPACES = ("aten", "prims", "onecopy")


def op_name(node: fx.Node) -> str:
    """The name users write in `skip_ops` and host kernels are registered under, e.g. `aten.relu.default`."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__qualname__", None) or str(target)


@dataclass
class Partition:
    """A run of nodes, all for the delegate (`on_host` False) or a single host node (`on_host` True)."""

    on_host: bool
    nodes: list[fx.Node] = field(default_factory=list)


@dataclass(frozen=True)
class Partitioner:
    """
    Args:
        multifunction: stage every method's partitions as functions of one engine module (weights once).
        skip_ops: op names left on the host, e.g. ("aten.relu.default",).
        share_state: buffers this method updates in place (a KV cache) are program state shared with every other
            method that updates a buffer of the same name (prefill and decode share their cache). False keeps this
            method's state its own, named `<method>.<buffer>`.
    """

    multifunction: bool = False
    skip_ops: tuple[str, ...] = ()
    share_state: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.skip_ops, str):
            raise InvalidArgument(f"Partitioner.skip_ops is a tuple of op names; write skip_ops=('{self.skip_ops}',).")
        object.__setattr__(self, "skip_ops", tuple(self.skip_ops))
        if type(self.multifunction) is not bool:
            raise InvalidArgument(
                f"Partitioner.multifunction expects bool, got {type(self.multifunction).__name__}."
            )
        if type(self.share_state) is not bool:
            raise InvalidArgument(f"Partitioner.share_state expects bool, got {type(self.share_state).__name__}.")

    def engine_takes(self, node: fx.Node, on_host: frozenset[str] = frozenset()) -> bool:
        name = op_name(node)
        if name in self.skip_ops or node.name in on_host:
            return False
        target = node.target
        return isinstance(target, torch._ops.OpOverload) and target.namespace in _ENGINE_NAMESPACES

    def partition(self, graph: fx.Graph, method: str, on_host: frozenset[str] = frozenset()) -> list[Partition]:
        """`on_host`: names of nodes left on the host besides `skip_ops`: those the export-time compile check
        found IREE cannot compile, which have a host kernel."""
        partitions: list[Partition] = []
        owner: dict[fx.Node, Partition] = {}
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)):
                continue  # a shape computation: each partition that reads it recomputes it
            if node.target is operator.getitem:
                # An element of a multi-output op lives where its producer runs; a host producer's elements are
                # plain values of the method, no instruction of their own.
                producer = owner[node.args[0]]
                if not producer.on_host:
                    producer.nodes.append(node)
                owner[node] = producer
                continue
            if not self.engine_takes(node, on_host):
                name = op_name(node)
                if not has_host_kernel(name):
                    reason = "it is in skip_ops" if name in self.skip_ops else "IREE cannot import it"
                    raise UnsupportedOperator(
                        f"Method '{method}': operator '{name}' (node '{node.name}') can run neither in IREE nor on "
                        f"the host ({reason}, and no host kernel is registered for it). Register one with "
                        f"onecopy.runtime.register_host_kernel('{name}', fn)"
                        + (" or remove it from skip_ops." if name in self.skip_ops else ".")
                    )
                partitions.append(Partition(True, [node]))
            elif not partitions or partitions[-1].on_host:
                partitions.append(Partition(False, [node]))
            else:
                partitions[-1].nodes.append(node)
            owner[node] = partitions[-1]
        return partitions
