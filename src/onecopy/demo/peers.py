"""The demo's peer ONNX Runtime: whether it is installed, and the ONNX files it runs (exported with torch.onnx)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from onecopy.demo.config import ONNX_PACKAGES

__all__ = ["onnxruntime_missing", "export_onnx", "onnx_bytes", "tiny_onnx"]


def onnxruntime_missing() -> str | None:
    import importlib.util

    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def export_onnx(model, example, path: Path, exported=None) -> Path:
    """The model as ONNX, the way benchmarks/ export it: torch.onnx's dynamo exporter (static shapes; from the
    torch.export program onecopy was given, when there is one, rather than tracing the model again), the
    TorchScript exporter if that fails."""
    import io
    import logging
    import warnings

    import torch

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # "torchvision ..."
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(exported if exported is not None else model, () if exported is not None else (example,),
                              str(path), dynamo=True, verbose=False, input_names=["x"], output_names=["y"])
        except Exception:  # noqa: BLE001  (any failure of one exporter: try the other)
            torch.onnx.export(model, (example,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                              opset_version=17)
    return path


def onnx_bytes(path: Path) -> int:
    """An ONNX file with its external data files (the dynamo exporter writes the weights beside the graph)."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def tiny_onnx(path: Path) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path

