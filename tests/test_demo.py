"""`onecopy demo`: the figures it prints (--json), the table and picture made from them, and what it leaves behind.

One reduced run (--quick: K = 1, 2, fewer rounds and decode tokens, the same measuring code) serves the tests of
this module.
"""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

onnxruntime = pytest.importorskip("onnxruntime", reason="the demo's peer rows need the demo extra")


def _demo(tmp: Path, *args: str) -> subprocess.Popen:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp)}  # everything the demo makes must land here, and be gone at the end
    # SIGINT as a terminal gives it: a test before this one may leave this process ignoring SIGINT (the child would
    # inherit SIG_IGN, and rightly ignore a Ctrl-C).
    return subprocess.Popen([sys.executable, "-m", "onecopy.cli", "demo", "--quick", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _leftover_surfaces(pid: int) -> list[str]:
    return [p for p in os.listdir("/dev/shm") if f"onecopy-demo-{pid}-" in p]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    picture = tmp / "picture.png"
    process = _demo(tmp / "tmp", "--json", "--plot", str(picture))
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return {"figures": json.loads(out), "stderr": err, "picture": picture, "tmp": tmp / "tmp", "pid": process.pid}


def test_json_has_the_figures_of_every_engine(quick_run):
    f = quick_run["figures"]
    assert f["machine"]["cpu_model"] and f["machine"]["cores"] >= 1 and f["machine"]["usable_cpus"] >= 1
    assert f["onnxruntime"] == "measured"
    assert set(f["size_bytes"]) == {"onecopy", "onnxruntime"}
    assert set(f["size_bytes"]["onnxruntime"]) == {"forward", "prefill", "total"}
    assert set(f["load_ms"]["onecopy"]) == {"import_ms", "cold_ms", "warm_ms"}
    assert set(f["load_ms"]["onnxruntime"]) == {"import_ms", "first_result_ms"}
    assert set(f["memory_mib"]) == {"onecopy_shared", "onecopy_unshared", "onnxruntime"}
    for engine in f["memory_mib"].values():
        assert set(engine) == {"1", "2"}
        assert all({"rss", "pss", "pss_anon", "pss_file"} <= set(k) for k in engine.values())
    assert set(f["latency_ms"]) == {"B=1", "B=16"}
    for batch in f["latency_ms"].values():
        assert set(batch["ms"]) == {"onecopy", "onnxruntime", "torch"}
        assert set(batch["onecopy_over"]) == {"onnxruntime", "torch"}
        assert all(ms > 0 for ms in batch["ms"].values())
    assert set(f["frames"]["ms_per_frame"]) == {"onecopy_bound", "onecopy_numpy", "onnxruntime_iobinding"}
    assert f["frames"]["bytes_copied_per_frame"]["onecopy_bound"] == 0
    assert set(f["max_abs_diff_vs_torch"]) == {"onecopy", "onnxruntime"}
    llm = f["llm"]
    assert {"decode_tokens_per_s", "decode_ms_per_token", "onecopy_over", "greedy_tokens_equal", "tokens",
            "copy_per_decode_step", "states_memory", "weight_bytes"} <= set(llm), llm
    assert set(llm["decode_tokens_per_s"]) == {"onecopy", "torch"}
    assert all(v > 0 for v in llm["decode_tokens_per_s"].values())
    assert llm["greedy_tokens_equal"] and llm["tokens"]["onecopy"] == llm["tokens"]["torch"]
    assert len(llm["tokens"]["onecopy"]) == llm["decode_tokens"] + 1
    assert set(llm["states_memory"]["growth_bytes"]) == {"1", "4"}


def test_llm_rows_tell_the_state_story(quick_run):
    """Measured, not asserted text: a decode step copies none of the cache, and 3 more States cost their caches
    (and the engine's context for each), not the weights again."""
    llm = quick_run["figures"]["llm"]
    copy = llm["copy_per_decode_step"]
    assert copy["cache_bytes"] == 2 * 2 * 2 * 256 * 16 * 4  # K and V of 2 layers, [1, 2 KV heads, 256, 16] fp32
    assert copy["state_bytes_copied"] == 0
    assert copy["copied_in"] + copy["copied_out"] == copy["token_position_logits_bytes"] == 8 + 8 + 128 * 4
    memory = llm["states_memory"]
    extra, cache, weights = memory["three_more_states_bytes"], memory["cache_bytes_per_state"], llm["weight_bytes"]
    assert extra["pss"] >= 0.9 * 3 * cache
    assert extra["pss"] < 3 * (cache + weights)
    assert extra["pss_file"] < weights / 2


def test_without_transformers_the_llm_rows_are_skipped_and_a_failure_leaves_the_rest(monkeypatch):
    from rich.console import Console

    from onecopy.demo import llm_rows
    from onecopy.demo.config import QUICK

    class Steps:
        def start(self, description):
            pass

        def done(self, n=1):
            pass

    out = io.StringIO()
    console = Console(file=out, width=140)
    monkeypatch.setattr(llm_rows, "llm_missing", lambda: "not installed: transformers")
    assert llm_rows.measure_llm_rows(Path("."), Path("."), QUICK, Steps(), console) == {
        "skipped": "not installed: transformers", "hint": "pip install 'onecopy[llm]'"}
    monkeypatch.setattr(llm_rows, "llm_missing", lambda: None)

    def fail(*args):
        raise RuntimeError("the engine said no\nin two lines")

    monkeypatch.setattr(llm_rows, "measure_llm", fail)
    assert llm_rows.measure_llm_rows(Path("."), Path("."), QUICK, Steps(), console) == {
        "error": "RuntimeError: in two lines"}
    assert "the LLM rows failed: RuntimeError: in two lines" in out.getvalue()


def test_figures_tell_the_memory_story(quick_run):
    """What the demo exists to show, measured: a second onecopy program adds (almost) nothing, a second ONNX
    Runtime session a copy of the weights (32 MiB)."""
    memory = quick_run["figures"]["memory_mib"]
    weights_mib = quick_run["figures"]["size_bytes"]["onecopy"]["parameters"] / 2**20
    assert memory["onecopy_shared"]["2"]["pss"] - memory["onecopy_shared"]["1"]["pss"] < weights_mib / 4
    assert memory["onnxruntime"]["2"]["pss"] - memory["onnxruntime"]["1"]["pss"] > weights_mib / 2
    # the first load counts the weights once: the warm-up's mapping is gone from the baseline
    assert memory["onecopy_shared"]["1"]["pss"] > weights_mib / 2


def test_json_goes_to_stdout_alone_and_the_picture_is_drawn(quick_run):
    assert "picture written to" in quick_run["stderr"]
    picture = quick_run["picture"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size < 200_000


def test_demo_leaves_nothing_behind(quick_run):
    assert list(quick_run["tmp"].iterdir()) == []
    assert _leftover_surfaces(quick_run["pid"]) == []


def test_table_shows_every_peer_row(quick_run):
    from rich.console import Console

    from onecopy.demo.report import print_table

    out = io.StringIO()
    print_table(quick_run["figures"], Console(file=out, width=140))
    text = out.getvalue()
    for row in ("size on disk", "first result, cold", "first result, warm", "memory, 2 loads, PSS",
                "memory, 2 loads, RSS", "latency, forward B=1", "latency, prefill B=16", "frame, bound surfaces"):
        assert row in text
    assert "than torch" in text and "0 B copied" in text
    for row in ("LLM decode, tokens/s", "LLM decode step, copies", "LLM memory, 4 States vs 1"):
        assert row in text
    assert "same tokens" in text and "0 B of the 128 KiB cache" in text and "KiB cache + 3 x" in text


def test_without_onnxruntime_the_table_says_how_to_get_the_peer_rows(quick_run):
    from rich.console import Console

    from onecopy.demo.report import print_table

    figures = copy.deepcopy(quick_run["figures"])
    figures["onnxruntime"] = "not installed: onnxruntime"
    del figures["size_bytes"]["onnxruntime"], figures["load_ms"]["onnxruntime"], figures["memory_mib"]["onnxruntime"]
    for batch in figures["latency_ms"].values():
        del batch["ms"]["onnxruntime"], batch["onecopy_over"]["onnxruntime"]
    del figures["frames"]["ms_per_frame"]["onnxruntime_iobinding"]
    del figures["frames"]["onecopy_bound_over"]["onnxruntime_iobinding"]
    del figures["max_abs_diff_vs_torch"]["onnxruntime"]
    out = io.StringIO()
    print_table(figures, Console(file=out, width=140))
    assert "ONNX Runtime is not installed: onnxruntime" in out.getvalue()
    assert "'.[demo]'" in out.getvalue() and "latency, forward B=1" in out.getvalue()
    assert "LLM decode, tokens/s" in out.getvalue()


def test_without_transformers_the_table_says_how_to_get_the_llm_rows(quick_run):
    from rich.console import Console

    from onecopy.demo.report import print_table

    for llm, said in (({"skipped": "not installed: transformers", "hint": "pip install 'onecopy[llm]'"},
                       "LLM rows skipped, not installed: transformers. For these rows: pip install 'onecopy[llm]'"),
                      ({"error": "RuntimeError: boom"}, "LLM rows failed: RuntimeError: boom")):
        figures = copy.deepcopy(quick_run["figures"])
        figures["llm"] = llm
        out = io.StringIO()
        print_table(figures, Console(file=out, width=140))
        assert said in out.getvalue() and "LLM decode" not in out.getvalue()
        assert "frame, bound surfaces" in out.getvalue()


def _demo_imports() -> dict[str, set[str]]:
    """The onecopy.demo modules each demo module imports, at module level or inside a function (from its ast)."""
    import ast

    import onecopy.demo

    package = Path(onecopy.demo.__file__).parent
    modules = {f"onecopy.demo.{p.stem}" if p.stem != "__init__" else "onecopy.demo": p for p in package.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_demo_modules_import_each_other_in_one_direction():
    graph = _demo_imports()
    assert "onecopy.demo.report" in graph and graph["onecopy.demo"], graph

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m})) for m in graph[start])

    assert [m for m in graph if reaches(m, m, {m})] == []


def test_the_entry_of_the_fresh_processes_says_how_to_run_the_demo():
    for args, said in (((), "for the demo itself run `onecopy demo`"), (("bogus",), "unknown demo child 'bogus'")):
        done = subprocess.run([sys.executable, "-m", "onecopy.demo", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and said in done.stderr, done.stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")[:200]
    except OSError:
        return "(gone)"


@pytest.mark.slow
def test_ctrl_c_kills_the_children_and_removes_the_temporaries(tmp_path):
    tmp = tmp_path / "tmp"
    process = _demo(tmp, "--json")
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while not children and time.monotonic() < deadline and process.poll() is None:
            children = _children(process.pid)  # the first fresh process: the cold load
            time.sleep(0.05)
        assert children, "the demo started no child process"
        first = {c: _command(c) for c in children}
        process.send_signal(signal.SIGINT)  # to the demo alone: it must end its children itself
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0, f"the demo went on after Ctrl-C (its children then: {first}): {err[-3000:]}"
    assert all(not Path(f"/proc/{c}").exists() for c in children)
    assert list(tmp.iterdir()) == []
    assert _leftover_surfaces(process.pid) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise, by design
def test_a_ctrl_c_lost_on_the_way_is_raised_again_at_the_next_step():
    """A KeyboardInterrupt raised inside a finalizer is printed and dropped by CPython: the demo must still stop."""
    from onecopy.demo.run import _interrupts

    class Dropping:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside the finalizer, and its raise is lost

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Python has it
    try:
        with _interrupts() as check:
            check()  # nothing received yet
            Dropping()
            with pytest.raises(KeyboardInterrupt):
                check()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_demo_started_ignoring_sigint_keeps_ignoring_it():
    """A background job (or a parent that ignores SIGINT) passes SIG_IGN on: Ctrl-C is not the demo's to take."""
    from onecopy.demo.run import _interrupts

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _interrupts():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # SIGTERM still ends it cleanly
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
