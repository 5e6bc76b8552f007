"""Precompiled steps on disk (``llmrt.runtime.step_artifacts`` and ``CompiledStep``'s use of them).

Real inductor compiles of a stub module (a few element-wise ops, seconds each): a step is
saved by one process and loaded by a fresh one without a Dynamo trace; the key moves with
what changes the graph and not with weight values; a damaged or mismatched file is never
trusted, it is reported, recompiled and replaced. The SmolLM2 warm start is
tests/parity/test_compiled_warm_start.py (slow).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from lane_fixtures import single_torch_thread  # noqa: F401  (autouse fixture)
from structlog.testing import capture_logs

import llmrt.runtime.compiled_step as compiled_step
from llmrt.errors import ConfigError
from llmrt.runtime.compiled_step import INDUCTOR_CACHE_ENV, CompileOptions, StepCompiler
from llmrt.runtime.step_artifacts import ArtifactKey, ArtifactStore, StepArtifactError, artifact_key

_STUB = textwrap.dedent(
    '''
    import torch


    class StubModel(torch.nn.Module):
        """A decode "model": a weight lookup plus every input, and a held tensor."""

        def __init__(self, *, seed: int = 0, vocab: int = 16, dtype=torch.float32) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            weight = torch.randn(vocab, 3, generator=generator).to(dtype)
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.scale = 2.0
            self.held = torch.ones(4, 3, dtype=dtype)  # a plain tensor attribute, like KV

        def decode_forward(self, *, tokens, positions, page_table):
            used = page_table.clamp(min=0).sum(dim=1, keepdim=True).to(self.weight.dtype)
            return self.weight[tokens] * self.scale + positions[:, None] + used + self.held[0]
    '''
)

_RUN = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from structlog.testing import capture_logs
    from torch._dynamo.utils import counters
    from llmrt.runtime.compiled_step import CompileOptions, StepCompiler
    from stub_model import StubModel

    torch.set_num_threads(1)
    model = StubModel(seed=int(sys.argv[2]))
    steps = StepCompiler(options=CompileOptions(mode="inductor", cache_dir=Path(sys.argv[1])))
    step = steps.decode_step(model, block_size=4)
    tokens = torch.tensor([1, 2, 3])
    table = torch.arange(18, dtype=torch.int32).reshape(3, 6)
    outs, eager = [], []
    with capture_logs() as logs:
        for last in (0, 9, 23):  # trimmed page-table widths 2, 3 and the full 6
            positions = torch.tensor([0, last, 1], dtype=torch.int32)
            outs.append(step(tokens=tokens, positions=positions, page_table=table).tolist())
            width = max(2, last // 4 + 1)
            eager.append(model.decode_forward(
                tokens=tokens, positions=positions, page_table=table[:, :width]).tolist())
    stats = steps.stats()
    print(json.dumps({
        "outs": outs,
        "eager": eager,
        "graphs": stats.graphs,
        "recompilations": stats.recompilations,
        "events": [e["event"] for e in logs],
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "dynamo_calls_captured": counters["stats"]["calls_captured"],
    }))
    """
)


@pytest.fixture
def stub_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding ``stub_model.py``, importable here and in subprocesses."""
    directory = tmp_path / "stub"
    directory.mkdir()
    (directory / "stub_model.py").write_text(_STUB)
    monkeypatch.syspath_prepend(str(directory))
    sys.modules.pop("stub_model", None)
    return directory


def _stub(seed: int = 0, **kwargs: Any) -> Any:
    from stub_model import StubModel  # type: ignore[import-not-found]

    return StubModel(seed=seed, **kwargs)


def _decode(steps: StepCompiler, model: Any, *, rows: int = 3, last: int = 9) -> torch.Tensor:
    step = steps.decode_step(model, block_size=4)
    table = torch.arange(rows * 6, dtype=torch.int32).reshape(rows, 6)
    positions = torch.full((rows,), last, dtype=torch.int32)
    out: torch.Tensor = step(tokens=torch.arange(rows), positions=positions, page_table=table)
    return out


def _inductor(cache: Path) -> StepCompiler:
    return StepCompiler(options=CompileOptions(mode="inductor", cache_dir=cache))


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


# -- a fresh process loads the step without tracing ------------------------------------------


def test_a_saved_step_is_loaded_by_a_fresh_process_without_tracing(
    tmp_path: Path, stub_dir: Path
) -> None:
    cache = tmp_path / "compile-cache"
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(stub_dir), env.get("PYTHONPATH", "")])
    script = stub_dir / "run_step.py"
    script.write_text(_RUN)

    def run(seed: int) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, str(script), str(cache), str(seed)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    first = run(seed=0)
    assert first["graphs"] == 1 and first["dynamo_graphs"] == 1  # one trace, all widths
    assert first["events"].count("program.artifact_saved") == 1
    assert "program.artifact_loaded" not in first["events"]
    torch.testing.assert_close(torch.tensor(first["outs"]), torch.tensor(first["eager"]))
    (saved,) = (cache / "steps").iterdir()

    again = run(seed=0)
    assert again["events"].count("program.artifact_loaded") == 1
    assert "program.artifact_saved" not in again["events"]
    assert again["graphs"] == 0 and again["recompilations"] == 0
    assert again["dynamo_graphs"] == 0 and again["dynamo_calls_captured"] == 0  # no trace
    assert again["outs"] == first["outs"]  # bit for bit
    assert list((cache / "steps").iterdir()) == [saved]


# -- keys -------------------------------------------------------------------------------------


def _key(model: Any, **changes: Any) -> ArtifactKey:
    arguments: dict[str, Any] = {
        "operation": "decode",
        "geometry": (("tokens", (3,)), ("positions", (3,)), ("page_table", (3, 6))),
        "dtypes": {"tokens": torch.int64, "positions": torch.int32, "page_table": torch.int32},
        "dynamic": {"page_table": {"dim": 1, "min": 2, "max": 6}},
        "options": {"backend": "inductor", "freezing": False},
        "model": model,
    }
    arguments.update(changes)
    return artifact_key(**arguments)


def test_the_key_follows_what_changes_the_graph_and_not_the_weights(stub_dir: Path) -> None:
    base = _key(_stub())
    assert _key(_stub()).digest == base.digest  # deterministic
    assert _key(_stub(seed=5)).digest == base.digest  # weight values are graph inputs
    assert base.filename == f"decode-{base.digest[:32]}.aot"

    held = _stub()
    held.held = torch.ones(8, 3)  # e.g. a KV cache with more blocks
    scaled = _stub()
    scaled.scale = 3.0  # a Python constant the trace specializes on
    changed = {
        "operation": _key(_stub(), operation="prefill"),
        "geometry": _key(
            _stub(), geometry=(("tokens", (4,)), ("positions", (4,)), ("page_table", (4, 6)))
        ),
        "dtypes": _key(
            _stub(), dtypes={"tokens": torch.int32, "positions": torch.int32, "page_table": 0}
        ),
        "dynamic": _key(_stub(), dynamic={}),
        "options": _key(_stub(), options={"backend": "inductor", "freezing": True}),
        "weight dtype": _key(_stub(dtype=torch.bfloat16)),
        "vocab": _key(_stub(vocab=32)),
        "held tensor": _key(held),
        "attribute": _key(scaled),
    }
    digests = {name: key.digest for name, key in changed.items()}
    assert base.digest not in digests.values(), digests
    assert len(set(digests.values())) == len(digests), digests
    for part in ("torch", "python", "cpu_isa", "sources", "model", "inductor_options"):
        assert base.parts[part], part
    assert base.parts["torch"] == torch.__version__


def test_the_key_covers_the_model_class_source(stub_dir: Path) -> None:
    before = _key(_stub()).digest
    source = stub_dir / "stub_model.py"
    source.write_text(source.read_text() + "\n# an edit to the model's code\n")
    assert _key(_stub()).digest != before


# -- files that are not trusted ---------------------------------------------------------------


@pytest.fixture
def saved_step(stub_dir: Path, inductor_cache: Path) -> tuple[StepCompiler, Path, torch.Tensor]:
    """One compiled and saved stub step: (its compiler, the file, its output)."""
    steps = _inductor(inductor_cache)
    with capture_logs() as logs:
        out = _decode(steps, _stub())
    (event,) = _events(logs, "program.artifact_saved")
    path = Path(event["path"])
    assert path.parent == inductor_cache / "steps" and path.is_file()
    return steps, path, out


def _rewrite_header(data: bytes, **changes: Any) -> bytes:
    magic, header, payload = data.split(b"\n", 2)
    fields = json.loads(header)
    fields.update(changes)
    return magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload


def _garbage_payload(data: bytes) -> bytes:
    magic, header, _ = data.split(b"\n", 2)
    payload = b"not a pickle"
    fields = {
        **json.loads(header),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_bytes": len(payload),
    }
    return magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: b"PK" + d[2:], "does not start with 'llmrt-step-artifact'"),
        (lambda d: d[:40], r"has no header line \(truncated\)"),
        (lambda d: d[:-100], r"payload bytes, its header says \d+ \(truncated or appended to\)"),
        (_flip_last_byte, r"payload does not match its SHA-256 \(damaged\)"),
        (lambda d: _rewrite_header(d, format=99), "is format 99, this llmrt reads 1"),
        (lambda d: _rewrite_header(d, key="0" * 64), "was saved for key 0{64}, not [0-9a-f]{64}"),
        (_garbage_payload, r"torch cannot load it \(UnpicklingError"),
    ],
)
def test_a_damaged_file_raises_an_error_naming_it_and_the_problem(
    saved_step: tuple[StepCompiler, Path, torch.Tensor], damage: Any, message: str
) -> None:
    _, path, _ = saved_step
    header = path.read_bytes().split(b"\n", 2)[1]
    key = ArtifactKey(operation="decode", parts={}, digest=json.loads(header)["key"])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(StepArtifactError, match=message) as raised:
        ArtifactStore(path.parent).load(key, f_globals={})
    assert str(path) in str(raised.value)
    missing = ArtifactKey(operation="decode", parts={}, digest="f" * 64)
    assert ArtifactStore(path.parent).load(missing, f_globals={}) is None


def test_a_saved_step_serves_other_weights_of_the_same_shapes(
    saved_step: tuple[StepCompiler, Path, torch.Tensor], inductor_cache: Path
) -> None:
    _, _, first = saved_step
    other = _stub(seed=1)
    steps = _inductor(inductor_cache)
    with capture_logs() as logs:
        out = _decode(steps, other)
    assert len(_events(logs, "program.artifact_loaded")) == 1 and steps.stats().graphs == 0
    table = torch.arange(18, dtype=torch.int32).reshape(3, 6)[:, :3]
    expected = other.decode_forward(
        tokens=torch.arange(3), positions=torch.full((3,), 9, dtype=torch.int32), page_table=table
    )
    torch.testing.assert_close(out, expected)
    assert not torch.equal(out, first)  # the weights are inputs, not baked into the file


def test_a_damaged_file_is_reported_recompiled_and_replaced(
    saved_step: tuple[StepCompiler, Path, torch.Tensor], inductor_cache: Path
) -> None:
    _, path, expected = saved_step
    path.write_bytes(_flip_last_byte(path.read_bytes()))
    steps = _inductor(inductor_cache)
    with capture_logs() as logs:
        out = _decode(steps, _stub())
    (rejected,) = _events(logs, "program.artifact_rejected")
    assert rejected["path"] == str(path) and "SHA-256" in rejected["reason"]
    assert rejected["log_level"] == "warning"
    assert len(_events(logs, "program.artifact_saved")) == 1
    assert steps.stats().graphs == 1 and steps.recompilations == 0
    torch.testing.assert_close(out, expected)

    with capture_logs() as logs:  # the replacement is whole and loads
        again = _decode(_inductor(inductor_cache), _stub())
    assert len(_events(logs, "program.artifact_loaded")) == 1
    assert torch.equal(again, out)


def test_a_file_whose_guards_fail_is_recompiled_not_run(
    stub_dir: Path, inductor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A key blind to the geometry: the 3-row step's file is offered to the 2-row step.
    def blind_key(**arguments: Any) -> ArtifactKey:
        return artifact_key(**{**arguments, "geometry": (), "dtypes": {}, "dynamic": {}})

    monkeypatch.setattr(compiled_step, "artifact_key", blind_key)
    model = _stub()
    with capture_logs() as logs:
        _decode(_inductor(inductor_cache), model, rows=3)
        steps = _inductor(inductor_cache)
        out = _decode(steps, model, rows=2)
    saved = _events(logs, "program.artifact_saved")
    (rejected,) = _events(logs, "program.artifact_rejected")
    assert len(saved) == 2 and saved[0]["path"] == saved[1]["path"] == rejected["path"]
    assert "GuardManager check failed" in rejected["reason"]
    assert "size" in rejected["reason"]  # Dynamo names the mismatched dimension
    assert steps.stats().graphs == 1 and steps.recompilations == 0
    table = torch.arange(12, dtype=torch.int32).reshape(2, 6)[:, :3]
    expected = model.decode_forward(
        tokens=torch.arange(2), positions=torch.full((2,), 9, dtype=torch.int32), page_table=table
    )
    torch.testing.assert_close(out, expected)


def test_a_step_torch_cannot_precompile_runs_on_the_jit_path(
    stub_dir: Path, inductor_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_compile = torch.compile

    def unserializable(fn: Any, **kwargs: Any) -> Any:
        compiled = real_compile(fn, **kwargs)

        def aot_compile(example: Any) -> Any:
            kwargs["backend"].graphs += 1  # as in torch: the backend ran, then guards failed
            raise RuntimeError("Tried to serialize object DecodeStack")

        compiled.aot_compile = aot_compile
        return compiled

    monkeypatch.setattr(torch, "compile", unserializable)
    model = _stub()
    steps = _inductor(inductor_cache)
    step = steps.decode_step(model, block_size=4)
    table = torch.arange(18, dtype=torch.int32).reshape(3, 6)
    inputs = {"positions": torch.full((3,), 9, dtype=torch.int32), "page_table": table}
    with capture_logs() as logs:
        first = step(tokens=torch.arange(3), **inputs)
        again = step(tokens=torch.arange(3), **inputs)
    (failed,) = _events(logs, "program.artifact_save_failed")
    assert failed["log_level"] == "warning"
    assert failed["reason"].startswith("cannot precompile, Dynamo traces this step")
    assert "RuntimeError: Tried to serialize object DecodeStack" in failed["reason"]
    assert not _events(logs, "program.artifact_saved")
    assert steps.stats().graphs == 1 and steps.recompilations == 0  # the jit graph only
    assert torch.equal(first, again)
    expected = model.decode_forward(
        tokens=torch.arange(3), positions=inputs["positions"], page_table=table[:, :3]
    )
    torch.testing.assert_close(first, expected)
    assert not (inductor_cache / "steps").exists()


def test_a_step_that_cannot_be_saved_still_runs(stub_dir: Path, inductor_cache: Path) -> None:
    inductor_cache.mkdir(parents=True, exist_ok=True)
    (inductor_cache / "steps").write_text("a file where the directory should be")
    steps = _inductor(inductor_cache)
    with capture_logs() as logs:
        out = _decode(steps, _stub())
    (failed,) = _events(logs, "program.artifact_save_failed")
    assert failed["reason"].startswith("FileExistsError") and failed["log_level"] == "warning"
    assert not _events(logs, "program.artifact_saved") and steps.stats().graphs == 1
    table = torch.arange(18, dtype=torch.int32).reshape(3, 6)[:, :3]
    expected = _stub().decode_forward(
        tokens=torch.arange(3), positions=torch.full((3,), 9, dtype=torch.int32), page_table=table
    )
    torch.testing.assert_close(out, expected)


# -- when the precompiled path applies --------------------------------------------------------


def test_precompiled_steps_are_on_by_default_and_off_with_freezing(tmp_path: Path) -> None:
    on = CompileOptions(mode="inductor", cache_dir=tmp_path)
    assert on.precompiled and on.artifact_directory() == tmp_path / "steps"
    assert CompileOptions(mode="inductor", freezing=True).artifact_directory() is None
    assert CompileOptions(mode="inductor", precompiled=False).artifact_directory() is None
    assert CompileOptions().artifact_directory() is None  # eager
    with pytest.raises(ConfigError, match=r"device\.inductor\.precompiled: must be a boolean"):
        CompileOptions(precompiled="yes")  # type: ignore[arg-type]


def test_the_store_keeps_its_most_recently_used_files_within_its_bound(tmp_path: Path) -> None:
    """Older keys' files do not pile up: past the bound the least recently used go, never
    the file just written; a load marks a file used; a crashed save's temporary file goes
    once stale, one in progress stays."""
    import os
    import time

    from llmrt.runtime.step_artifacts import STALE_TEMPORARY_S, SUFFIX, ArtifactStore

    store = ArtifactStore(tmp_path)
    now = time.time()
    files = []
    for age, name in enumerate(["e", "d", "c", "b", "a"]):  # "a" the oldest
        path = tmp_path / f"decode-{name}{SUFFIX}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 10 * age, now - 10 * age))
        files.append(path)
    stale = tmp_path / f".decode-z{SUFFIX}.abc123"
    stale.write_bytes(b"partial")
    os.utime(stale, (now - 2 * STALE_TEMPORARY_S, now - 2 * STALE_TEMPORARY_S))
    fresh = tmp_path / f".decode-y{SUFFIX}.def456"
    fresh.write_bytes(b"partial")
    other = tmp_path / "notes.txt"
    other.write_text("not ours")

    os.utime(files[4], (now + 5, now + 5))  # "a" used most recently (as a load does)
    removed = store.prune(keep=files[3], max_bytes=250)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert set(removed) == {files[1], files[2], stale}
    assert left == sorted([files[0].name, files[3].name, files[4].name, fresh.name, "notes.txt"])
    assert store.prune(max_bytes=10**9) == []
    # A missing directory is an empty store.
    assert ArtifactStore(tmp_path / "absent").prune(max_bytes=0) == []
