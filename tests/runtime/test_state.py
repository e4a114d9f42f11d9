"""State: prefill + decode share a cache kept in the engine, updated in place; States are independent."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from onecopy import ExecutionError, InvalidArgument, Runtime, State
from tests.conftest import Accumulator


class Eager:
    """The Accumulator in torch eager: the reference of one state."""

    def __init__(self, model: Accumulator) -> None:
        self.model = copy.deepcopy(model)

    def __call__(self, x: np.ndarray, pos: np.ndarray):
        with torch.no_grad():
            out, steps = self.model(torch.from_numpy(x), torch.from_numpy(pos))
        return out.numpy(), steps.numpy()


def rows(rng, n):
    return rng.standard_normal((n, 16), dtype=np.float32)


@pytest.fixture(params=["parallel", "inline"])
def prog(stateful_program, request):
    """The stateful program on each CPU executor: which one the default picks depends on timings, so both are
    tested explicitly (IREE's workers, and the calling thread)."""
    path, _, _ = stateful_program
    with Runtime().load_program(path, backend_options={"IreeBackend": {"executor": request.param}}) as program:
        yield program


def test_prefill_and_decode_share_the_cache_as_eager_does(prog, accumulator, rng):
    prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
    state = prog.create_state()
    eager = Eager(accumulator)
    x = rows(rng, 2)
    got = prefill.execute([x, np.array([0, 1])], state=state)
    want = eager(x, np.array([0, 1]))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for pos in (2, 3, 5):
        x = rows(rng, 1)
        got = decode.execute([x, np.array([pos])], state=state)
        want = eager(x, np.array([pos]))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert int(got[1]) == int(want[1])
    np.testing.assert_allclose(state.read("cache"), eager.model.cache.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.read("total"), eager.model.total.numpy(), rtol=1e-5, atol=1e-5)
    assert int(state.read("steps")) == 4


def test_no_state_bytes_cross_into_python_per_call(prog, rng):
    decode = prog.load_method("decode")
    state = prog.create_state()
    x, pos = rows(rng, 1), np.array([0])
    outputs = decode.execute([x, pos], state=state)
    stats = decode.last_copy_stats
    assert stats.copied_in == x.nbytes + pos.nbytes  # the inputs, never the cache
    assert stats.copied_out == sum(o.nbytes for o in outputs)


def test_the_inputs_and_outputs_are_the_users_only(prog):
    meta = prog.load_method("decode").method_meta
    assert [list(t.shape) for t in meta.inputs] == [[1, 16], [1]]
    assert [list(t.shape) for t in meta.outputs] == [[1, 16], []]
    assert sorted(prog.state_names) == ["cache", "steps", "total"]


def test_states_are_independent_and_the_default_is_its_own(prog, rng):
    decode = prog.load_method("decode")
    a, b = prog.create_state(), prog.create_state()
    x = rows(rng, 1)
    for _ in range(3):
        decode.execute([x, np.array([0])], state=a)
    decode.execute([x, np.array([1])], state=b)
    decode.execute([x, np.array([1])])  # the program's default state
    decode.execute([x, np.array([1])])
    assert int(a.read("steps")) == 3 and int(b.read("steps")) == 1
    assert int(prog.default_state.read("steps")) == 2
    assert not b.read("cache")[0].any() and a.read("cache")[0].any()


def test_reset_restores_initial_values_zeros_and_nonzero(prog, rng):
    decode = prog.load_method("decode")
    state = prog.create_state()
    np.testing.assert_array_equal(state.read("total"), np.ones(16, np.float32))  # before any call
    decode.execute([rows(rng, 1), np.array([4])], state=state)
    assert state.read("cache").any() and not np.array_equal(state.read("total"), np.ones(16, np.float32))
    state.reset()
    assert not state.read("cache").any() and int(state.read("steps")) == 0
    np.testing.assert_array_equal(state.read("total"), np.ones(16, np.float32))


def test_copy_forks_after_a_shared_prompt(prog, rng):
    prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
    state = prog.create_state()
    prefill.execute([rows(rng, 2), np.array([0, 1])], state=state)
    fork = state.copy()
    x1, x2 = rows(rng, 1), rows(rng, 1)
    a = decode.execute([x1, np.array([2])], state=state)[0]
    b = decode.execute([x2, np.array([2])], state=fork)[0]
    c = decode.execute([x2, np.array([3])], state=fork.copy())[0]  # a copy of a state that ran
    assert not np.allclose(a, b)
    assert int(state.read("steps")) == 2 and int(fork.read("steps")) == 2
    assert not np.allclose(b, c)


def test_copy_module_copies_fork_and_pickle_is_refused_clearly(prog, rng):
    """`copy.copy(state)` gave a second object over the same engine storage: its calls updated the original."""
    import pickle

    decode = prog.load_method("decode")
    state = prog.create_state()
    decode.execute([rows(rng, 1), np.array([0])], state=state)
    for fork in (copy.copy(state), copy.deepcopy(state)):
        assert fork is not state and int(fork.read("steps")) == 1
        decode.execute([rows(rng, 1), np.array([1])], state=fork)
        assert int(fork.read("steps")) == 2 and int(state.read("steps")) == 1
    with pytest.raises(InvalidArgument, match="cannot be pickled.*state.save\\(path\\).*program.load_state"):
        pickle.dumps(state)


def test_save_and_load_round_trip(prog, rng, tmp_path):
    prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
    state = prog.create_state()
    prefill.execute([rows(rng, 2), np.array([0, 1])], state=state)
    path = state.save(tmp_path / "chat.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["chat.npz"]  # written atomically: no temp file left
    loaded = prog.load_state(path)
    for name in state.names():
        np.testing.assert_array_equal(loaded.read(name), state.read(name))
    x = rows(rng, 1)
    np.testing.assert_allclose(decode.execute([x, np.array([2])], state=loaded)[0],
                               decode.execute([x, np.array([2])], state=state)[0], rtol=1e-6)


def test_load_refuses_a_file_of_other_states(prog, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, s0=np.zeros(3, np.float32), __names__=np.array(["cache"]))
    with pytest.raises(InvalidArgument, match="holds states \\['cache'\\]"):
        prog.load_state(bad)
    state = prog.create_state()
    names = state.names()
    values = {f"s{i}": state.read(n) for i, n in enumerate(names)}
    values[f"s{names.index('cache')}"] = np.zeros((4, 16), np.float32)
    np.savez(bad, __names__=np.array(names), **values)
    with pytest.raises(InvalidArgument, match="state 'cache' is \\[8, 16\\] float32, got \\[4, 16\\] float32"):
        prog.load_state(bad)
    with pytest.raises(InvalidArgument, match="does not exist"):
        prog.load_state(tmp_path / "missing.npz")
    np.save(tmp_path / "array.npy", np.zeros(3, np.float32))  # np.load gives an array, not an archive
    (tmp_path / "junk.npz").write_bytes(b"not an archive")  # np.load tries pickle and hints at unpickling it
    for path in (tmp_path / "array.npy", tmp_path / "junk.npz"):
        with pytest.raises(InvalidArgument, match="is not a state saved by State.save: it is not the .npz archive"):
            prog.load_state(path)


def test_a_state_of_another_program_is_refused(stateful_program, prog, rng):
    path, _, _ = stateful_program
    with Runtime().load_program(path) as other:
        foreign = other.create_state()
        with pytest.raises(InvalidArgument, match="belongs to another program"):
            prog.load_method("decode").execute([rows(rng, 1), np.array([0])], state=foreign)
    with pytest.raises(InvalidArgument, match="takes an onecopy State"):
        prog.load_method("decode").execute([rows(rng, 1), np.array([0])], state="default")


def test_a_state_used_after_its_program_closed_is_an_error(stateful_program, rng):
    path, _, _ = stateful_program
    program = Runtime().load_program(path)
    decode = program.load_method("decode")
    state = program.create_state()
    decode.execute([rows(rng, 1), np.array([0])], state=state)
    program.close()
    with pytest.raises(ExecutionError, match="closed"):
        state.read("cache")
    with pytest.raises(ExecutionError, match="closed"):
        decode.execute([rows(rng, 1), np.array([0])], state=state)


def test_calls_on_one_state_are_serialized_and_states_run_in_parallel(prog, rng):
    decode = prog.load_method("decode")
    shared = prog.create_state()
    own = [prog.create_state() for _ in range(2)]
    x = rows(rng, 1)
    errors = []

    def work(i):
        try:
            for _ in range(20):
                decode.execute([x, np.array([i])], state=shared)
                decode.execute([x, np.array([i])], state=own[i])
        except Exception as e:  # reported below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert int(shared.read("steps")) == 40  # no update lost
    assert [int(s.read("steps")) for s in own] == [20, 20]


def test_a_shared_model_shares_weights_never_state(stateful_program, rng):
    path, _, multifunction = stateful_program
    options = {"IreeBackend": {"share_multifunction_model": True}}
    if not multifunction:  # the option is refused with the reason; there is no shared model to check
        with pytest.raises(InvalidArgument, match=r"share_multifunction_model=True needs a program exported with "
                                                  r"Partitioner\(multifunction=True\)"):
            Runtime().load_program(path, backend_options=options).load_method("decode")
        return
    with Runtime().load_program(path, backend_options=options) as p1, \
            Runtime().load_program(path, backend_options=options) as p2:
        d1, d2 = p1.load_method("decode"), p2.load_method("decode")
        assert next(iter(d1._delegates.values())).model is next(iter(d2._delegates.values())).model
        x = rows(rng, 1)
        d1.execute([x, np.array([0])])
        assert int(p1.default_state.read("steps")) == 1 and int(p2.default_state.read("steps")) == 0


def test_state_is_refused_by_a_method_without_state(small_program_path):
    with Runtime().load_program(small_program_path) as program:
        method = program.load_method("forward")
        with pytest.raises(InvalidArgument, match="keeps no state"):
            program.create_state()
        with pytest.raises(InvalidArgument, match="keeps no state"):
            method.execute([np.zeros((1, 64), np.float32)], state=object())


def test_write_checks_shape_and_dtype(prog):
    state = prog.create_state()
    with pytest.raises(InvalidArgument, match="state 'steps' is \\[\\] int64, got \\[\\] int32"):
        state.write("steps", np.int32(3))
    state.write("steps", np.int64(7))
    assert int(state.read("steps")) == 7
    with pytest.raises(InvalidArgument, match="has no state 'nope'"):
        state.read("nope")
    assert isinstance(state, State)


def test_a_dynamic_prefill_updates_state_at_every_size(accumulator, rng):
    from onecopy.export import CompileSpec, export_program

    tokens = torch.export.Dim("T", min=1, max=8)
    ep = torch.export.export(accumulator, (torch.zeros(2, 16), torch.tensor([0, 1])),
                             dynamic_shapes=({0: tokens}, {0: tokens}))
    program = export_program({"prefill": ep}, compile_spec=CompileSpec(packaging="mlir"))
    eager = Eager(accumulator)
    with Runtime().load_program(program.to_bytes()) as prog:
        prefill = prog.load_method("prefill")
        for n, start in ((3, 0), (1, 3), (4, 4)):
            x, pos = rows(rng, n), np.arange(start, start + n)
            got, want = prefill.execute([x, pos]), eager(x, pos)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
            assert int(got[1]) == int(want[1])
        np.testing.assert_allclose(prog.default_state.read("cache"), eager.model.cache.numpy(), rtol=1e-5, atol=1e-5)


def test_a_position_past_the_cache_is_refused(prog, rng):
    # IREE does not check scatter indices: unguarded, this wrote past the cache and corrupted the heap. The
    # position reaches the cache's index_put as it is, so export recorded its bounds (torch's: -8 is row 0).
    decode = prog.load_method("decode")
    state = prog.create_state()
    x = rows(rng, 1)
    with pytest.raises(ExecutionError, match=r"Input 1 of method 'decode' holds 8003, outside \[-8, 7\].*"
                                             r"Start a new state"):
        decode.execute([x, np.array([8 * 1000 + 3])], state=state)


def test_a_position_past_the_cache_wraps_in_the_engine_instead_of_writing_past_it(accumulator, rng):
    """The engine's own guard, for an index no input check sees: the program without its recorded bounds."""
    import msgspec

    from onecopy.export import export_program
    from onecopy.program.file import ProgramFile
    from tests.conftest import accumulator_methods

    program = export_program(accumulator_methods(accumulator))
    assert all(m.input_bounds == {1: [-8, 7]} for m in program.definition.methods)
    x = rows(rng, 1)
    unchecked = ProgramFile(msgspec.structs.replace(program.definition, methods=[
        msgspec.structs.replace(m, input_bounds={}) for m in program.definition.methods]), program.data)
    with Runtime().load_program(unchecked.to_bytes()) as loaded:
        decode = loaded.load_method("decode")
        state = loaded.create_state()
        for _ in range(50):
            decode.execute([x, np.array([8 * 1000 + 3])], state=state)
        cache = state.read("cache")
    assert cache[3].any() and not np.delete(cache, 3, axis=0).any()


def test_writing_one_state_keeps_the_others(prog, rng):
    decode = prog.load_method("decode")
    state = prog.create_state()
    decode.execute([rows(rng, 1), np.array([2])], state=state)  # the engine holds the state from here on
    cache, total = state.read("cache"), state.read("total")
    state.write("steps", np.int64(41))
    assert int(state.read("steps")) == 41
    np.testing.assert_array_equal(state.read("cache"), cache)
    np.testing.assert_array_equal(state.read("total"), total)
    assert int(decode.execute([rows(rng, 1), np.array([3])], state=state)[1]) == 42


class BreaksBetween(torch.nn.Module):
    """A graph break between a cache update and the ops reading the updated cache (relu on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(64, 16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, self.proj(x))
        h = torch.relu(self.cache.sum(0, keepdim=True))
        self.steps.add_(1)
        return h + self.cache.mean(0, keepdim=True) * self.steps, self.steps.clone()


@pytest.mark.parametrize("multifunction", [True, False], ids=["multifunction", "single"])
def test_a_graph_break_in_a_stateful_method_reads_the_cache_from_the_engine(multifunction, rng):
    from onecopy.export import CompileSpec, Partitioner, export_program

    torch.manual_seed(0)
    model = BreaksBetween()
    methods = {"decode": torch.export.export(model, (torch.zeros(1, 16), torch.tensor([0])))}
    program = export_program(methods, compile_spec=CompileSpec(packaging="mlir"),
                             partitioner=Partitioner(multifunction=multifunction, skip_ops=("aten.relu.default",)))
    assert len([i for i in program.definition.methods[0].instructions if type(i).__name__ == "DelegateCall"]) == 2
    eager = copy.deepcopy(model)
    with Runtime().load_program(program.to_bytes()) as prog:
        decode = prog.load_method("decode")
        for pos in (0, 5, 9):
            x = rows(rng, 1)
            got = decode.execute([x, np.array([pos])])
            with torch.no_grad():
                want = eager(torch.from_numpy(x), torch.tensor([pos]))
            np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-5, atol=1e-5)
            assert int(got[1]) == int(want[1])
        stats = decode.last_copy_stats
        assert stats.copied < 64 * 16 * 4  # the small values around the host op, never the cache
        np.testing.assert_allclose(prog.default_state.read("cache"), eager.cache.numpy(), rtol=1e-5, atol=1e-5)


def test_a_closed_state_says_so(prog, rng):
    state = prog.create_state()
    prog.load_method("decode").execute([rows(rng, 1), np.array([0])], state=state)
    state.close()
    with pytest.raises(ExecutionError, match="This State was closed \\(State.close\\(\\)\\)"):
        prog.load_method("decode").execute([rows(rng, 1), np.array([0])], state=state)


def test_outputs_written_into_caller_storage(prog, rng):
    decode = prog.load_method("decode")
    state, twin = prog.create_state(), prog.create_state()
    x = rows(rng, 1)
    out = np.full((1, 16), np.nan, np.float32)
    got = decode.execute([x, np.array([1])], outputs=[out, None], state=state)
    assert got[0] is out
    np.testing.assert_array_equal(out, decode.execute([x, np.array([1])], state=twin)[0])


def test_a_decode_loop_into_storage_skips_the_checks(prog, rng, monkeypatch):
    """A decode loop writing its results into the same storage every step: after the first step's checks, each
    step goes straight to the engine, as a loop without storage does, and every step's results equal those of a
    twin State run without storage."""
    decode = prog.load_method("decode")
    state, twin = prog.create_state(), prog.create_state()
    out, steps = np.empty((1, 16), np.float32), np.empty((), np.int64)
    x = rows(rng, 1)
    decode.execute([x, np.array([0])], outputs=[out, steps], state=state)
    decode.execute([x, np.array([0])], state=twin)
    monkeypatch.setattr(type(decode), "_arguments", lambda *a: pytest.fail("the checks ran again"))
    for pos in range(1, 5):
        x = rows(rng, 1)
        got = decode.execute([x, np.array([pos])], outputs=[out, steps], state=state)
        assert got[0] is out and got[1] is steps
        want = decode.execute([x, np.array([pos])], state=twin)
        np.testing.assert_array_equal(out, want[0])
        assert int(steps) == int(want[1]) == pos + 1
    np.testing.assert_array_equal(state.read("cache"), twin.read("cache"))


def test_share_state_false_keeps_the_methods_cache_apart_at_run_time(accumulator, rng):
    from tests.conftest import accumulator_methods
    from onecopy.export import CompileSpec, Partitioner, export_program

    program = export_program(accumulator_methods(accumulator), compile_spec=CompileSpec(packaging="mlir"),
                             partitioner={"prefill": Partitioner(multifunction=True),
                                          "decode": Partitioner(multifunction=True, share_state=False)})
    with Runtime().load_program(program.to_bytes()) as prog:
        prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
        state = prog.create_state()
        prefill.execute([rows(rng, 2), np.array([0, 1])], state=state)
        decode.execute([rows(rng, 1), np.array([5])], state=state)
        assert int(state.read("steps")) == 1 and int(state.read("decode.steps")) == 1
        assert state.read("cache")[:2].any() and not state.read("cache")[5].any()
        assert state.read("decode.cache")[5].any() and not state.read("decode.cache")[:2].any()


@pytest.mark.parametrize("storage", [False, True], ids=["returned", "into-storage"])
def test_a_prepared_call_on_a_state_runs_as_execute_does_and_copies_no_state(prog, rng, storage):
    prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
    state, twin = prog.create_state(), prog.create_state()
    first = rows(rng, 2)
    for s in (state, twin):
        prefill.execute([first, np.array([0, 1])], state=s)
    x, pos = rows(rng, 1), np.array([2])
    out = np.full((1, 16), np.nan, np.float32) if storage else None
    prepared = decode.prepare([x, pos], outputs=[out, None] if storage else None, state=state)
    for calls, step in enumerate((2, 3, 5), start=2):  # the prefill was call 1
        x[...], pos[...] = rows(rng, 1), step  # a run reads what the prepared arrays hold now
        got = prepared.run()
        want = decode.execute([x.copy(), pos.copy()], state=twin)
        np.testing.assert_array_equal(got[0], want[0])
        assert int(got[1]) == int(want[1]) == calls
        stats = prepared.last_copy_stats
        assert stats.copied_in == x.nbytes + pos.nbytes  # the inputs, never the cache
        assert stats.copied_out == sum(o.nbytes for o in want)
        if storage:
            assert got[0] is out
    for name in prog.state_names:
        np.testing.assert_array_equal(state.read(name), twin.read(name))


def test_a_prepared_call_takes_the_default_state_and_refuses_what_execute_refuses(stateful_program, prog, rng):
    decode = prog.load_method("decode")
    x, pos = rows(rng, 1), np.array([0])
    (got, steps) = decode.prepare([x, pos]).run()
    assert int(steps) == 1 and int(prog.default_state.read("steps")) == 1
    with Runtime().load_program(stateful_program[0]) as other:
        with pytest.raises(InvalidArgument, match="belongs to another program"):
            decode.prepare([x, pos], state=other.create_state())
    state = prog.create_state()
    prepared = decode.prepare([x, np.array([0])], state=state)
    state.close()
    with pytest.raises(ExecutionError, match="This State was closed"):
        prepared.run()
