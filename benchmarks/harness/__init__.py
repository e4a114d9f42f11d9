"""The shared parts of the benchmark scripts, one job a module; `benchmarks/common.py` re-exports them all.

- `timing`: peers timed side by side in interleaved rounds, `Stats`, paired ratios and their intervals;
- `cpu`: how busy other processes keep the CPUs (a contended run says so);
- `machine`: what the numbers were measured on;
- `process_memory`: RSS, PSS, USS of a process and the kinds of its PSS;
- `workspace`: temporary directories, an isolated specialization cache, child scripts, load states;
- `peers`: torch eager, ONNX Runtime (exported with torch.onnx), onecopy; `raw_iree`: the same IREE module called
  without onecopy;
- `tables` and `targets`: what a script prints; `results`: its command line and the JSON it writes.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"


