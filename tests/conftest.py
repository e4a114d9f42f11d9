"""Shared fixtures: models and programs compiled once per test session."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch

from onecopy.export import CompileSpec, export_program
from onecopy.models import attention_block, builtin_methods, builtin_model
from onecopy.program import ProgramFile
from onecopy.surface import Surface

PACKAGINGS = ("mlir", "vmfb")


class TwoInTwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 16)
        self.b = torch.nn.Linear(8, 16)

    def forward(self, x, y):
        h = torch.tanh(self.a(x)) + self.b(y)
        return h * 2.0, torch.sigmoid(h).sum(dim=-1)


def AttentionBlock(dim: int = 64, heads: int = 4):
    """The built-in transformer layer (weights from seed 0)."""
    return attention_block(dim, heads)


def small_builtin():
    return builtin_model(width=64, layers=3)


@pytest.fixture(scope="session")
def small_model():
    return small_builtin()


@pytest.fixture(scope="session")
def small_methods(small_model):
    return builtin_methods(small_model, width=64)


@pytest.fixture(scope="session")
def small_program(small_methods) -> ProgramFile:
    """The built-in model's shape at width 64, portable: the fixture most runtime tests load."""
    return export_program(small_methods, compile_spec=CompileSpec(packaging="mlir"))


@pytest.fixture(scope="session")
def small_program_path(small_program, tmp_path_factory):
    return small_program.save(tmp_path_factory.mktemp("programs") / "small.onecopy")


@pytest.fixture(scope="session")
def small_vmfb_program(small_methods) -> ProgramFile:
    """The same, AOT-compiled for this machine (vmfb): data-tiled code plus a parameter encoder per target."""
    return export_program(small_methods, compile_spec=CompileSpec(packaging="vmfb"))


@pytest.fixture(scope="session")
def small_vmfb_program_path(small_vmfb_program, tmp_path_factory):
    return small_vmfb_program.save(tmp_path_factory.mktemp("programs") / "small-vmfb.onecopy")


@pytest.fixture(scope="session")
def builtin() -> torch.nn.Module:
    return builtin_model()


@pytest.fixture(scope="session", params=PACKAGINGS)
def builtin_program(request, builtin, tmp_path_factory):
    """The real built-in model (8 x Linear(1024, 1024)) in each packaging."""
    program = export_program(builtin_methods(builtin), compile_spec=CompileSpec(packaging=request.param))
    return program.save(tmp_path_factory.mktemp("builtin") / f"builtin-{request.param}.onecopy")


def vmfb_without_encoders(methods, **spec) -> ProgramFile:
    """A vmfb program as exported before parameter encoders: data-tiled code that packs its weights itself, in
    every VM context, and a manifest without `encoders`."""
    from onecopy.export import lowering

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lowering, "wants_encoder", lambda has_parameters, target: False)
        return export_program(methods, compile_spec=CompileSpec(packaging="vmfb", **spec))


def eager(model: torch.nn.Module, *inputs: np.ndarray):
    with torch.no_grad():
        out = model(*(torch.from_numpy(x) for x in inputs))
    outs = out if isinstance(out, tuple) else (out,)
    return [o.numpy() for o in outs]


def with_manifest(program: ProgramFile, index: int, **changes) -> bytes:
    """The program's bytes with delegate `index`'s manifest fields changed (None removes a field)."""
    definition = program.definition
    delegates = list(definition.delegates)
    manifest = dict(delegates[index].manifest)
    for key, value in changes.items():
        if value is None:
            manifest.pop(key, None)
        else:
            manifest[key] = value
    delegates[index] = msgspec.structs.replace(delegates[index], manifest=manifest)
    return ProgramFile(msgspec.structs.replace(definition, delegates=delegates), program.data).to_bytes()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def states(caplog):
    """`states()`: how each delegate load of this test went, from its log line ("specialized" or "restored")."""
    caplog.set_level(logging.INFO, logger="onecopy")

    def read():
        return [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("kind=")]

    return read


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory):
    """Every test process (and the subprocesses it starts) uses a cache of its own, never the user's."""
    import os

    directory = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("ONECOPY_CACHE_DIR")
    os.environ["ONECOPY_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("ONECOPY_CACHE_DIR", None)
    else:
        os.environ["ONECOPY_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Executor calibration in this process reads the machine as quiet (other processes' CPU 0): a restore times
    figures made while others took the cores again (onecopy.delegate.executors.measured_busy), and whether a test
    run shares its machine (or its process: pytest's own threads) is no test's business. Tests of that behaviour set
    `_machine_busy_s` and `_foreign_threads_s` themselves."""
    import onecopy.delegate.executors as executors

    monkeypatch.setattr(executors, "_machine_busy_s", lambda: 0.0)
    monkeypatch.setattr(executors, "_foreign_threads_s", lambda caller: 0.0)


@pytest.fixture
def surfaces():
    """Surface.create that closes and unlinks everything it made after the test."""
    made = []

    def create(*args, **kwargs):
        surface = Surface.create(*args, **kwargs)
        made.append(surface)
        return surface

    yield create
    for surface in made:
        surface.close()
        surface.unlink()


class Accumulator(torch.nn.Module):
    """A model with state: a cache updated at given positions (index_copy_, as a KV cache), a step counter (0-d
    int64) and a running sum that starts at ones (a non-zero initial value)."""

    def __init__(self, rows: int = 8, width: int = 16) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.register_buffer("cache", torch.zeros(rows, width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.ones(width))

    def forward(self, x, pos):
        y = self.proj(x)
        self.cache.index_copy_(0, pos, y)
        self.steps.add_(1)
        self.total.add_(y.sum(0))
        return self.cache.sum(0, keepdim=True) + self.total, self.steps.clone()


def accumulator_methods(model: torch.nn.Module | None = None) -> dict:
    """prefill (2 rows at a time) and decode (1 row) of one Accumulator: they share its three states."""
    torch.manual_seed(0)
    model = model if model is not None else Accumulator()
    return {
        "prefill": torch.export.export(model, (torch.zeros(2, 16), torch.tensor([0, 1]))),
        "decode": torch.export.export(model, (torch.zeros(1, 16), torch.tensor([2]))),
    }


@pytest.fixture(scope="session")
def accumulator():
    torch.manual_seed(0)
    return Accumulator()


@pytest.fixture(scope="session", params=[("mlir", True), ("mlir", False), ("vmfb", True), ("vmfb", False)],
                ids=["mlir-multifunction", "mlir-single", "vmfb-multifunction", "vmfb-single"])
def stateful_program(request, accumulator, tmp_path_factory):
    """The Accumulator's prefill + decode as one program: (path, packaging, multifunction)."""
    from onecopy.export import Partitioner

    packaging, multifunction = request.param
    program = export_program(accumulator_methods(accumulator), partitioner=Partitioner(multifunction=multifunction),
                             compile_spec=CompileSpec(packaging=packaging))
    path = program.save(tmp_path_factory.mktemp("stateful") / f"acc-{packaging}-{multifunction}.onecopy")
    return path, packaging, multifunction


class SmallConvNet(torch.nn.Module):
    """A conv + batch norm + classifier: OpenVINO folds the batch norm into the conv's weights at conversion."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.fixture(scope="session")
def conv_net():
    torch.manual_seed(0)
    net = SmallConvNet().eval()
    with torch.no_grad():  # running statistics other than the defaults, so the folded weights differ from torch's
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


def _openvino_programs(methods: dict, tmp_path_factory, name: str):
    """The same methods exported IREE only and with the OpenVINO alternative, saved: (iree_path, both_path)."""
    folder = tmp_path_factory.mktemp(name)
    iree = export_program(methods).save(folder / "iree.onecopy")
    both = export_program(methods, compile_spec=CompileSpec(delegates=("iree", "openvino"))).save(folder / "both.onecopy")
    return iree, both


@pytest.fixture(scope="session")
def conv_programs(conv_net, tmp_path_factory):
    """(IREE-only path, IREE + OpenVINO path) of the conv net at 1x3x16x16."""
    pytest.importorskip("openvino")
    x = torch.randn(1, 3, 16, 16)
    return _openvino_programs({"forward": torch.export.export(conv_net, (x,))}, tmp_path_factory, "conv")


@pytest.fixture(scope="session")
def mlp_programs(small_model, small_methods, tmp_path_factory):
    """(IREE-only path, IREE + OpenVINO path) of the small built-in MLP's methods (forward and prefill)."""
    pytest.importorskip("openvino")
    return _openvino_programs(small_methods, tmp_path_factory, "mlp")
