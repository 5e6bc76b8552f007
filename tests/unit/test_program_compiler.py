"""``ProgramCompiler``: canonical SHA-256 program keys, compile-once with an output contract,
released compile outputs (a failed release is a retryable orphan), the bound-KV requirement
and the compile gate."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import single_torch_thread  # noqa: F401 (autouse)
from structlog.testing import capture_logs

from llmrt.device.torch import TorchDevice
from llmrt.errors import CompileGateClosed, KVCacheStateError
from llmrt.runtime.decode import DecodeSignature
from llmrt.runtime.prefill.signatures import PrefillSignature
from llmrt.runtime.program_compiler import ProgramCompiler, TensorContract, signature_key
from llmrt.testing import FaultyDevice, InjectedFault


@attrs.frozen
class Bound:
    is_bound: bool = True


@attrs.frozen
class ToySignature:
    """A signature whose material is given as a dict in any insertion order."""

    operation: str
    fields: tuple[tuple[str, Any], ...]

    def material(self) -> Mapping[str, Any]:
        return dict(self.fields)

    def describe(self) -> str:
        return f"{self.operation}{dict(self.fields)}"


class Invoke:
    """A program body that allocates its output on the device and counts its runs."""

    def __init__(self, device: Any, shape: tuple[int, ...] = (2, 3)) -> None:
        self.device = device
        self.shape = shape
        self.runs = 0
        self.outputs: list[torch.Tensor] = []

    def __call__(self) -> dict[str, torch.Tensor]:
        self.runs += 1
        out = self.device.allocate(shape=self.shape, dtype=torch.float32)
        self.outputs.append(out)
        return {"logits": out}


def _compiler(fail: Mapping[str, Any] | None = None, *, bound: bool = True):
    device = FaultyDevice(TorchDevice("cpu"), fail=fail or {})
    return ProgramCompiler(device=device, kv_cache=Bound(is_bound=bound)), device


# -- keys ------------------------------------------------------------------------------


def test_key_is_sha256_of_the_canonical_material() -> None:
    sig = DecodeSignature(batch_size=8, page_table_width=64)
    canonical = json.dumps(
        {"batch_size": 8, "operation": "decode", "page_table_width": 64},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert signature_key(sig) == hashlib.sha256(canonical.encode()).hexdigest()
    assert ProgramCompiler.key_for(sig) == signature_key(sig)


def test_equal_signatures_built_separately_share_a_key() -> None:
    a = PrefillSignature(variant="regular", padded_batch=2, padded_seq_len=8, page_table_width=64)
    b = PrefillSignature(variant="regular", padded_batch=2, padded_seq_len=8, page_table_width=64)
    assert a is not b and signature_key(a) == signature_key(b)
    # Material insertion order does not matter; object identity does not either.
    x = ToySignature(operation="op", fields=(("a", 1), ("b", (2, 3))))
    y = ToySignature(operation="op", fields=(("b", (2, 3)), ("a", 1)))
    assert signature_key(x) == signature_key(y)


def test_unhashable_signatures_are_keyed_by_their_material_too() -> None:
    class ListSignature:
        operation = "decode"
        __hash__ = None  # type: ignore[assignment]

        def __init__(self, width: int) -> None:
            self.fields = [("batch_size", 8), ("page_table_width", width)]

        def material(self) -> Mapping[str, Any]:
            return dict(self.fields)

    frozen = DecodeSignature(batch_size=8, page_table_width=64)
    assert signature_key(ListSignature(64)) == signature_key(frozen)  # type: ignore[arg-type]
    assert signature_key(ListSignature(32)) != signature_key(frozen)  # type: ignore[arg-type]


def test_a_compiler_keys_each_distinct_signature_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmrt.runtime.program_compiler as pc

    calls: list[object] = []
    real = pc.signature_key

    def counted(signature: Any) -> str:
        calls.append(signature)
        return real(signature)

    monkeypatch.setattr(pc, "signature_key", counted)
    compiler, _ = _compiler()
    a = DecodeSignature(batch_size=8, page_table_width=64)
    b = DecodeSignature(batch_size=8, page_table_width=64)
    c = DecodeSignature(batch_size=4, page_table_width=64)
    assert compiler.key_of(a) == compiler.key_of(b) == real(a)
    assert compiler.key_of(c) == real(c) != real(a)
    assert len(calls) == 2  # a and c; b is equal to a


@pytest.mark.parametrize(
    "other",
    [
        PrefillSignature(variant="chunked", padded_batch=2, padded_seq_len=8, page_table_width=64),
        PrefillSignature(variant="regular", padded_batch=1, padded_seq_len=8, page_table_width=64),
        PrefillSignature(variant="regular", padded_batch=2, padded_seq_len=16, page_table_width=64),
        PrefillSignature(variant="regular", padded_batch=2, padded_seq_len=8, page_table_width=32),
    ],
)
def test_any_geometry_change_changes_the_key(other: PrefillSignature) -> None:
    base = PrefillSignature(
        variant="regular", padded_batch=2, padded_seq_len=8, page_table_width=64
    )
    assert signature_key(other) != signature_key(base)


def test_the_operation_is_part_of_the_key() -> None:
    fields = (("batch_size", 8), ("page_table_width", 64))
    assert signature_key(ToySignature(operation="decode", fields=fields)) == signature_key(
        DecodeSignature(batch_size=8, page_table_width=64)
    )
    assert signature_key(ToySignature(operation="prefill", fields=fields)) != signature_key(
        DecodeSignature(batch_size=8, page_table_width=64)
    )


# -- compile ---------------------------------------------------------------------------


def test_compile_runs_once_records_the_contract_and_releases_the_output() -> None:
    compiler, device = _compiler()
    invoke = Invoke(device)
    sig = DecodeSignature(batch_size=8, page_table_width=64)
    program = compiler.compile(sig, invoke)
    assert invoke.runs == 1
    assert program.key == signature_key(sig)
    assert program.operation == "decode" and program.description == sig.describe()
    assert program.output_contract == {
        "logits": TensorContract(shape=(2, 3), dtype="torch.float32")
    }
    # Run, then synchronize, then release the compile output (the device holds nothing).
    ops = [c.op for c in device.calls]
    assert ops == ["allocate", "synchronize", "deallocate"]
    assert device.calls_of("deallocate", subject=invoke.outputs[0])
    assert device.stats().live_tensors == 0
    # A second compile of an equal signature built separately is idempotent.
    again = compiler.compile(DecodeSignature(batch_size=8, page_table_width=64), invoke)
    assert again is program and invoke.runs == 1
    assert list(compiler.programs) == [program.key] and program.key in compiler


def test_compile_requires_a_bound_kv_cache() -> None:
    compiler, device = _compiler(bound=False)
    invoke = Invoke(device)
    with pytest.raises(KVCacheStateError, match="not allocated and bound"):
        compiler.compile(DecodeSignature(batch_size=8, page_table_width=64), invoke)
    assert invoke.runs == 0 and not compiler.programs


def test_a_failed_output_release_is_an_orphan_that_cleanup_retries() -> None:
    compiler, device = _compiler({"deallocate": [1, 2]})
    invoke = Invoke(device)
    program = compiler.compile(DecodeSignature(batch_size=8, page_table_width=64), invoke)
    assert program.key in compiler, "a failed release does not undo the compile"
    assert len(compiler.orphans) == 1 and device.stats().live_tensors == 1
    with pytest.raises(KVCacheStateError, match="failed to release"):
        compiler.cleanup()  # the retry (deallocate #2) fails too
    assert len(compiler.orphans) == 1
    compiler.cleanup()
    compiler.cleanup()  # idempotent
    assert compiler.orphans == () and device.stats().live_tensors == 0
    calls = device.calls_of("deallocate", subject=invoke.outputs[0])
    assert [c.injected for c in calls] == [True, True, False], "released exactly once"


def test_a_failing_program_records_nothing() -> None:
    compiler, _ = _compiler()

    def boom() -> Any:
        raise RuntimeError("kernel failed")

    sig = DecodeSignature(batch_size=8, page_table_width=64)
    with pytest.raises(RuntimeError, match="kernel failed"):
        compiler.compile(sig, boom)
    assert signature_key(sig) not in compiler


def test_a_failed_synchronize_records_nothing_and_still_releases_the_output() -> None:
    compiler, device = _compiler({"synchronize": 1})
    invoke = Invoke(device)
    sig = DecodeSignature(batch_size=8, page_table_width=64)
    with pytest.raises(InjectedFault):
        compiler.compile(sig, invoke)
    assert signature_key(sig) not in compiler
    assert device.calls_of("deallocate", subject=invoke.outputs[0])
    assert device.stats().live_tensors == 0, "the compile output leaked"
    compiler.compile(sig, invoke)  # a retry compiles normally
    assert invoke.runs == 2 and signature_key(sig) in compiler


def test_admit_records_a_first_eager_run_without_releasing_it() -> None:
    compiler, device = _compiler()
    out = {"logits": device.allocate(shape=(4,), dtype=torch.float32)}
    sig = DecodeSignature(batch_size=4, page_table_width=8)
    program = compiler.admit(sig, out)
    assert compiler.admit(sig, out) is program
    assert device.calls_of("deallocate") == (), "the caller keeps an admitted output"
    assert program.output_contract == {"logits": TensorContract(shape=(4,), dtype="torch.float32")}


# -- the compile gate ------------------------------------------------------------------


def test_the_closed_gate_rejects_unseen_signatures_but_keeps_compiled_ones() -> None:
    compiler, device = _compiler()
    seen = DecodeSignature(batch_size=8, page_table_width=64)
    unseen = DecodeSignature(batch_size=4, page_table_width=64)
    program = compiler.compile(seen, Invoke(device))
    compiler.close_gate(reason="trace capture")
    assert compiler.gate_closed
    invoke = Invoke(device)
    assert compiler.compile(seen, invoke) is program and invoke.runs == 0
    assert compiler.check_runnable(seen) == program.key
    with pytest.raises(CompileGateClosed) as exc:
        compiler.compile(unseen, invoke)
    assert invoke.runs == 0
    assert exc.value.key == signature_key(unseen)
    assert exc.value.description == unseen.describe() and unseen.describe() in str(exc.value)
    with pytest.raises(CompileGateClosed):
        compiler.check_runnable(unseen)
    with pytest.raises(CompileGateClosed):
        compiler.admit(unseen, {})
    assert list(compiler.programs) == [program.key]


def test_close_gate_logs_once_with_the_component_identity() -> None:
    compiler, device = _compiler()
    compiler.compile(DecodeSignature(batch_size=8, page_table_width=64), Invoke(device))
    with capture_logs() as logs:
        compiler.close_gate(reason="trace capture")
        compiler.close_gate(reason="again")
    assert [e["event"] for e in logs] == ["compile_gate.closed"]
    (event,) = logs
    assert event["component"] == "program_compiler" and event["lane"] == 0
    assert event["object_id"] == f"{id(compiler):#x}"
    assert event["reason"] == "trace capture" and event["programs"] == 1


def test_compile_logs_program_compiled_once() -> None:
    device = TorchDevice("cpu")
    compiler = ProgramCompiler(device=device, kv_cache=Bound(), lane=3)
    sig = DecodeSignature(batch_size=8, page_table_width=64)
    with capture_logs() as logs:
        compiler.compile(sig, Invoke(device))
        compiler.compile(sig, Invoke(device))
    compiled = [e for e in logs if e["event"] == "program.compiled"]
    assert len(compiled) == 1
    assert compiled[0]["component"] == "program_compiler" and compiled[0]["lane"] == 3
    assert compiled[0]["object_id"] == f"{id(compiler):#x}"
    assert compiled[0]["signature"] == sig.describe()
    assert compiled[0]["key"] == signature_key(sig)[:16]


def test_cleanup_terminalizes_the_registry() -> None:
    compiler, device = _compiler()
    sig = DecodeSignature(batch_size=8, page_table_width=64)
    compiler.compile(sig, Invoke(device))
    compiler.cleanup()
    assert not compiler.programs
    invoke = Invoke(device)
    with pytest.raises(KVCacheStateError, match="cleaned up"):
        compiler.compile(sig, invoke)
    assert invoke.runs == 0
