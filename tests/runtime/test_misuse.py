"""Misuse of the public call API: every mistake is a onecopy error naming the method, the argument and what was
expected and given; never a foreign exception, never a silently wrong call."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.errors import ExecutionError, InvalidArgument

X = np.zeros((1, 64), np.float32)


@pytest.fixture(scope="module")
def forward(small_program_path):
    with Runtime().load_program(small_program_path) as program:
        yield program.load_method("forward")


LIST = (r"Method 'forward' takes its inputs as a list with one entry per tensor \(execute\(\[x, \.\.\.\]\), or a dict "
        r"by input name\), got {}\.")
OUT_LIST = r"Method 'forward' takes output storage as a list with one entry per tensor .*, got {}\."


@pytest.mark.parametrize("call, message", [
    (lambda f: f.execute(X), LIST.format("ndarray")),
    (lambda f: f.execute(None), LIST.format("NoneType")),
    (lambda f: f.execute(a for a in [X]), LIST.format("generator")),
    (lambda f: f.execute({X.tobytes()}), LIST.format("set")),  # a dict goes by input name (test_method)
    (lambda f: f.prepare(X), LIST.format("ndarray")),
    (lambda f: f.execute([X, X]), r"Method 'forward' takes 1 inputs, got 2\."),
    (lambda f: f.execute([]), r"Method 'forward' takes 1 inputs, got 0\."),
    (lambda f: f.execute([torch.zeros(1, 64, dtype=torch.float64)]),
     r"Input 0 of method 'forward' has dtype float64; expected float32\. Convert it"),
    (lambda f: f.execute([np.zeros((2, 64), np.float32)]),
     r"Input 0 of method 'forward' has shape \[2, 64\]; expected \[1, 64\]\."),
    (lambda f: f.execute([np.float32(1)]), r"Input 0 of method 'forward' has shape \[\]; expected \[1, 64\]\."),
    (lambda f: f.execute(["abc"]), r"Input 0 of method 'forward' has dtype <U3; expected float32"),
    (lambda f: f.execute([X], outputs=np.empty((1, 64), np.float32)), OUT_LIST.format("ndarray")),
    (lambda f: f.execute([X], outputs=[]), r"Method 'forward' has 1 outputs; outputs= gave 0"),
    (lambda f: f.execute([X], outputs=[np.empty((1, 64), np.float64)]),
     r"Output 0 of method 'forward' has dtype float64; expected float32\. Pass storage of that dtype, e\.g\. "
     r"np\.empty\(shape, np\.float32\)"),
    (lambda f: f.execute([X], outputs=[np.empty((2, 64), np.float32)]),
     r"Output 0 of method 'forward' has shape \[2, 64\]; expected \[1, 64\]\."),
    (lambda f: f.execute([X], outputs=[np.broadcast_to(np.float32(0), (1, 64))]),
     r"Output 0 of method 'forward' is read-only; pass writable storage\."),
    (lambda f: f.execute([X], outputs=[3]),
     r"Output 0 of method 'forward' must be an array to write into \(numpy, or a DLPack tensor on the host\), got int\."),
])
def test_misuse_is_a_onecopy_error_naming_method_argument_expected_and_given(forward, call, message):
    with pytest.raises(ExecutionError, match=message):
        call(forward)
    (y,) = forward.execute([X])  # the method is still fine
    assert y.shape == (1, 64)


def test_binding_something_that_is_not_a_surface_names_the_method(forward):
    with pytest.raises(InvalidArgument, match=r"Method 'forward', delegate 0: bind_surface takes an onecopy.Surface, got ndarray\."):
        forward.bind_surface(X)


def test_strided_inputs_are_read_through_their_strides(forward):
    dense = np.arange(64, dtype=np.float32).reshape(1, 64) / 64
    (expected,) = forward.execute([dense])
    wide = np.zeros((1, 128), np.float32)
    wide[:, ::2] = dense
    for strided in (wide[:, ::2], np.asfortranarray(dense), dense[:, ::-1][:, ::-1]):
        np.testing.assert_array_equal(forward.execute([strided])[0], expected)
