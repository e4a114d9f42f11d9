"""What `onecopy demo` measures how often (`DemoConfig`: FULL, QUICK), the shapes it uses and the install hints it
prints."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoConfig", "FULL", "QUICK", "FRAME", "ONNX_PACKAGES", "INSTALL_HINT", "PLOT_HINT", "LLM_HINT",
           "LLM_CACHE_TOKENS", "LLM_PREFILL_TOKENS"]

FRAME = (1, 3, 270, 480)  # fp16 frames: 810 rows of 480 values = 960-byte rows, a dense surface
ONNX_PACKAGES = ("onnxruntime", "onnx", "onnxscript")
INSTALL_HINT = "pip install -c constraints.txt -e '.[demo]' (make demo installs it)"
PLOT_HINT = "pip install -c constraints.txt -e '.[plot]' (make demo installs it)"


@dataclass(frozen=True)
class DemoConfig:
    ks: tuple[int, ...] = (1, 2, 4, 8)  # loads per process in the memory sweep
    warm_loads: int = 3  # fresh processes per warm figure (median)
    latency_rounds: int = 12
    latency_block_s: float = 0.05  # timed calls of one peer in a round
    frame_rounds: int = 12
    llm_tokens: int = 32  # greedy decode steps per timed call
    llm_rounds: int = 6


FULL = DemoConfig()
QUICK = DemoConfig(ks=(1, 2), warm_loads=1, latency_rounds=3, latency_block_s=0.015, frame_rounds=3,
                   llm_tokens=8, llm_rounds=2)  # every measurement, fewer times

LLM_HINT = "pip install 'onecopy[llm]'"
LLM_CACHE_TOKENS = 256
LLM_PREFILL_TOKENS = 16
