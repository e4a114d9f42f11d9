"""The program file format: preamble, typed schema, named data store. Imports neither torch nor IREE."""

from onecopy.program.data_store import PAGE_SIZE, NamedData, NamedDataStore
from onecopy.program.file import (FORMAT_VERSION, MAGIC, LoadedProgramFile, ProgramFile, check_program, read_program,
                                  write_atomically)
from onecopy.program.schema import (
    ConstArg,
    ConstantDef,
    DelegateCall,
    DelegateDef,
    HostOp,
    Instruction,
    MethodDef,
    ProgramDef,
    SegmentDef,
    StateDef,
    TensorSpec,
    ValueArg,
)
from onecopy.program.validate import Problem

__all__ = [
    "PAGE_SIZE",
    "FORMAT_VERSION",
    "MAGIC",
    "NamedData",
    "NamedDataStore",
    "ProgramFile",
    "LoadedProgramFile",
    "read_program",
    "write_atomically",
    "check_program",
    "Problem",
    "ConstArg",
    "ConstantDef",
    "DelegateCall",
    "DelegateDef",
    "HostOp",
    "Instruction",
    "MethodDef",
    "ProgramDef",
    "SegmentDef",
    "StateDef",
    "TensorSpec",
    "ValueArg",
]
