"""Programs for the serve tests: a tiny two-method one (`forward` takes any batch, a torch.export.Dim, `single`
one row), and one whose `center` has the same batchable shapes but rows that depend on each other."""

from __future__ import annotations

import pytest
import torch

from onecopy.export import CompileSpec, Partitioner, export_program


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Tiny().eval()


@pytest.fixture(scope="session")
def tiny_program_path(tiny_model, tmp_path_factory):
    batch = torch.export.Dim("batch", min=1, max=64)
    methods = {
        "forward": torch.export.export(tiny_model, (torch.zeros(4, 16),), dynamic_shapes=({0: batch},)),
        "single": torch.export.export(tiny_model, (torch.zeros(1, 16),)),
    }
    program = export_program(methods, partitioner=Partitioner(multifunction=True),
                             compile_spec=CompileSpec(packaging="mlir"))
    return program.save(tmp_path_factory.mktemp("serve") / "tiny.onecopy")


class Center(torch.nn.Module):
    """Each row minus the batch's mean row: joined requests would each get the others' rows in their answer."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


@pytest.fixture(scope="session")
def mixing_program_path(tmp_path_factory):
    """`center` (rows mix) and `scale` (rows alone), both with a dynamic first dimension."""
    batch = torch.export.Dim("batch", min=1, max=64)
    methods = {
        "center": torch.export.export(Center(), (torch.zeros(4, 3),), dynamic_shapes=({0: batch},)),
        "scale": torch.export.export(Scale(), (torch.zeros(4, 3),), dynamic_shapes=({0: batch},)),
    }
    program = export_program(methods, compile_spec=CompileSpec(packaging="mlir"))
    return program.save(tmp_path_factory.mktemp("serve") / "mixing.onecopy")
