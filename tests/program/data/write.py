"""Write the program files of test_compat.py and torch eager's answers for them.

Run from the repository root with the onecopy to write them on the path:
    PYTHONPATH=src:. python tests/program/data/write.py tests/program/data
"""

import copy
import sys

import numpy as np
import torch

import onecopy
from onecopy.export import CompileSpec, Partitioner, export_program
from tests.conftest import Accumulator, accumulator_methods

print("written by", onecopy.__file__)
out = sys.argv[1]
torch.manual_seed(0)
model = Accumulator()
eager = copy.deepcopy(model)
program = export_program(accumulator_methods(model), partitioner=Partitioner(multifunction=True),
                         compile_spec=CompileSpec(packaging="mlir", check_compiles=False))
program.save(f"{out}/accumulator.onecopy")
rng = np.random.default_rng(0)
x2, x1 = rng.standard_normal((2, 16), dtype=np.float32), rng.standard_normal((1, 16), dtype=np.float32)
with torch.no_grad():
    p = eager(torch.from_numpy(x2), torch.tensor([0, 1]))
    d = eager(torch.from_numpy(x1), torch.tensor([2]))
np.savez(f"{out}/accumulator.npz", x2=x2, x1=x1, prefill_0=p[0].numpy(), prefill_1=p[1].numpy(),
         decode_0=d[0].numpy(), decode_1=d[1].numpy())
# a destination-passing function: caller-provided outputs
torch.manual_seed(1)
lin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
ep = torch.export.export(lin, (torch.zeros(1, 16),))
export_program({"forward": ep}, compile_spec=CompileSpec(packaging="mlir", check_compiles=False),
               memory_planned_outputs=False).save(f"{out}/in_place.onecopy")
with torch.no_grad():
    np.savez(f"{out}/in_place.npz", x=x1, y=lin(torch.from_numpy(x1)).numpy())
