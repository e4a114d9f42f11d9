"""A tiny two-method program for the serve tests: `forward` takes any batch (a torch.export.Dim), `single` one row."""

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
