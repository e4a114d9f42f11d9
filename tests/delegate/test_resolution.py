"""Resolution: what decides a delegate's code is in the keys its model is found by."""

import dataclasses

from onecopy import Runtime
from onecopy.delegate.manifest import parse_manifest
from onecopy.delegate.resolution import Resolved
from onecopy.delegate.targets import host_cpu_target


def test_without_a_cache_the_shared_models_key_tells_the_codes_chosen_by_timing_apart(small_program_path):
    """With no cache entry (ONECOPY_DISABLE_CACHE), the shared-model table keys a model by what it was built from:
    tuned and untuned code, or a vmfb load that may run its fp32 code and one that may not, are different models."""
    with Runtime().load_program(small_program_path) as program:
        raw = program.definition.delegates[0].manifest
    plain = Resolved(parse_manifest(raw, "test"), "cpu", host_cpu_target(), None, None, "bf16")
    assert plain.table_key() == dataclasses.replace(plain).table_key()
    assert plain.table_key() != dataclasses.replace(plain, tuned=True).table_key()
    assert plain.table_key() != dataclasses.replace(plain, fp32_bundle="x86_64").table_key()
