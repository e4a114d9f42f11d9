import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from onecopy.cli import main
from onecopy.delegate.precision import native_bf16_flags
from onecopy.delegate.targets import cpu_flags, host_cpu_target
from tests.conftest import eager, with_manifest


class _PairAndEmpty(torch.nn.Module):
    def forward(self, x):
        return x * 2, x + 1


@pytest.fixture(scope="module")
def pair_program_path(tmp_path_factory):
    """Method 'pair': two outputs of [2, 3]; method 'empty': the same on a [0, 3] input (outputs of no elements)."""
    from onecopy.export import CompileSpec, export_program

    model = _PairAndEmpty()
    methods = {"pair": torch.export.export(model, (torch.ones(2, 3),)),
               "empty": torch.export.export(model, (torch.ones(0, 3),))}
    program = export_program(methods, compile_spec=CompileSpec(packaging="mlir"))
    return program.save(tmp_path_factory.mktemp("programs") / "pair.onecopy")


def test_inspect_shows_methods_delegates_and_sizes(small_program_path, capsys):
    assert main(["inspect", str(small_program_path)]) == 0
    out = capsys.readouterr().out
    assert "method forward: (x: float32[1, 64]) -> (float32[1, 64])" in out
    assert "delegate_call 0" in out
    assert "functions: main (delegates 0)" in out
    assert "parameters 0.05 MiB (each stored once)" in out
    assert "code " in out and "(mlir)" in out
    assert "parameter encoders" not in out  # mlir: packed at specialization, no encoder in the program


def test_inspect_shows_the_openvino_alternative_and_the_choice_recorded_here(conv_programs, tmp_path, capsys):
    from onecopy import Runtime

    path = str(conv_programs[1])
    assert main(["inspect", path, "--cache-dir", str(tmp_path)]) == 0
    before = capsys.readouterr().out
    assert "alternative: delegate 1 OpenVinoBackend: IR" in before
    assert "prefer=latency here: not measured yet" in before
    with Runtime(cache_dir=tmp_path).load_program(path, prefer="latency") as program:
        chosen = program.load_method("forward").method_meta.choice.backend
    assert main(["inspect", path, "--cache-dir", str(tmp_path)]) == 0
    after = capsys.readouterr().out
    assert f"prefer=latency here: {chosen} (IreeBackend " in after
    assert "OpenVinoBackend +" in after and "MiB PSS" in after


def test_inspect_shows_the_parameter_encoder_of_each_vmfb_target(small_vmfb_program_path, capsys):
    assert main(["inspect", str(small_vmfb_program_path)]) == 0
    out = capsys.readouterr().out
    assert "(vmfb)" in out
    host = host_cpu_target().name  # the fixture's default target: this machine's
    assert f"parameter encoders (pack the weights once per machine): {host} " in out


def test_run_reads_and_writes_npy(small_program_path, small_model, tmp_path, capsys):
    x = np.random.default_rng(1).standard_normal((16, 64), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "y.npy"
    assert main(["run", str(small_program_path), "--method", "prefill", "--input", str(tmp_path / "x.npy"),
                 "--output", str(out)]) == 0
    np.testing.assert_allclose(np.load(out), eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    assert "output 0: float32[16, 64]" in capsys.readouterr().out


def test_run_reports_bad_input_as_an_error_not_a_traceback(small_program_path, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((3, 3), np.float32))
    assert main(["run", str(small_program_path), "--input", str(tmp_path / "x.npy")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onecopy run: error: Input 0 of method 'forward' has shape [3, 3]; expected [1, 64]")
    assert main(["run", str(tmp_path / "missing.onecopy")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_writes_a_program_that_runs(tmp_path, capsys):
    path = tmp_path / "two.onecopy"
    code = main(["export", "tests.conftest:small_builtin", "--method", "forward=1x64", "--method", "prefill=16x64",
                 "--packaging", "vmfb", "--skip-op", "aten.relu.default", "--precision", "bf16", "-o", str(path)])
    assert code == 0, capsys.readouterr().err
    assert path.exists()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host_op aten.relu.default" in out and "(vmfb)" in out
    assert f"{host_cpu_target().name}@bf16.vmfb" in out  # each target's code in fp32 and in bf16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "nope", "--method", "forward=1x4", "-o", "x"], "is not MODULE:FACTORY"),
        (["export", "tests.conftest:small_builtin", "--method", "forward", "-o", "x"], "is not NAME=SHAPE"),
        (["export", "tests.conftest:small_builtin", "--method", "forward=1xq", "-o", "x"], "is not like 1x1024"),
        (["export", "no_such_module:f", "--method", "forward=1x4", "-o", "x"], "Cannot import module"),
    ],
)
def test_export_argument_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_console_script_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "onecopy.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "demo" in result.stdout and "inspect" in result.stdout


def test_bench_prints_latency_percentiles(small_program_path, capsys):
    assert main(["bench", str(small_program_path), "--runs", "5", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "p50 ms" in out and "forward" in out and "prefill" in out and "float32[16, 64]" in out
    assert "executor auto" in out


def test_bench_runs_on_the_executor_asked(small_program_path, capsys, monkeypatch):
    import onecopy.delegate.backend as backend

    drivers = []
    real = backend.LoadedModel

    def recording(*args, **kwargs):
        drivers.append(kwargs.get("driver"))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "LoadedModel", recording)
    assert main(["bench", str(small_program_path), "--runs", "2", "--warmup", "1", "--executor", "inline"]) == 0
    out = capsys.readouterr().out
    assert "executor inline" in out and "runs on" in out and "local-sync" in out
    assert drivers and set(drivers) == {"local-sync"}



def test_profile_prints_each_methods_dispatches_and_json(small_program_path, capsys):
    assert main(["profile", str(small_program_path), "--seconds", "0.1", "--executor", "inline", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "forward: main on local-sync (the calling thread)" in out and "prefill: main on local-sync" in out
    assert "matmul" in out and "ms a call" in out
    assert main(["profile", str(small_program_path), "--seconds", "0.1", "--method", "prefill", "--json"]) == 0
    profiles = json.loads(capsys.readouterr().out)
    assert list(profiles) == ["prefill"] and profiles["prefill"]["calls"] > 0
    assert sum(row["per_call"] for row in profiles["prefill"]["rows"] if "matmul" in row["name"]) == 3
    with pytest.raises(SystemExit) as exit:
        main(["profile", str(small_program_path), "--seconds", "0"])
    assert exit.value.code == 2
    assert "argument --seconds: must be positive, got 0" in capsys.readouterr().err


def test_profile_takes_a_methods_inputs_from_npy_files(small_program_path, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((1, 64), np.float32))
    assert main(["profile", str(small_program_path), "--seconds", "0.1", "--method", "forward",
                 "--input", str(tmp_path / "x.npy")]) == 0
    assert "forward: main on" in capsys.readouterr().out
    assert main(["profile", str(small_program_path), "--input", str(tmp_path / "x.npy")]) == 2
    assert "--input is for one method" in capsys.readouterr().err
    np.save(tmp_path / "wrong.npy", np.ones((2, 64), np.float32))  # checked as execute checks them
    assert main(["profile", str(small_program_path), "--method", "forward", "--input", str(tmp_path / "wrong.npy")]) == 2
    assert "forward" in capsys.readouterr().err

@pytest.mark.skipif(not any(f in cpu_flags() for f in native_bf16_flags()), reason="no native bf16 on this CPU")
def test_bench_in_bf16_reports_the_error_against_fp32_and_inspect_shows_both_precisions(
        small_program_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ONECOPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")  # one table row per method
    assert main(["bench", str(small_program_path), "--runs", "3", "--warmup", "1", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "max |err| vs fp32" in out and "cosine vs fp32" in out
    rows = [line for line in out.splitlines() if "float32[" in line]
    assert len(rows) == 2
    for row in rows:  # method, inputs, 4 times, error, cosine
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        error, cosine = float(cells[-2]), float(cells[-1])
        assert 1e-6 < error < 0.05 and 0.999 <= cosine <= 1.0  # bf16 happened, and it is close
    assert main(["inspect", str(small_program_path), "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "x86_64, bf16 (cache entry" in out or "aarch64, bf16 (cache entry" in out
    assert ", fp32 (cache entry" in out


def test_verify_says_ok_for_a_whole_program(small_program_path, capsys):
    assert main(["verify", str(small_program_path)]) == 0
    assert capsys.readouterr().out == (
        f"{small_program_path}: ok (header, every segment's sha256, every delegate's manifest)\n")


def test_verify_prints_one_line_per_problem_and_exits_1(small_program, tmp_path, capsys):
    from tests.program.test_verify import flipped

    data, key = flipped(small_program.to_bytes(), "param/")
    path = tmp_path / "flipped.onecopy"
    path.write_bytes(data)
    assert main(["verify", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"segment '{key}': its bytes do not match the sha256 in the header (recorded ")
    assert lines[1] == f"{path}: 1 problem"
    path.write_bytes(small_program.to_bytes()[:-1])
    assert main(["verify", str(path)]) == 1
    assert "truncated: named data " in capsys.readouterr().out


def test_verify_of_a_missing_file_is_an_error_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing.onecopy")]) == 2
    assert capsys.readouterr().err == f"onecopy verify: error: Program file '{tmp_path / 'missing.onecopy'}' does not exist.\n"


def test_inspect_of_a_bad_manifest_names_the_delegate_and_the_field(small_program, tmp_path, capsys):
    path = tmp_path / "bad.onecopy"
    path.write_bytes(with_manifest(small_program, 0, function=3))
    assert main(["inspect", str(path)]) == 2
    assert (f"onecopy inspect: error: Program '{path}', delegate 0 (IreeBackend): invalid manifest: Expected `str`, "
            "got `int` - at `$.function`. Re-export the program.") in capsys.readouterr().err


def test_run_writes_no_output_when_one_of_them_cannot_be(pair_program_path, tmp_path, capsys, monkeypatch):
    np.save(tmp_path / "x.npy", np.ones((2, 3), np.float32))
    first, missing = tmp_path / "a.npy", tmp_path / "no_such_dir" / "b.npy"
    argv = ["run", str(pair_program_path), "--method", "pair", "--input", str(tmp_path / "x.npy")]
    assert main([*argv, "--output", str(first), "--output", str(missing)]) == 2
    assert capsys.readouterr().err == (f"onecopy run: error: --output '{missing}': directory '{missing.parent}' does "
                                       "not exist; create it or name a file in an existing directory.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]  # the first was not written either
    # A write that fails part way (a full disk): the files there before are as they were, no temporary file is left.
    first.write_bytes(b"before")
    real_save, saved = np.save, []

    def full_disk(file, array, **kwargs):
        if saved:
            raise OSError(28, "No space left on device")
        saved.append(file)
        real_save(file, array, **kwargs)

    monkeypatch.setattr(np, "save", full_disk)
    assert main([*argv, "--output", str(first), "--output", str(tmp_path / "b.npy")]) == 2
    assert capsys.readouterr().err == (f"onecopy run: error: --output '{tmp_path / 'b.npy'}' could not be written "
                                       "(No space left on device); no output file was changed. Free space in its "
                                       "directory or name another.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "x.npy"] and first.read_bytes() == b"before"


def test_run_writes_each_output_at_exactly_the_path_named(pair_program_path, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((2, 3), np.float32))
    assert main(["run", str(pair_program_path), "--method", "pair", "--input", str(tmp_path / "x.npy"),
                 "--output", str(tmp_path / "out.txt"), "--output", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "out.txt", "x.npy"]  # no .npy added to either
    np.testing.assert_array_equal(np.load(tmp_path / "out.txt"), np.full((2, 3), 2, np.float32))
    np.testing.assert_array_equal(np.load(tmp_path / "b"), np.full((2, 3), 2, np.float32))
    assert "output 1: float32[2, 3] min 2 max 2 mean 2" in capsys.readouterr().out


def test_run_summarizes_and_writes_an_output_of_no_elements(pair_program_path, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((0, 3), np.float32))
    out = tmp_path / "y.npy"
    assert main(["run", str(pair_program_path), "--method", "empty", "--input", str(tmp_path / "x.npy"),
                 "--output", str(out), "--output", str(tmp_path / "z.npy")]) == 0
    assert capsys.readouterr().out == "output 0: float32[0, 3] (empty)\noutput 1: float32[0, 3] (empty)\n"
    assert np.load(out).shape == (0, 3)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--runs", "0"], "argument --runs: must be at least 1, got 0"),
    (["bench", "--runs", "-3"], "argument --runs: must be at least 1, got -3"),
    (["bench", "--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    (["bench", "--runs", "many"], "argument --runs: 'many' is not a whole number"),
    (["profile", "--seconds", "nan"], "argument --seconds: must be positive, got nan"),
    (["profile", "--seconds", "-1"], "argument --seconds: must be positive, got -1"),
    (["profile", "--top", "-1"], "argument --top: must be at least 0, got -1"),
    (["serve", "--replicas", "0"], "argument --replicas: must be at least 1, got 0"),
    (["serve", "--port", "70000"], "argument --port: must be a TCP port, 0 to 65535, got 70000"),
    (["serve", "--max-batch-size", "0"], "argument --max-batch-size: must be at least 1, got 0"),
])
def test_counts_are_checked_before_anything_runs(small_program_path, argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main([argv[0], str(small_program_path), *argv[1:]])
    assert exit.value.code == 2
    assert f"onecopy {argv[0]}: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["ls", "verify", "clear"])
def test_cache_commands_refuse_a_cache_dir_that_does_not_exist_and_create_nothing(action, tmp_path, capsys,
                                                                                isolated_cache):
    typo = tmp_path / "typo" / "cache"
    assert main(["cache", action, "--cache-dir", str(typo)]) == 2
    assert capsys.readouterr().err == (
        f"onecopy cache: error: --cache-dir '{typo}' does not exist; nothing was read or created. Check the path, "
        f"or leave --cache-dir out to use the default, '{isolated_cache}' ($ONECOPY_CACHE_DIR).\n")
    assert not (tmp_path / "typo").exists()
    assert main(["cache", action, "--cache-dir", str(tmp_path)]) == 0  # one that exists: as before


def test_export_refuses_a_method_named_twice(tmp_path, capsys):
    assert main(["export", "tests.conftest:small_builtin", "--method", "forward=1x64", "--method", "forward=2x64",
                 "-o", str(tmp_path / "x.onecopy")]) == 2
    assert capsys.readouterr().err == (
        "onecopy export: error: --method 'forward' is given twice ('forward=1x64' and 'forward=2x64'); give each "
        "method name once (export another shape under another name, e.g. forward2=...).\n")
    assert not (tmp_path / "x.onecopy").exists()


@pytest.mark.parametrize("model, method, shapes, torch_message", [
    ("tests.conftest:small_builtin", "forward=1x32", "float32[1, 32]", "RuntimeError: "),  # width 64
    ("tests.conftest:TwoInTwoOut", "forward=1x32", "float32[1, 32]", "TypeError: missing a required argument: 'y'"),
])
def test_export_reports_a_model_that_does_not_take_the_shapes_given(model, method, shapes, torch_message, tmp_path,
                                                                    capfd):
    assert main(["export", model, "--method", method, "-o", str(tmp_path / "x.onecopy")]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"onecopy export: error: Method 'forward' (--method {method}): torch.export could not trace "
                          f"'{model}' with example inputs ({shapes}): {torch_message}")
    assert err.endswith("Give --method the shapes (and number) of inputs the model's forward takes.\n")
    assert "Traceback" not in err
    assert not (tmp_path / "x.onecopy").exists()


def broken_factory():
    raise ValueError("no checkpoint at /models/x")


def test_export_reports_a_model_factory_that_fails_with_its_message(tmp_path, capsys):
    assert main(["export", "tests.test_cli:broken_factory", "--method", "forward=1x64",
                 "-o", str(tmp_path / "x.onecopy")]) == 2
    assert capsys.readouterr().err == (
        "onecopy export: error: 'tests.test_cli:broken_factory' raised ValueError building the model: no checkpoint "
        "at /models/x (run with -v for its traceback)\n")
    assert not (tmp_path / "x.onecopy").exists()
