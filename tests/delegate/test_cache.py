import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from onecopy import Runtime
from onecopy.cli import main as cli
from onecopy.delegate.cache import open_cache
from onecopy.delegate.page_map import HUGE_PAGE
from onecopy.errors import DelegateError, InvalidArgument
from onecopy.export import Partitioner, export_program
from onecopy.models import builtin_methods, builtin_model
from tests.delegate import huge_probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mf_program(small_methods, tmp_path_factory):
    program = export_program(small_methods, partitioner=Partitioner(multifunction=True))
    return program.save(tmp_path_factory.mktemp("cache-programs") / "mf.onecopy")


def program_of_width(width: int, directory: Path) -> Path:
    model = builtin_model(width=width, layers=1)
    return export_program(builtin_methods(model, batches={"forward": 1}, width=width)).save(directory / f"w{width}.onecopy")


def load_all(path, runtime_cache_dir, **options):
    program = Runtime(cache_dir=runtime_cache_dir).load_program(path, backend_options={"IreeBackend": options} if options else None)
    methods = [program.load_method(name) for name in program.method_names]
    return program, methods


def child(program, cache_dir, *extra, env=None, wait=True):
    cmd = [sys.executable, "-m", "tests.delegate.load_child", str(program), str(cache_dir), *extra]
    full_env = {**os.environ, **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_one_specialization_serves_every_delegate_and_process(mf_program, tmp_path, states):
    program, methods = load_all(mf_program, tmp_path)
    assert states() == ["specialized", "restored"]  # forward_0 specializes, prefill_0 restores the same entry
    expected = [float(m.execute([np.ones([int(d) for d in m.method_meta.inputs[0].shape], np.float32)])[0].sum())
                for m in methods]
    program.close()
    assert len(open_cache(tmp_path).ls()) == 1
    for _ in range(2):  # fresh processes restore and never compile
        out = child(mf_program, tmp_path, env={"ONECOPY_FORBID_SPECIALIZE": "1"})
        assert out["states"] == ["restored", "restored"]
        assert out["sums"] == pytest.approx(expected, rel=1e-6)
    # 2 uses here (the restore after publishing, prefill), 2 per child: written at exit, or before any read
    assert open_cache(tmp_path).ls()[0].hits == 6


def test_forbid_hook_fails_an_unexpected_compile(mf_program, tmp_path, monkeypatch):
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")
    with pytest.raises(DelegateError, match="specialization is forbidden"):
        load_all(mf_program, tmp_path)
    assert open_cache(tmp_path).ls() == []


def test_symlinked_cache_dir_is_the_same_cache(mf_program, tmp_path, states, monkeypatch):
    real = tmp_path / "real"
    alias = tmp_path / "alias"
    real.mkdir()
    alias.symlink_to(real, target_is_directory=True)
    assert open_cache(real) is open_cache(alias)
    assert open_cache(real).identity == open_cache(alias).identity
    load_all(mf_program, real)[0].close()
    monkeypatch.setenv("ONECOPY_FORBID_SPECIALIZE", "1")
    load_all(mf_program, alias)[0].close()
    assert states() == ["specialized", "restored", "restored", "restored"]
    out = child(mf_program, alias, env={"ONECOPY_FORBID_SPECIALIZE": "1"})
    assert out["states"] == ["restored", "restored"]


def test_restored_weights_are_mapped_on_huge_pages_where_the_kernel_can(tmp_path):
    if not huge_probe.file_pages_map_huge(tmp_path):
        pytest.skip(huge_probe.SKIP_REASON)
    model = builtin_model(width=1024, layers=2)  # 8 MiB of weights, packed for this CPU at specialization
    path = export_program(builtin_methods(model, batches={"forward": 1}, width=1024)).save(tmp_path / "w.onecopy")
    for _ in range(2):  # specialized (published, then mapped back), then restored by a fresh load
        program, (method,) = load_all(path, tmp_path / "cache")
        (delegate,) = method._delegates.values()
        assert delegate.model.encoded_bytes >= 8 << 20
        # Every whole huge page of the packed weights but the edges of the parameter's range
        assert delegate.model.huge_page_bytes() >= delegate.model.encoded_bytes - 2 * HUGE_PAGE
        program.close()


def _entry_module(cache_dir: Path) -> Path:
    (entry,) = (cache_dir / "v1" / "entries").iterdir()
    return entry / "module.vmfb"


def test_entry_holds_the_weights_encoded_once_for_this_machine(mf_program, tmp_path):
    load_all(mf_program, tmp_path)[0].close()
    entry = _entry_module(tmp_path).parent
    meta = json.loads((entry / "entry.json").read_text())
    assert meta["encoded"], "data tiling packs the weights: the entry must carry them packed"
    stored = (entry / "encoded.bin").stat().st_size
    assert stored == meta["files"]["encoded.bin"]["size"] > 0
    # The encoder packs each weight once per function (forward_0, prefill_0): identical pages are stored once
    # (page-granular: the built-in model's 4 MiB weights halve exactly; these small ones share what aligns).
    (parameter,) = meta["encoded"]
    assert stored < parameter["size"]
    pages = {fpage + i for _, fpage, count in parameter["runs"] for i in range(count)}
    assert pages == set(range(stored // 4096))
    assert open_cache(tmp_path).ls()[0].size == sum(f["size"] for f in meta["files"].values())


@pytest.mark.parametrize("damage", ["truncate", "flip", "flip_encoded", "delete_meta"])
def test_corrupted_entry_heals_with_a_warning(mf_program, tmp_path, states, caplog, damage):
    load_all(mf_program, tmp_path)[0].close()
    module = _entry_module(tmp_path)
    data = module.read_bytes()
    if damage == "truncate":
        module.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        module.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "flip_encoded":
        encoded = module.parent / "encoded.bin"
        blob = bytearray(encoded.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        encoded.write_bytes(bytes(blob))
    else:
        (module.parent / "entry.json").unlink()
    program, methods = load_all(mf_program, tmp_path)
    (y,) = methods[0].execute([np.ones((1, 64), np.float32)])
    program.close()
    assert states() == ["specialized", "restored", "specialized", "restored"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("is corrupted" in w and "specializing again" in w for w in warnings)
    assert _entry_module(tmp_path).read_bytes() == data
    assert np.isfinite(y).all()


def test_a_cache_emptied_by_hand_while_the_process_runs_specializes_again(mf_program, tmp_path, states):
    """`rm -rf $ONECOPY_CACHE_DIR/*` under a running process (a server): its cache instance outlives the folders,
    and its next miss failed on the missing tmp/ with an error saying the program may be damaged."""
    import shutil

    load_all(mf_program, tmp_path)[0].close()
    for path in tmp_path.iterdir():
        shutil.rmtree(path)
    program, methods = load_all(mf_program, tmp_path)
    (y,) = methods[0].execute([np.ones((1, 64), np.float32)])
    program.close()
    assert states() == ["specialized", "restored", "specialized", "restored"]
    assert np.isfinite(y).all() and _entry_module(tmp_path).exists()


def test_weights_that_passed_a_full_check_are_not_rehashed_until_something_writes_them(
    mf_program, tmp_path, states, caplog, monkeypatch
):
    import onecopy.delegate.cache_publish as cache_module

    monkeypatch.setattr(cache_module, "_SETTLE_S", -1.0)  # a stamp counts as settled at once (no 2 s wait here)
    hashed: list[int] = []
    checksum = cache_module._checksum
    monkeypatch.setattr(cache_module, "_checksum", lambda data: hashed.append(len(data)) or checksum(data))
    load_all(mf_program, tmp_path)[0].close()  # forward specializes (its restore checks every byte), prefill restores
    encoded = _entry_module(tmp_path).parent / "encoded.bin"
    size = encoded.stat().st_size
    module_size = _entry_module(tmp_path).stat().st_size
    # publish checksums both files; the restore right after it checks both again and records the stamp
    assert hashed == [module_size, size, module_size, size, module_size]
    hashed.clear()
    program, methods = load_all(mf_program, tmp_path)
    (expected,) = methods[0].execute([np.ones((1, 64), np.float32)])
    program.close()
    assert hashed == [module_size, module_size]  # both restores: the module checked, the unchanged weights not
    with open(encoded, "r+b") as f:  # one bit, in place: same size, same inode; ctime moves
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x01]))
    hashed.clear()
    program, methods = load_all(mf_program, tmp_path)
    (y,) = methods[0].execute([np.ones((1, 64), np.float32)])
    program.close()
    assert states() == ["specialized", "restored", "restored", "restored", "specialized", "restored"]
    assert size in hashed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checksum mismatch in encoded.bin" in w for w in warnings)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("point", ["compile", "publish"])
def test_process_killed_mid_specialization_leaves_no_entry(mf_program, tmp_path, point, states):
    marker = tmp_path / "marker"
    cache_dir = tmp_path / "cache"
    system_tmp = tmp_path / "system-tmp"  # the child's own: other processes on the machine use the real one
    system_tmp.mkdir()
    proc = child(mf_program, cache_dir, "--hang-at", point, "--marker", str(marker), wait=False,
                 env={"TMPDIR": str(system_tmp)})
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert list((cache_dir / "v1" / "entries").iterdir()) == []
    # What the killed process was writing is in the cache's tmp/ (the compiler's encoder output, or the entry
    # being published), nowhere else, and named for the process.
    leftovers = [p.name for p in (cache_dir / "v1" / "tmp").iterdir()]
    kind = "entry" if point == "publish" else "specialize"
    assert len(leftovers) == 1 and leftovers[0].startswith(f"{kind}-{proc.pid}-"), leftovers
    assert list(system_tmp.iterdir()) == []
    load_all(mf_program, cache_dir)[0].close()  # the lock died with the process: no wait, no error
    assert states() == ["specialized", "restored"]
    assert len(open_cache(cache_dir).ls()) == 1
    assert list((cache_dir / "v1" / "tmp").iterdir()) == []  # swept: its process is gone


def test_racing_processes_on_a_cold_key_compile_once(mf_program, tmp_path):
    procs = [child(mf_program, tmp_path, wait=False) for _ in range(3)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    all_states = [s for out in outs for s in out["states"]]
    assert all_states.count("specialized") == 1
    assert all_states.count("restored") == 5
    assert all(out["sums"] == outs[0]["sums"] for out in outs)


def test_eviction_keeps_the_cache_under_its_limit_and_spares_open_entries(tmp_path, states):
    programs = [program_of_width(w, tmp_path) for w in (32, 48, 80)]
    cache_dir = tmp_path / "cache"
    first, _ = load_all(programs[0], cache_dir)  # stays open: its entry is in use
    size = open_cache(cache_dir).total_bytes()
    limit = int(size * 1.5)  # room for one entry only
    load_all(programs[1], cache_dir, max_cache_bytes=limit)[0].close()
    cache = open_cache(cache_dir)
    assert len(cache.ls()) == 2  # over the limit, but the first is open: never evicted
    load_all(programs[2], cache_dir, max_cache_bytes=limit)[0].close()
    kept = {e.program for e in cache.ls()}
    assert kept == {str(programs[0]), str(programs[2])}  # the LRU unused one (programs[1]) went
    first.close()
    load_all(programs[1], cache_dir, max_cache_bytes=limit)[0].close()
    assert cache.total_bytes() <= limit
    assert {e.program for e in cache.ls()} == {str(programs[1])}


def test_old_tmp_leftovers_are_swept(tmp_path):
    cache = open_cache(tmp_path)
    stale = cache.tmp / "stale.abc"
    fresh = cache.tmp / "fresh.abc"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 2 * 24 * 3600
    os.utime(stale, (old, old))
    cache.sweep_tmp()
    assert not stale.exists() and fresh.exists()


def test_leftovers_of_a_dead_process_are_swept_at_once_and_a_live_ones_kept(tmp_path):
    cache = open_cache(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dead = cache.tmp / f"specialize-{dead_pid}-abc"
    live = cache.tmp / f"specialize-{os.getppid()}-abc"  # a process that runs (this one's parent)
    mine = cache.tmp / f"entry-{os.getpid()}-abc"
    for path in (dead, live, mine):
        path.mkdir()
        (path / "encoder.mlir").write_bytes(b"x")
    cache.sweep_tmp()
    assert not dead.exists() and live.exists() and mine.exists()


def test_disabled_cache_specializes_every_time(mf_program, tmp_path, states, monkeypatch):
    monkeypatch.setenv("ONECOPY_DISABLE_CACHE", "1")
    load_all(mf_program, tmp_path / "c")[0].close()
    assert states() == ["specialized", "specialized"]
    assert not (tmp_path / "c").exists()


def test_cache_dir_option_overrides_the_runtime(mf_program, tmp_path, states):
    load_all(mf_program, tmp_path / "runtime-dir", cache_dir=str(tmp_path / "option-dir"))[0].close()
    assert (tmp_path / "option-dir" / "v1" / "entries").exists()
    assert not (tmp_path / "runtime-dir").exists()


def test_bad_cache_dir_is_a_clear_error(mf_program, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidArgument, match=r"Cache directory '.*file/cache' cannot be created or written .*pass a writable cache_dir"):
        load_all(mf_program, blocker / "cache")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cache_dir": 3}, "option 'cache_dir' expects str, got int"),
        ({"max_cache_bytes": "1G"}, "option 'max_cache_bytes' expects int, got str"),
        ({"max_cache_bytes": True}, "option 'max_cache_bytes' expects int, got bool"),
    ],
)
def test_cache_option_types(mf_program, options, message):
    with pytest.raises(InvalidArgument, match=message):
        Runtime().load_program(mf_program, backend_options={"IreeBackend": options})


def test_negative_cache_limit_is_refused(mf_program, tmp_path):
    with pytest.raises(InvalidArgument, match="max_cache_bytes must be positive"):
        load_all(mf_program, tmp_path, max_cache_bytes=-1)


def test_cache_cli(mf_program, tmp_path, capsys):
    load_all(mf_program, tmp_path)[0].close()
    assert cli(["cache", "path", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert cli(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mlir" in out and "cpu" in out and str(mf_program) in out and "1 entries" in out
    assert cli(["cache", "verify", "--cache-dir", str(tmp_path)]) == 0
    assert "1 entries whole, 0 removed" in capsys.readouterr().out
    module = _entry_module(tmp_path)
    module.write_bytes(module.read_bytes()[:10])
    assert cli(["cache", "verify", "--cache-dir", str(tmp_path)]) == 1
    assert "truncated" in capsys.readouterr().out
    load_all(mf_program, tmp_path)[0].close()
    assert cli(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert open_cache(tmp_path).ls() == []


def test_metadata_update_is_whole_keeps_the_files_checked_and_misses_a_gone_entry(mf_program, tmp_path):
    load_all(mf_program, tmp_path)[0].close()
    cache = open_cache(tmp_path)
    (key,) = [e.key for e in cache.ls()]
    meta_path = cache.entry_dir(key) / "entry.json"
    before = json.loads(meta_path.read_text())
    # An update may add what the entry says; never what it is made of (sizes, checksums, key).
    new = cache.update_meta(key, lambda meta: {**meta, "note": "x", "files": {}, "key": "other"})
    assert new == {**before, "note": "x"} == json.loads(meta_path.read_text())
    assert list(cache.tmp.iterdir()) == []
    assert cli(["cache", "verify", "--cache-dir", str(tmp_path)]) == 0  # still whole
    cache.clear()
    assert cache.update_meta(key, lambda meta: pytest.fail("updated a removed entry")) is None


def test_an_empty_cache_dir_is_refused_not_the_working_directory(tmp_path, monkeypatch):
    # Path("") is "."; the cache went silently into the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="empty path"):
        open_cache("")
    with pytest.raises(InvalidArgument, match="names no directory"):
        Runtime(cache_dir="")
    assert list(tmp_path.iterdir()) == []


def test_a_relative_cache_dir_stays_where_it_was_opened_after_a_chdir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cache = open_cache("cache")
    runtime = Runtime(cache_dir="cache")
    monkeypatch.chdir(tmp_path / "b")
    assert cache.verify() == [] and cache.clear() == 0  # raised FileNotFoundError: b/cache/v1/entries
    assert cache.directory == runtime.cache_dir == tmp_path / "a" / "cache"
    assert not (tmp_path / "b" / "cache").exists()


def test_verify_gives_whole_entries_missing_from_the_index_their_row_again(mf_program, tmp_path):
    """An index rebuilt after damage (or deleted by hand) had no rows for the entries on disk: `cache ls` missed
    them and eviction never counted them."""
    program, _ = load_all(mf_program, tmp_path)
    program.close()
    cache = open_cache(tmp_path)
    (before,) = cache.ls()
    cache.index.forget(before.key)  # as a rebuilt index has it
    assert cache.ls() == []
    assert cache.verify() == []
    (after,) = cache.ls()
    assert (after.key, after.size, after.program, after.target) == (before.key, before.size, before.program,
                                                                     before.target)
