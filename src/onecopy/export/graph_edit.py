"""Editing a decomposed method's FX graph: new nodes inserted with the metadata the exporter reads (a fake value
for shapes and dtypes, the source location for error messages). The tool every graph rewrite
(onecopy.export.rewrites) builds with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

__all__ = ["GraphEdit"]


class GraphEdit:
    """Inserts nodes into `gm`'s graph, each with its fake value computed in the graph's fake mode."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        placeholders = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode(placeholders)  # None: a graph without fake values, not ours to edit

    def emit(self, origin: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """A new node computing `target(*args)` before `origin`, with the metadata the exporter reads."""
        with self.graph.inserting_before(origin):
            node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in origin.meta:
                node.meta[key] = origin.meta[key]
        return node

    def contiguous(self, origin: fx.Node, node: fx.Node) -> fx.Node:
        # A transposed view is not contiguous for torch: the partitions are traced again at lowering, where
        # `view` on it fails. To IREE a clone is a value, not a copy.
        if node.meta["val"].is_contiguous():
            return node
        return self.emit(origin, torch.ops.aten.clone.default, node, memory_format=torch.contiguous_format)

    def replace_each(self, rewrite: Callable[[GraphEdit, fx.Node], fx.Node | None]) -> bool:
        """Replace every op node for which `rewrite(self, node)` emits a replacement (None: left as it is), the
        replacement taking the node's metadata but its value; then `finish`. Whether anything changed; a graph
        without fake values is left alone."""
        if self.fake_mode is None:
            return False
        changed = False
        for node in list(self.graph.nodes):
            if node.op == "call_function" and (y := rewrite(self, node)) is not None:
                y.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                node.replace_all_uses_with(y)
                self.graph.erase_node(node)
                changed = True
        if changed:
            self.finish()
        return changed

    def finish(self) -> None:
        """Drop what no longer has readers, check the graph and regenerate its code."""
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
