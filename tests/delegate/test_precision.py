"""precision='bf16' at load: bf16 contraction inputs on CPUs with native bf16, a specialization of its own."""

import json

import numpy as np
import pytest

import onecopy.delegate.targets as targets
from onecopy import Runtime
from onecopy.delegate.precision import native_bf16_flags, precision_flags
from onecopy.errors import InvalidArgument
from onecopy.export import CompileSpec, export_program

X = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)

needs_native_bf16 = pytest.mark.skipif(
    not any(flag in targets.cpu_flags() for flag in native_bf16_flags()),
    reason=f"this CPU has none of {', '.join(native_bf16_flags()) or 'the bf16 features'}: bf16 is refused here",
)


def run(path, cache_dir, precision):
    with Runtime(cache_dir=cache_dir).load_program(path, precision=precision) as program:
        (y,) = program.load_method("forward").execute([X])
    return y


def entry_precisions(cache_dir) -> list[str]:
    return sorted(json.loads(p.read_text()).get("precision") for p in cache_dir.glob("v1/entries/*/entry.json"))


@needs_native_bf16
def test_bf16_is_close_to_fp32_and_really_bf16(small_program_path, tmp_path):
    fp32 = run(small_program_path, tmp_path, "fp32")
    bf16 = run(small_program_path, tmp_path, "bf16")
    scale = float(np.abs(fp32).max())
    error = float(np.abs(bf16 - fp32).max())
    cosine = float(fp32.ravel() @ bf16.ravel() / np.linalg.norm(fp32) / np.linalg.norm(bf16))
    assert error < 2e-2 * scale and cosine > 0.999
    # fp32 code reordered would differ by ~1e-7 of the scale; bf16 inputs (8 bits of mantissa) by ~1e-3.
    assert error > 1e-4 * scale, "precision='bf16' gave fp32 answers: the demotion did not happen"
    assert entry_precisions(tmp_path) == ["bf16", "fp32"]


@needs_native_bf16
def test_fp32_and_bf16_entries_coexist_and_each_restores_itself(small_program_path, tmp_path, states, monkeypatch):
    first = {precision: run(small_program_path, tmp_path, precision) for precision in ("bf16", "fp32")}
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # a restore only: any compile raises
    for precision in ("fp32", "bf16", "fp32"):
        np.testing.assert_array_equal(run(small_program_path, tmp_path, precision), first[precision])
    assert states() == ["specialized", "specialized", "restored", "restored", "restored"]


@pytest.mark.parametrize("machine, flags", [("x86_64", ("avx512_bf16", "amx_bf16")), ("aarch64", ("bf16",)),
                                            ("arm64", ("bf16",)), ("riscv64", ())])
def test_native_bf16_is_avx512_bf16_or_amx_bf16_on_x86_and_bf16_on_arm(machine, flags):
    assert native_bf16_flags(machine) == flags


def test_a_cpu_without_native_bf16_is_refused_naming_the_feature(small_program_path, tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    program = Runtime(cache_dir=tmp_path).load_program(small_program_path, precision="bf16")
    wanted = " or ".join(native_bf16_flags())
    with pytest.raises(InvalidArgument, match=rf"Method 'forward', delegate 0: precision='bf16' needs a CPU with "
                                              rf"native bf16 \({wanted}\); this CPU .* lacks {wanted}.*precision='fp32'"):
        program.load_method("forward")
    program.close()
    assert entry_precisions(tmp_path) == []  # refused before anything was compiled


def test_fp32_needs_no_cpu_feature(small_program_path, tmp_path, monkeypatch):
    monkeypatch.setattr(targets, "_cpu_flags", lambda: frozenset())
    np.testing.assert_allclose(run(small_program_path, tmp_path, "fp32"), run(small_program_path, tmp_path, "fp32"))


def test_a_vmfb_program_compiled_in_fp32_only_is_refused_in_bf16(small_vmfb_program_path, tmp_path):
    program = Runtime(cache_dir=tmp_path).load_program(small_vmfb_program_path, precision="bf16")
    with pytest.raises(InvalidArgument, match=r"precision='bf16' but this vmfb program holds x86_64 code in fp32 only\. "
                                              r"Re-export with CompileSpec\(packaging='vmfb', precisions=\('fp32', 'bf16'\)\)"):
        program.load_method("forward")
    program.close()


@pytest.fixture(scope="module")
def vmfb_bf16_path(small_methods, tmp_path_factory):
    """The small model as a vmfb program compiled in fp32 and bf16 (x86_64: code for x86-64-v4 + AVX512-BF16)."""
    return export_program(small_methods, compile_spec=CompileSpec(packaging="vmfb", precisions=("fp32", "bf16"))).save(
        tmp_path_factory.mktemp("bf16") / "small-vmfb-bf16.onecopy")


def test_a_vmfb_program_carries_each_targets_code_in_each_precision(vmfb_bf16_path):
    with Runtime().load_program(vmfb_bf16_path) as program:
        manifest = program.definition.delegates[0].manifest
    host = targets.host_cpu_target().name
    assert set(manifest["bundle"]) == set(manifest["encoders"]) == {host, f"{host}@bf16"}
    assert len(set(manifest["bundle"].values())) == 2  # two codes, one weights store


def entry_tunings(cache_dir) -> dict[str, dict | None]:
    """precision -> the tuning record of the cache entry made for it."""
    metas = [json.loads(p.read_text()) for p in cache_dir.glob("v1/entries/*/entry.json")]
    return {meta.get("precision"): meta.get("tuning") for meta in metas}


@pytest.fixture
def aot_faster(monkeypatch):
    """`aot_faster(precision)`: the first load of a vmfb program in bf16 times its bf16 and fp32 code as if
    `precision`'s ran in half the time of the other's (the answers are still each code's own)."""
    import onecopy.delegate.tuning as tuning

    real_time = tuning._time_against

    def arrange(faster: str) -> None:
        def timed(kept, candidate, calls, budget_s):  # the candidate: the fp32 code, timed against the bf16 one
            outputs, seconds, _ = real_time(kept, candidate, calls, budget_s)
            return outputs, seconds, 0.5 if faster == "fp32" else 2.0

        monkeypatch.setattr(tuning, "_time_against", timed)

    return arrange


@needs_native_bf16
@pytest.mark.parametrize("faster", ["bf16", "fp32"])
def test_a_vmfb_program_in_bf16_runs_the_code_measured_faster_and_restores_it(vmfb_bf16_path, tmp_path, states,
                                                                             monkeypatch, aot_faster, faster):
    """bf16 is allowed, not forced, for a vmfb program as for an mlir one: its first load in bf16 encodes and
    times both codes the program holds for this CPU and keeps the faster one's packed weights."""
    from onecopy.inspect import describe_tuning

    fp32 = run(vmfb_bf16_path, tmp_path, "fp32")
    aot_faster(faster)
    first = run(vmfb_bf16_path, tmp_path, "bf16")
    assert entry_precisions(tmp_path) == ["bf16", "fp32"]  # each precision's packed weights, an entry each
    tuning = entry_tunings(tmp_path)["bf16"]
    assert tuning["chosen_precision"] == faster and tuning["precision"] == "bf16"
    assert [c["name"] for c in tuning["candidates"]] == ["the bf16 code", "the fp32 code"]
    assert all(c["latency_ms"] is not None and c["error"] is None for c in tuning["candidates"])
    assert entry_tunings(tmp_path)["fp32"] is None  # fp32 has nothing to choose between
    shown = describe_tuning(tuning, "vmfb")
    assert shown.startswith(f"tuned: chose the {faster} code in ") and "budget" not in shown
    assert f"({tuning['candidates'][1]['ratio_to_kept']:.2f}x the kept one's time)" in shown
    assert tuning["candidates"][1]["ratio_to_kept"] == (0.5 if faster == "fp32" else 2.0)  # as the fixture timed
    assert ("bf16 allowed, fp32 measured faster here: runs in fp32" in shown) == (faster == "fp32")
    assert describe_tuning(None, "vmfb") == "code compiled at export, weights packed here (nothing to choose between)"
    scale = float(np.abs(fp32).max())
    if faster == "fp32":  # the fp32 code, on the weights its own encoder packed: fp32's answers exactly
        np.testing.assert_array_equal(first, fp32)
    else:
        error = float(np.abs(first - fp32).max())
        cosine = float(fp32.ravel() @ first.ravel() / np.linalg.norm(fp32) / np.linalg.norm(first))
        assert 1e-4 * scale < error < 2e-2 * scale and cosine > 0.999, "precision='bf16' did not run the bf16 code"
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")  # restores only, each on its own choice
    for precision, want in (("bf16", first), ("fp32", fp32)):
        np.testing.assert_array_equal(run(vmfb_bf16_path, tmp_path, precision), want)
    assert states()[-2:] == ["restored", "restored"]


@needs_native_bf16
def test_a_vmfb_program_in_bf16_with_tuning_off_runs_its_bf16_code(vmfb_bf16_path, tmp_path, aot_faster):
    aot_faster("fp32")
    fp32 = run(vmfb_bf16_path, tmp_path, "fp32")
    with Runtime(cache_dir=tmp_path).load_program(vmfb_bf16_path, precision="bf16",
                                                  backend_options={"IreeBackend": {"tune": False}}) as program:
        (bf16,) = program.load_method("forward").execute([X])
    assert float(np.abs(bf16 - fp32).max()) > 1e-4 * float(np.abs(fp32).max())
    assert entry_tunings(tmp_path)["bf16"] is None  # nothing chosen: an entry of its own (no "tuned" in its key)


def test_vmfb_bf16_code_is_refused_on_a_cpu_without_its_baseline(vmfb_bf16_path, tmp_path, monkeypatch):
    # native bf16, but not the rest of x86-64-v4 the code was compiled for
    monkeypatch.setattr(targets, "_cpu_flags", lambda: frozenset({"avx2", "fma", "bmi2", "f16c", "avx512f", "avx512_bf16",
                                                                  "bf16"}))
    program = Runtime(cache_dir=tmp_path).load_program(vmfb_bf16_path, precision="bf16")
    if targets.host_cpu_target().name == "x86_64":
        with pytest.raises(InvalidArgument, match=r"the program's bf16 code was compiled for CPUs with avx512f, "
                                                  r"avx512bw, .*; this CPU lacks avx512bw, avx512vl, avx512dq, avx512cd\. "
                                                  r"Load with precision='fp32'"):
            program.load_method("forward")
    program.close()
    assert entry_precisions(tmp_path) == []


def test_fp32_adds_no_flag_bf16_demotes_contraction_inputs():
    assert precision_flags("fp32") == ()
    assert "--iree-global-opt-demote-contraction-inputs-type=bf16" in precision_flags("bf16")


@needs_native_bf16
def test_a_model_of_nhwc_depthwise_convs_loads_in_bf16_without_im2col(tmp_path, caplog):
    """IREE 3.13's im2col (one of bf16's flags) miscompiles the NHWC depthwise op the depthwise_nhwc rewrite
    makes at batch > 1: the load compiles again without it, with a warning, and still computes in bf16."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 8, 1)).eval()
    x = torch.randn(8, 16, 12, 12)  # batch 1 compiles with im2col: the miscompile needs a batch
    path = export_program({"forward": torch.export.export(model, (x,))}).save(tmp_path / "dw.onecopy")
    results = {}
    for precision in ("fp32", "bf16"):
        with Runtime(cache_dir=tmp_path / "cache").load_program(path, precision=precision) as program:
            (results[precision],) = program.load_method("forward").execute([x.numpy()])
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(results["fp32"], want, rtol=1e-5, atol=1e-5)
    scale = float(np.abs(want).max())
    assert 0 < float(np.abs(results["bf16"] - want).max()) < 2e-2 * scale
    assert "--iree-global-opt-use-im2col-for-convs failed" in caplog.text
    # Every tuning candidate fell back the same way; each load said so once.
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "im2col-for-convs failed" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage()[:100] for r in warned]


@needs_native_bf16
def test_without_a_cache_a_shared_vmfb_model_in_bf16_is_not_shared_across_the_choice(small_methods, tmp_path,
                                                                                    monkeypatch, aot_faster):
    """With no cache entry to tell them apart, a load that chose the fp32 code by timing and one that runs the bf16
    code (tune=False), open together, hold models of their own, each with its own answers."""
    from onecopy.export import Partitioner

    path = export_program(small_methods, partitioner=Partitioner(multifunction=True, skip_ops=()),
                          compile_spec=CompileSpec(packaging="vmfb", precisions=("fp32", "bf16"))).save(
        tmp_path / "mf-bf16.onecopy")
    monkeypatch.setenv("ONECOPY_DISABLE_CACHE", "1")
    aot_faster("fp32")
    fp32 = run(path, None, "fp32")
    runtime = Runtime()
    programs = {tune: runtime.load_program(path, precision="bf16", backend_options={
        "IreeBackend": {"share_multifunction_model": True, "tune": tune}}) for tune in (True, False)}
    try:
        results = {tune: program.load_method("forward").execute([X])[0] for tune, program in programs.items()}
    finally:
        for program in programs.values():
            program.close()
    np.testing.assert_array_equal(results[True], fp32)  # the fp32 code, chosen
    assert float(np.abs(results[False] - fp32).max()) > 1e-4 * float(np.abs(fp32).max())  # the bf16 code
