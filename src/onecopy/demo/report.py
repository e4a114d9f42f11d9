"""The demo's figures as a table (rich) and as one picture (matplotlib): onecopy beside its peers.

Every ratio is onecopy over the peer; below 1 onecopy is smaller, faster or uses less. Rows where onecopy is
behind are printed the same way, with the ratio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onecopy.demo.config import INSTALL_HINT

__all__ = ["print_table", "draw"]

MIB = 2**20
ENGINE_NAMES = {"onecopy": "onecopy", "onnxruntime": "ONNX Runtime", "torch": "torch eager"}
COLORS = {"onecopy_shared": "#1b7837", "onecopy_unshared": "#7fbf7b", "onecopy": "#1b7837",
          "onnxruntime": "#b2182b", "torch": "#2166ac", "onecopy_numpy": "#a6dba0"}


def _verdict(ratio: float | None, better: str, worse: str) -> str:
    """'3.1x less' when onecopy (the numerator) is ahead, '1.2x more' when behind; 'same' within 2%."""
    if ratio is None or ratio != ratio:
        return "-"
    if 0.98 <= ratio <= 1.02:
        return "about the same"
    x = 1 / ratio if ratio < 1 else ratio
    return f"{x:.1f}x {better if ratio < 1 else worse}" if x < 10 else f"{x:.0f}x {better if ratio < 1 else worse}"


def _ms(ms: float) -> str:
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"


def _rows(f: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(figure, onecopy, ONNX Runtime, torch eager, onecopy vs ONNX Runtime (and torch))."""
    rows = []
    size = f["size_bytes"]
    oc, onnx = size["onecopy"]["file"], size.get("onnxruntime", {}).get("total")
    rows.append(("size on disk, 2 methods", f"{oc / MIB:.1f} MiB, 1 file",
                 f"{onnx / MIB:.1f} MiB, 2 files" if onnx else "", "",
                 _verdict(oc / onnx, "smaller", "larger") if onnx else ""))
    load = f["load_ms"]
    mine, peer = load["onecopy"], load.get("onnxruntime")
    rows.append(("import, fresh process", _ms(mine["import_ms"]), _ms(peer["import_ms"]) if peer else "", "",
                 _verdict(mine["import_ms"] / peer["import_ms"], "faster", "slower") if peer else ""))
    for label, key in (("first result, cold ¹", "cold_ms"), ("first result, warm ¹", "warm_ms")):
        alone = f"{mine['cold_ms'] / mine['warm_ms']:.0f}x faster than cold" if key == "warm_ms" else ""
        rows.append((label, _ms(mine[key]), _ms(peer["first_result_ms"]) if peer else "", "",
                     _verdict(mine[key] / peer["first_result_ms"], "faster", "slower") if peer else alone))
    memory = f["memory_mib"]
    ort = memory.get("onnxruntime", {})
    for k in memory["onecopy_shared"]:
        shared, unshared = memory["onecopy_shared"][k]["pss"], memory["onecopy_unshared"][k]["pss"]
        theirs = ort.get(k, {}).get("pss")
        # max(..., 1): a growth under 1 MiB is noise, not an infinite ratio
        rows.append((f"memory, {k} load{'s' if k != '1' else ''}, PSS ²", f"+{shared:.0f} / +{unshared:.0f} MiB",
                     f"+{theirs:.0f} MiB" if theirs is not None else "", "",
                     _verdict(max(shared, 1) / max(theirs, 1), "less", "more") if theirs is not None else ""))
    last = list(memory["onecopy_shared"])[-1]
    shared, unshared = memory["onecopy_shared"][last]["rss"], memory["onecopy_unshared"][last]["rss"]
    theirs = ort.get(last, {}).get("rss")
    rows.append((f"memory, {last} loads, RSS ³", f"+{shared:.0f} / +{unshared:.0f} MiB",
                 f"+{theirs:.0f} MiB" if theirs is not None else "", "",
                 _verdict(max(shared, 1) / max(theirs, 1), "less", "more") if theirs is not None else ""))
    for batch, lat in f["latency_ms"].items():
        ms, over = lat["ms"], lat["onecopy_over"]
        verdict = _verdict(over["onnxruntime"], "faster", "slower") if "onnxruntime" in over else ""
        verdict = "; ".join(v for v in (verdict, f"{_verdict(over['torch'], 'faster', 'slower')} than torch") if v)
        rows.append((f"latency, {lat['method']} {batch}", _ms(ms["onecopy"]),
                     _ms(ms["onnxruntime"]) if "onnxruntime" in ms else "", _ms(ms["torch"]), verdict.strip()))
    frames = f["frames"]
    ms, copied, over = frames["ms_per_frame"], frames["bytes_copied_per_frame"], frames["onecopy_bound_over"]
    iob = "onnxruntime_iobinding"
    rows.append(("frame, bound surfaces ⁴", f"{_ms(ms['onecopy_bound'])}, {copied['onecopy_bound']} B copied",
                 _ms(ms[iob]) if iob in ms else "", "",
                 _verdict(over[iob], "faster", "slower") if iob in over else ""))
    rows.append(("frame, numpy I/O ⁴", f"{_ms(ms['onecopy_numpy'])}, {copied['onecopy_numpy'] / MIB:.1f} MiB copied",
                 "", "", f"bound: {_verdict(over['onecopy_numpy'], 'faster', 'slower')}"))
    llm = f.get("llm", {})
    if "decode_tokens_per_s" in llm:
        tps, copy, mem = llm["decode_tokens_per_s"], llm["copy_per_decode_step"], llm["states_memory"]
        same = "same tokens" if llm["greedy_tokens_equal"] else "TOKENS DIFFER"
        rows.append(("LLM decode, tokens/s ⁵", f"{tps['onecopy']:.0f} tok/s", "", f"{tps['torch']:.0f} tok/s",
                     f"{_verdict(llm['onecopy_over']['torch'], 'faster', 'slower')} than torch; {same}"))
        rows.append(("LLM decode step, copies ⁵",
                     f"{copy['state_bytes_copied']} B of the {copy['cache_bytes'] / 1024:.0f} KiB cache", "", "",
                     f"{copy['copied_in'] + copy['copied_out']} B copied: token, position, logits"))
        extra = mem["three_more_states_bytes"]["pss"]
        cache_kib, beyond_kib = mem["cache_bytes_per_state"] / 1024, mem["beyond_cache_per_state_bytes"] / 1024
        # A cache's pages count once written: a State that decoded one step may not have touched them all yet.
        split = (f"3 x {cache_kib:.0f} KiB cache + 3 x {beyond_kib:.0f} KiB context" if beyond_kib >= 0 else
                 f"under 3 x {cache_kib:.0f} KiB cache: pages not yet written are not resident")
        rows.append(("LLM memory, 4 States vs 1 ⁵", f"+{extra / 1024:.0f} KiB PSS", "", "",
                     f"{split}; weights ({llm['weight_bytes'] / 1024:.0f} KiB) not copied"))
    diffs = f["max_abs_diff_vs_torch"]
    rows.append(("max |diff| vs torch", f"{diffs['onecopy']:.1e}",
                 f"{diffs['onnxruntime']:.1e}" if "onnxruntime" in diffs else "", "-", ""))
    return rows


def print_table(f: dict[str, Any], console) -> None:
    from rich.table import Table

    machine = f["machine"]
    table = Table(title=f"onecopy beside ONNX Runtime and torch eager, measured now: {f['model']}",
                  title_justify="left", title_style="bold")
    ort = f["onnxruntime"] == "measured"
    table.add_column("figure", no_wrap=True)
    table.add_column("onecopy", justify="right")
    if ort:
        table.add_column("ONNX Runtime", justify="right", no_wrap=True)
    table.add_column("torch eager", justify="right")
    table.add_column("onecopy vs ONNX Runtime" if ort else "onecopy is")
    for row in _rows(f):
        table.add_row(*(row if ort else row[:2] + row[3:]))
    console.print(table)
    memory = f["memory_mib"]
    last = list(memory["onecopy_shared"])[-1]
    notes = [
        "onecopy over the peer; times are medians of interleaved rounds, ratios paired round by round.",
        "¹ fresh process, imports not counted. Cold: onecopy compiles the program for this CPU, once; every later "
        "process restores it from the cache (warm). ONNX Runtime has no compile step: every session prepares the "
        "model again.",
        "² growth over a warmed-up process, each K in its own fresh process. onecopy: K programs of both methods, "
        "shared model on / off; ONNX Runtime: K sessions of forward.onnx (one method).",
        f"³ RSS counts a mapped file page once per mapping: unshared onecopy programs map the same weights again "
        f"(+{memory['onecopy_unshared'][last]['rss']:.0f} MiB RSS) without using more memory; PSS counts each page "
        "once. ONNX Runtime's sessions hold private copies: their RSS is their PSS.",
        f"⁴ two chained fp16 models, {'x'.join(map(str, f['frames']['frame']))} frames; ONNX Runtime with IOBinding "
        "to preallocated arrays.",
    ]
    llm = f.get("llm", {})
    if "decode_tokens_per_s" in llm:
        notes.append(
            f"⁵ {llm['model']}; onecopy.llm.export_llm, cache {llm['max_cache_len']} tokens, prefill "
            f"{llm['prefill_tokens']}; {llm['decode_tokens']} greedy decode steps per timed run, torch eager with "
            "transformers' static cache. Copies from decode.last_copy_stats; memory: PSS growth of a fresh process "
            "holding the loaded program, from 1 to 4 States (one decode each).")
    if not ort:
        console.print(f"ONNX Runtime is {f['onnxruntime']}: onecopy's rows only. For the peer rows: {INSTALL_HINT}.",
                      style="bold", markup=False, highlight=False)
    if "skipped" in llm:
        console.print(f"LLM rows skipped, {llm['skipped']}. For these rows: {llm['hint']}.", style="bold",
                      markup=False, highlight=False)
    elif "error" in llm:
        console.print(f"LLM rows failed: {llm['error']}", style="bold", markup=False, highlight=False)
    for note in notes:
        console.print(note, style="dim", markup=False, highlight=False)
    console.print(f"{machine['cpu_model']}, {machine['usable_cpus']} of {machine['cores']} CPUs; "
                  + ", ".join(f"{p} {v}" for p, v in machine["versions"].items() if v)
                  + f"; the demo took {f['duration_s']:.0f} s, load average {f['load_average_at_end'][0]:.1f} at its end",
                  style="dim", markup=False, highlight=False)


def draw(f: dict[str, Any], path: Path) -> None:
    """Four panels: memory (PSS) against K, latency, time to first result, frame pipeline. Raises ImportError
    without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.2))
    (mem, lat), (load, frames) = axes
    memory = f["memory_mib"]
    ks = [int(k) for k in memory["onecopy_shared"]]
    labels = {"onecopy_shared": "onecopy, shared model", "onecopy_unshared": "onecopy, unshared",
              "onnxruntime": "ONNX Runtime sessions"}
    for engine, style, dy in (("onnxruntime", "o-", -3), ("onecopy_unshared", "s--", 6), ("onecopy_shared", "D-", -12)):
        if engine in memory:
            values = [memory[engine][str(k)]["pss"] for k in ks]
            mem.plot(ks, values, style, color=COLORS[engine], label=labels[engine], linewidth=2)
            mem.annotate(f"+{values[-1]:.0f}", (ks[-1], values[-1]), textcoords="offset points", xytext=(6, dy),
                         color=COLORS[engine], fontsize=9)
    mem.set(title="memory of K loads of the model (PSS growth)", xlabel="K loads in one process",
            ylabel="MiB", xticks=ks)
    mem.set_xlim(right=ks[-1] * 1.12)
    mem.set_ylim(bottom=0)
    mem.legend(loc="upper left", fontsize=9)
    last = str(ks[-1])
    mem.text(0.03, 0.70, f"RSS, unshared onecopy: +{memory['onecopy_unshared'][last]['rss']:.0f} MiB at K={last}:\n"
             "the same file pages counted once per mapping,\nnot memory used (PSS counts them once)",
             transform=mem.transAxes, ha="left", va="top", fontsize=8, color="#555555")

    engines = [e for e in ("onecopy", "onnxruntime", "torch") if any(e in v["ms"] for v in f["latency_ms"].values())]
    lat.remove()  # one small panel per batch: B=16 takes several times B=1, one scale would flatten B=1
    cells = lat.get_subplotspec().subgridspec(1, len(f["latency_ms"]), wspace=0.3)
    for i, (batch, figures) in enumerate(f["latency_ms"].items()):
        ax = fig.add_subplot(cells[0, i])
        present = [e for e in engines if e in figures["ms"]]
        bars = ax.bar([ENGINE_NAMES[e].replace(" ", "\n") for e in present], [figures["ms"][e] for e in present],
                      color=[COLORS[e] for e in present])
        ax.bar_label(bars, fmt="%.2f ms", fontsize=8)
        ax.set_title(f"latency per call, {figures['method']} {batch}", fontsize=10)
        ax.set_ylim(top=max(figures["ms"][e] for e in present) * 1.15)
        ax.tick_params(axis="x", labelsize=8)
        if i == 0:
            ax.set_ylabel("ms (median, interleaved rounds)")

    l = f["load_ms"]
    names, values, colors = ["onecopy cold\n(compiles once)", "onecopy warm\n(cache)"], \
        [l["onecopy"]["cold_ms"], l["onecopy"]["warm_ms"]], [COLORS["onecopy_unshared"], COLORS["onecopy"]]
    if "onnxruntime" in l:
        names.append("ONNX Runtime\n(session)")
        values.append(l["onnxruntime"]["first_result_ms"])
        colors.append(COLORS["onnxruntime"])
    bars = load.bar(names, values, color=colors)
    load.bar_label(bars, fmt="%.0f ms", fontsize=9)
    load.set(title="load -> first result, fresh process (imports not counted)", ylabel="ms (log)", yscale="log")
    load.set_ylim(top=max(values) * 4)

    ms = f["frames"]["ms_per_frame"]
    names = {"onecopy_bound": "onecopy\nbound surfaces", "onecopy_numpy": "onecopy\nnumpy I/O",
             "onnxruntime_iobinding": "ONNX Runtime\nIOBinding"}
    keys = [k for k in names if k in ms]
    bars = frames.bar([names[k] for k in keys], [ms[k] for k in keys],
                      color=[COLORS["onecopy"], COLORS["onecopy_numpy"], COLORS["onnxruntime"]][:len(keys)])
    frames.bar_label(bars, fmt="%.2f ms", fontsize=9)
    frames.set(title=f"two-model frame pipeline, fp16 {'x'.join(map(str, f['frames']['frame']))}",
               ylabel="ms per frame")
    frames.set_ylim(top=max(ms[k] for k in keys) * 1.15)

    machine = f["machine"]
    fig.suptitle(f"onecopy beside ONNX Runtime and torch eager: {f['model']}\n{machine['cpu_model']}, "
                 f"{machine['usable_cpus']} CPUs, load average {f['load_average_at_end'][0]:.1f} at the end of the run",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
