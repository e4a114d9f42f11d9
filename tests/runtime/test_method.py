import gc
import threading

import msgspec
import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.export import export_program
from onecopy.errors import ExecutionError, InvalidArgument
from onecopy.runtime.method_meta import dim_value
from onecopy.program import DelegateDef, ProgramFile
from onecopy.runtime import Backend, DelegateHandle, InitContext, register_backend
from tests.conftest import eager


@pytest.fixture(scope="module")
def loaded(small_program_path):
    program = Runtime().load_program(small_program_path)
    yield program
    program.close()


@pytest.fixture(scope="module")
def forward(loaded):
    return loaded.load_method("forward")


def test_method_names_and_meta(loaded, forward):
    assert loaded.method_names == ["forward", "prefill"]
    meta = forward.method_meta
    assert meta.name == "forward"
    assert [(t.shape, str(t.dtype), t.memory_planned) for t in meta.inputs] == [((1, 64), "float32", True)]
    assert [(t.shape, str(t.dtype)) for t in meta.outputs] == [((1, 64), "float32")]
    assert meta.instructions == ("delegate_call 0",)
    assert [(d.backend, d.function, d.packaging) for d in meta.delegates] == [("IreeBackend", "main", "mlir")]


def test_unknown_method_lists_the_methods(loaded):
    with pytest.raises(InvalidArgument, match="has no method 'decode'; it has forward, prefill"):
        loaded.load_method("decode")


def test_outputs_are_written_into_caller_storage(forward, small_model, rng):
    x = rng.standard_normal((1, 64), dtype=np.float32)
    out = np.full((1, 64), np.nan, np.float32)
    (y,) = forward.execute([x], outputs=[out])
    assert y is out
    np.testing.assert_allclose(out, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


def test_dlpack_inputs_and_outputs_are_accepted(forward, small_model):
    x = torch.randn(1, 64)
    out = torch.zeros(1, 64)
    forward.execute([x], outputs=[out])
    np.testing.assert_allclose(out.numpy(), eager(small_model, x.numpy())[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ([np.zeros((1, 64), np.float64)], r"Input 0 of method 'forward' has dtype float64; expected float32"),
        ([np.zeros((2, 64), np.float32)], r"Input 0 of method 'forward' has shape \[2, 64\]; expected \[1, 64\]"),
        ([np.zeros((64,), np.float32)], r"has shape \[64\]; expected \[1, 64\]"),
        ([], r"Method 'forward' takes 1 inputs, got 0"),
        ([torch.zeros(1, 64, requires_grad=True)], r"Input 0 of method 'forward' cannot be viewed .* DLPack"),
    ],
)
def test_bad_inputs_are_reported(forward, inputs, message):
    with pytest.raises(ExecutionError, match=message):
        forward.execute(inputs)


def test_bad_output_storage_is_reported(forward):
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ExecutionError, match="has 1 outputs; outputs= gave 2"):
        forward.execute([x], outputs=[None, None])
    readonly = np.zeros((1, 64), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ExecutionError, match="Output 0 of method 'forward' is read-only"):
        forward.execute([x], outputs=[readonly])
    with pytest.raises(ExecutionError, match="Output 0 of method 'forward' has dtype float16"):
        forward.execute([x], outputs=[np.zeros((1, 64), np.float16)])


def test_a_call_shaped_as_a_checked_one_skips_the_checks(small_program_path, small_model, rng, monkeypatch):
    with Runtime().load_program(small_program_path) as program:
        forward = program.load_method("forward")
        first = rng.standard_normal((1, 64), dtype=np.float32)
        forward.execute([first])
        # From now on a call on arrays of that shape and dtype goes straight to the delegate: the first call's
        # checks (`_arguments`) are not run again, and the results are those of the new input.
        monkeypatch.setattr(type(forward), "_arguments", lambda *a: pytest.fail("the checks ran again"))
        for _ in range(3):
            x = rng.standard_normal((1, 64), dtype=np.float32)
            (y,) = forward.execute([x])
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
            assert forward.last_copy_stats.copied_in == x.nbytes and forward.last_copy_stats.copied_out == y.nbytes
        strided = np.repeat(first, 2, axis=1)[:, ::2]  # same shape, other strides: copied densely
        np.testing.assert_allclose(forward.execute((strided,))[0], eager(small_model, first)[0], rtol=1e-5, atol=1e-6)


def test_a_call_into_storage_shaped_as_a_checked_one_skips_the_checks(small_program_path, small_model, rng,
                                                                       monkeypatch):
    """Output storage passed to avoid an allocation per call must not cost more than returning new arrays: a call
    whose inputs and storage have the shapes and dtypes of one that passed the checks goes straight to the
    delegate and writes the storage; storage that would fail the checks (read-only, another dtype) still does."""
    with Runtime().load_program(small_program_path) as program:
        forward = program.load_method("forward")
        out = np.empty((1, 64), np.float32)
        forward.execute([rng.standard_normal((1, 64), dtype=np.float32)], outputs=[out])
        checks = type(forward)._arguments
        monkeypatch.setattr(type(forward), "_arguments", lambda *a: pytest.fail("the checks ran again"))
        for storage in (out, np.empty((1, 64), np.float32)):  # the same storage, or other storage of its kind
            x = rng.standard_normal((1, 64), dtype=np.float32)
            (y,) = forward.execute([x], outputs=[storage])
            assert y is storage
            np.testing.assert_allclose(storage, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
            assert forward.last_copy_stats.copied_in == x.nbytes and forward.last_copy_stats.copied_out == y.nbytes
        monkeypatch.setattr(type(forward), "_arguments", checks)
        x = np.zeros((1, 64), np.float32)
        readonly = np.zeros((1, 64), np.float32)
        readonly.flags.writeable = False
        with pytest.raises(ExecutionError, match="Output 0 of method 'forward' is read-only"):
            forward.execute([x], outputs=[readonly])
        with pytest.raises(ExecutionError, match="Output 0 of method 'forward' has dtype float64"):
            forward.execute([x], outputs=[np.zeros((1, 64), np.float64)])
        assert forward.execute([x], outputs=[None])[0].shape == (1, 64)  # storage for none: the runtime's arrays


def test_a_checked_call_hands_the_delegate_its_inputs_in_its_order_with_constants():

    from onecopy.runtime.backend import RunReport
    from onecopy.runtime.checked_calls import CheckedCall

    class Handle(DelegateHandle):  # the default copied_call: each call an execute
        has_bound_surfaces = False

        def execute(self, inputs, outputs, stats):
            self.seen = (list(inputs), list(outputs))
            return ["result"]

        def destroy(self):
            pass

    local = threading.local()
    method = RunReport(threading.Event(), lambda: None, local, lambda stats, debug: setattr(local, "stats", stats))
    constant = np.arange(4.0)
    a, b, c = np.zeros(2), np.ones(3), np.ones(1)
    templates = tuple(np.broadcast_to(np.zeros(()), x.shape) for x in (a, b, c))
    handle = Handle()
    call = CheckedCall(method, handle, templates, (constant, 2, 0), outputs=2)
    assert call.run([a, b, c]) == ["result"]
    assert handle.seen[0][0] is constant and handle.seen[0][1] is c and handle.seen[0][2] is a
    assert handle.seen[1] == [None, None]
    direct = CheckedCall(method, handle, templates, (0, 1, 2), outputs=1)
    direct.run([a, b, c])
    assert [x is y for x, y in zip(handle.seen[0], (a, b, c))] == [True] * 3
    out = np.empty(5)
    into = CheckedCall(method, handle, templates, (0, 1, 2), outputs=1, out_templates=(out,))
    assert into.run([a, b, c], outs=[out]) == ["result"] and handle.seen[1] == [out]  # the storage, to write
    handle.has_bound_surfaces = True  # bound since: the call must go the checked way
    assert direct.run([a, b, c]) is None


def test_an_iree_checked_call_does_the_methods_bookkeeping_itself(small_program_path, small_model, rng,
                                                                   monkeypatch, caplog):
    """The IREE delegate runs a checked call whole, bookkeeping included, as one closure (engine.copied_call with a
    report): the runtime's own frames around it never run, and results, stats and the debug log are the same."""
    import logging

    from onecopy.runtime.checked_calls import CheckedCall

    monkeypatch.setattr(CheckedCall, "_checked_run", lambda *a, **k: pytest.fail("the runtime's frames ran"))
    with Runtime().load_program(small_program_path) as program:
        forward = program.load_method("forward")
        out = np.empty((1, 64), np.float32)
        forward.execute([rng.standard_normal((1, 64), dtype=np.float32)])  # checked: kept for the next calls
        forward.execute([rng.standard_normal((1, 64), dtype=np.float32)], outputs=[out])
        for storage in (None, out):
            x = rng.standard_normal((1, 64), dtype=np.float32)
            with caplog.at_level(logging.DEBUG, logger="onecopy"):
                (y,) = forward.execute([x], outputs=None if storage is None else [storage])
            assert storage is None or y is storage
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
            stats = forward.last_copy_stats
            assert (stats.copied_in, stats.copied_out, stats.in_place_in) == (x.nbytes, y.nbytes, 0)
            stats.copied_in = -1  # a copy: the next call's stats are not the caller's to change
            assert forward.last_copy_stats.copied_in == x.nbytes
            assert [r.message for r in caplog.records] == [
                f"method forward: copied in {x.nbytes} B, out {y.nbytes} B; in place in 0 B, out 0 B"]
            caplog.clear()


@pytest.mark.parametrize(
    "inputs, message",
    [
        ([np.zeros((1, 64), np.float64)], r"has dtype float64; expected float32"),
        ([np.zeros((1, 64), ">f4")], r"has dtype >f4; expected float32"),
        ([np.zeros((1, 1, 64), np.float32)], r"has shape \[1, 1, 64\]; expected \[1, 64\]"),
        ([np.zeros((1, 64), np.float32)] * 2, r"takes 1 inputs, got 2"),
    ],
)
def test_after_a_checked_call_bad_inputs_are_still_reported(forward, inputs, message):
    forward.execute([np.zeros((1, 64), np.float32)])
    with pytest.raises(ExecutionError, match=message):
        forward.execute(inputs)


def test_a_surface_bound_after_checked_calls_is_read_in_place(small_program_path, small_model, rng):
    from onecopy import Surface

    with Runtime().load_program(small_program_path) as program, Surface.create(1, 64, "float32") as surface:
        forward = program.load_method("forward")
        x = rng.standard_normal((1, 64), dtype=np.float32)
        forward.execute([x])
        forward.execute([x])
        forward.bind_surface(surface)
        frame = surface.array().reshape(1, 64)
        frame[...] = x
        (y,) = forward.execute([frame])
        stats = forward.last_copy_stats
        assert (stats.copied_in, stats.in_place_in) == (0, x.nbytes)
        np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
        forward.execute([x])  # a plain array of that shape is still copied in
        assert forward.last_copy_stats.copied_in == x.nbytes


def test_closed_program_refuses_to_run(small_program_path):
    program = Runtime().load_program(small_program_path)
    method = program.load_method("forward")
    method.execute([np.zeros((1, 64), np.float32)])  # a checked call: the next ones take the short way
    program.close()
    program.close()  # idempotent
    with pytest.raises(ExecutionError, match="belongs to a closed program"):
        method.execute([np.zeros((1, 64), np.float32)])
    with pytest.raises(InvalidArgument, match="is closed; load it again"):
        program.load_method("forward")
    gc.collect()


def test_a_method_keeps_its_program_alive(small_program_path, small_model, rng):
    """`load_program(p).load_method(m)` leaves no reference to the program but the method's: the program must not
    close itself when collected while a method of it can still run."""
    method = Runtime().load_program(small_program_path).load_method("forward")
    gc.collect()
    x = rng.standard_normal((1, 64), dtype=np.float32)
    for _ in range(2):  # the first call is checked, the second takes the short way
        (y,) = method.execute([x])
        np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
    prepared = method.prepare([x])
    del method
    gc.collect()
    np.testing.assert_allclose(prepared.run()[0], eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


def test_a_prepared_call_without_storage_returns_new_arrays_of_what_the_inputs_hold_now(small_program_path,
                                                                                        small_model, rng):
    x = np.zeros((1, 64), np.float32)
    with Runtime().load_program(small_program_path) as program:
        call = program.load_method("forward").prepare([x])
        kept = []
        for _ in range(2):
            x[:] = rng.standard_normal((1, 64), dtype=np.float32)
            (y,) = call.run()
            np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
            kept.append((y, y.copy()))
        (first, first_value), (second, _) = kept
        assert first is not second
        np.testing.assert_array_equal(first, first_value)  # an earlier result is the caller's: untouched
        assert call.last_copy_stats.copied_in == x.nbytes and call.last_copy_stats.copied_out == y.nbytes
    with pytest.raises(ExecutionError, match="belongs to a closed program"):
        call.run()


def test_program_from_bytes(small_program, small_model, rng):
    x = rng.standard_normal((16, 64), dtype=np.float32)
    with Runtime().load_program(small_program.to_bytes()) as program:
        (y,) = program.load_method("prefill").execute([x])
    np.testing.assert_allclose(y, eager(small_model, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("executor", ["parallel", "inline"])
def test_concurrent_calls_on_one_method_are_exact(small_program_path, small_model, rng, executor):
    program = Runtime().load_program(small_program_path, backend_options={"IreeBackend": {"executor": executor}})
    forward = program.load_method("forward")
    xs = [rng.standard_normal((1, 64), dtype=np.float32) for _ in range(4)]
    expected = [eager(small_model, x)[0] for x in xs]
    errors = []

    def worker(i):
        for _ in range(25):
            (y,) = forward.execute([xs[i]])
            if not np.array_equal(y, forward.execute([xs[i]])[0]) or not np.allclose(y, expected[i], atol=1e-5):
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    program.close()
    assert errors == []


class Recording(Backend):
    """A backend that records its init context and doubles its input."""

    name = "RecordingBackend"
    options = {"factor": int, "verbose": bool, "label": str}
    seen: list[InitContext] = []

    def init(self, context, manifest):
        Recording.seen.append(context)
        factor = context.backend_options.get("factor", 2)

        class Handle(DelegateHandle):
            function = manifest["function"]

            def execute(self, inputs, outputs, stats):
                return [inputs[0] * factor]

            def destroy(self):
                pass

        return Handle()


def test_delegate_init_receives_its_context(small_program, tmp_path):
    register_backend(Recording())
    definition = small_program.definition
    delegates = [DelegateDef(backend="RecordingBackend", manifest={"function": "double"}) for _ in definition.delegates]
    path = ProgramFile(msgspec.structs.replace(definition, delegates=delegates), small_program.data).save(tmp_path / "r.onecopy")
    options = {"RecordingBackend": {"factor": 3, "verbose": True, "label": "x"}}
    with Runtime(cache_dir=tmp_path / "cache").load_program(path, backend_options=options) as program:
        method = program.load_method("prefill")
        (y,) = method.execute([np.ones((16, 64), np.float32)])
        assert any(key.startswith("param/") for key in Recording.seen[-1].named_data)
        with pytest.raises(InvalidArgument, match="'double' \\(backend Handle\\) cannot profile its calls"):
            method.profile(seconds=0.1)  # a backend without a profiler of its own: the default refusal
    np.testing.assert_array_equal(y, np.full((16, 64), 3.0))
    context = Recording.seen[-1]
    assert context.method_name == "prefill"
    assert context.backend_options == {"factor": 3, "verbose": True, "label": "x"}
    assert context.method_meta().inputs[0].shape == (16, 64)
    assert context.program_path == path
    with pytest.raises(InvalidArgument, match="option 'verbose' expects bool, got int"):
        Runtime().load_program(path, backend_options={"RecordingBackend": {"verbose": 1}})


class Scale(torch.nn.Module):
    def forward(self, x, s):
        return x * s


def test_a_scalar_input_keeps_its_rank_on_repeated_calls(tmp_path):
    """The repeated (checked) calls copy their inputs in on a path of their own: a 0-d input must stay 0-d there
    too (np.ascontiguousarray makes it 1-d, which the engine refused from the second call on)."""
    ep = torch.export.export(Scale(), (torch.zeros(4), torch.tensor(2.0)))
    path = export_program({"forward": ep}).save(tmp_path / "scale.onecopy")
    with Runtime().load_program(path) as program:
        forward = program.load_method("forward")
        for s in (3.0, 5.0, 7.0):
            (y,) = forward.execute([np.ones(4, np.float32), np.array(s, np.float32)])
            np.testing.assert_array_equal(y, np.full(4, s, np.float32))


def test_load_method_hands_out_the_same_method_with_its_bound_surfaces(small_program_path, small_model, rng):
    from onecopy import Surface

    with Surface.create(1, 64, "float32") as surface:
        program = Runtime().load_program(small_program_path)
        forward = program.load_method("forward")
        forward.bind_surface(surface)
        again = program.load_method("forward")
        assert again is forward and program.load_method("prefill") is not forward
        assert list(again.bound_surfaces) == [surface.name]  # no second set of delegates without the binding
        del forward, again, program
        gc.collect()  # the program only the method held: it stays open for the method
        x = rng.standard_normal((1, 64), dtype=np.float32)
        method = Runtime().load_program(small_program_path).load_method("forward")
        gc.collect()
        np.testing.assert_allclose(method.execute([x])[0], eager(small_model, x)[0], rtol=1e-5, atol=1e-6)
        method._owner.close()  # close() still ends every method it handed out
        with pytest.raises(ExecutionError, match="belongs to a closed program"):
            method.execute([x])


def test_example_inputs_have_the_inputs_shapes_and_are_valid_as_indices(forward):
    from onecopy.runtime.method_meta import MethodMeta, TensorMeta

    (x,) = forward.method_meta.example_inputs()
    assert x.shape == forward.method_meta.inputs[0].shape and x.dtype == np.float32 and x.std() > 0
    meta = MethodMeta("decode", (TensorMeta((1, 1), np.dtype(np.int64), False), TensorMeta(("s0",), np.dtype(np.float32), False)),
                      (), (), ())
    with pytest.raises(InvalidArgument, match=r"dynamic input shapes \(input 1: \['s0'\]\); give its inputs"):
        meta.example_inputs()
    ids, = MethodMeta("decode", meta.inputs[:1], (), (), ()).example_inputs()
    assert ids.dtype == np.int64 and not ids.any()  # token ids and positions: zeros, in range


@pytest.mark.parametrize("dim, want", [
    (7, 7), ("T", 5), ("2*T", 10), ("T - 1", 4), ("(T//2)", 2), ("Max(1, T - 6)", 1), ("Mod(T, 4)", 1),
    ("CeilToInt(T/2)", 3), ("T**2", 25), ("S*T + 3", 38),
    # Not worked out: an unknown symbol, a fraction, a huge power, a division by zero, anything but arithmetic.
    ("U + 1", None), ("T/2", None), ("T**99", None), ("T//0", None), ("__import__('os').getpid()", None),
    ("T.bit_length()", None), ("[T]", None), ("", None),
])
def test_dim_value_reads_the_expressions_a_header_writes_without_evaluating_python(dim, want):
    assert dim_value(dim, {"T": 5, "S": 7}) == want


class ReturnsTwice(torch.nn.Module):
    def forward(self, x):
        y = x * 2.0
        return y, y


@pytest.mark.parametrize("memory_planned_outputs", [True, False])
def test_a_value_returned_twice_fills_the_storage_given_for_each_output(tmp_path, memory_planned_outputs):
    """`return y, y` is one value of the method: the storage given for its second output was neither written nor
    handed back (the first output's array came back in its place), silently keeping what it held."""
    ep = torch.export.export(ReturnsTwice(), (torch.zeros(3),))
    program = export_program({"forward": ep}, memory_planned_outputs=memory_planned_outputs)
    path = program.save(tmp_path / "twice.onecopy")
    x = np.arange(3, dtype=np.float32)
    with Runtime().load_program(path) as loaded:
        forward = loaded.load_method("forward")
        for _ in range(2):  # the first call and the calls that repeat its signature
            first, second = np.full(3, -1, np.float32), torch.full((3,), -1.0)
            results = forward.execute([x], outputs=[first, second])
            np.testing.assert_array_equal(first, x * 2)
            np.testing.assert_array_equal(second.numpy(), x * 2)
            assert results[0] is first and np.shares_memory(results[1], second.numpy())


class _Keywords(torch.nn.Module):
    def forward(self, a, b, *, c):
        return a + 2 * b + 3 * c


def test_inputs_go_by_name_where_keyword_inputs_were_exported_out_of_signature_order():
    """torch.export orders keyword inputs as the kwargs were given ({"c": ..., "b": ...}: a, c, b): a list in the
    signature's order would swap b and c silently; names say which is which."""
    from onecopy import Runtime
    from onecopy.export import export_program

    a, b, c = (np.full(2, v, np.float32) for v in (1.0, 10.0, 100.0))
    ep = torch.export.export(_Keywords(), (torch.from_numpy(a),), {"c": torch.from_numpy(c), "b": torch.from_numpy(b)})
    program = export_program({"forward": ep})
    assert program.definition.methods[0].input_names == ["a", "c", "b"]
    with Runtime().load_program(program.to_bytes()) as loaded:
        forward = loaded.load_method("forward")
        assert [t.name for t in forward.method_meta.inputs] == ["a", "c", "b"]
        want = a + 2 * b + 3 * c
        for _ in range(2):  # the checked call, then the kept one
            np.testing.assert_allclose(forward.execute({"b": b, "c": c, "a": a})[0], want)
        np.testing.assert_allclose(forward.execute([a, c, b])[0], want)  # a list: method_meta's order
        np.testing.assert_allclose(forward.prepare({"a": a, "b": b, "c": c}).run()[0], want)
        with pytest.raises(InvalidArgument, match=r"takes inputs \['a', 'c', 'b'\]: no input named 'd'; missing 'b'"):
            forward.execute({"a": a, "c": c, "d": b})
