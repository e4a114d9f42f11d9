"""`onecopy demo`: what onecopy buys on this machine, measured now beside ONNX Runtime and torch eager.

On the built-in model (8 x Linear(1024, 1024) + ReLU, methods forward [1, 1024] and prefill [16, 1024]):
1. program size on disk: one onecopy file for both methods vs one ONNX file per method;
2. time to first result in a fresh process: onecopy cold (specialize for this CPU) and warm (restore from the
   cache) vs an ONNX Runtime session;
3. memory (PSS and RSS growth) of K = 1, 2, 4, 8 loads, each K in a fresh process: onecopy programs with the
   shared model on and off vs ONNX Runtime sessions;
4. latency per call at B=1 and B=16: onecopy, ONNX Runtime, torch eager, in interleaved rounds;
5. a chained two-model fp16 frame pipeline: onecopy on bound surfaces vs numpy I/O vs ONNX Runtime's IOBinding.

And, with transformers installed (`pip install 'onecopy[llm]'`; without it these rows are skipped), a tiny
random-weight Llama exported by `onecopy.llm.export_llm` as prefill + decode, its KV cache kept in the engine as a
State: greedy decode tokens/s beside torch eager with transformers' static cache (same tokens, checked), the bytes a
decode step copies (`last_copy_stats`: none of the cache), and the PSS growth of 4 States over 1 in a fresh process.

Every figure is measured in this run; nothing is quoted from elsewhere. Without ONNX Runtime the demo says so and
measures onecopy (and torch eager) alone. Everything it makes lives in one temporary directory, removed at the
end, on an error and on Ctrl-C; its child processes are killed with it.

The modules, in the order a run uses them: `config` (what is measured how often), `run` (the run and its
temporary directory), `workloads` (the built-in model's rows), `peers` (ONNX Runtime's files), `children` (the
fresh processes), `llm_rows`, `progress` (the progress bar) and `report` (the table and the picture).
"""

from __future__ import annotations

from onecopy.demo.config import FULL, QUICK, DemoConfig
from onecopy.demo.run import measure, run_demo

__all__ = ["run_demo", "measure", "DemoConfig", "FULL", "QUICK"]
