"""``llmrt audit``: real lifecycle logs audit clean; each broken rule is reported."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)
from test_teardown import SPEC_LANE_CLEANUP  # the spec's order, written out once

from llmrt.cli.main import main
from llmrt.lifecycle.audit import check


def write_log(path: Path, records: Sequence[Mapping[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def audit(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, list[str]]:
    code = main(["audit", str(path)])
    return code, capsys.readouterr().out.splitlines()


def scope(event: str, name: str) -> dict[str, Any]:
    return {"event": f"scope.{event}", "component": "scope", "scope": name, "object_id": name}


def kv(event: str, obj: str = "0xkv", lane: int = 0, device: str = "cpu:0/lane0") -> dict[str, Any]:
    record = {"event": f"kv.{event}", "component": "paged_kv_cache", "object_id": obj, "lane": lane}
    return {**record, "device": device} if event == "allocated" else record


def lane_device(lane: int, device: str) -> dict[str, Any]:
    return {"event": "device.opened", "component": "device", "lane": lane, "device": device}


def owned(name: str, index: int, root: str = "0xr") -> dict[str, Any]:
    return {
        "event": "scope.owned",
        "component": "scope",
        "scope": "runtime",
        "object": name,
        "index": index,
        "root": root,
    }


def closed(name: str, index: int, root: str = "0xr", failed: bool = False) -> dict[str, Any]:
    return {
        "event": "cleanup.failed" if failed else "cleanup.step",
        "component": "scope",
        "object_id": "runtime",
        "step": f"runtime/{name}",
        "index": index,
        "root": root,
    }


def trace(event: str, key: str = "t1", obj: str = "0xtc") -> dict[str, Any]:
    return {
        "event": f"trace.{event}",
        "component": "trace_compiler",
        "object_id": obj,
        "trace": key,
    }


def compiled(signature: str, obj: str = "0xpc", event: str = "compiled") -> dict[str, Any]:
    return {"event": f"program.{event}", "object_id": obj, "lane": 0, "signature": signature}


def gate(event: str, obj: str = "0xpc") -> dict[str, Any]:
    return {"event": f"compile_gate.{event}", "object_id": obj, "lane": 0}


def cleanup(
    steps: Sequence[str], obj: str = "0xme", lane: int = 0, failed: Sequence[str] = ()
) -> list[dict[str, Any]]:
    base = {"component": "model_executor", "object_id": obj, "lane": lane}
    return [{"event": "executor.terminal", **base}] + [
        {"event": "cleanup.failed" if step in failed else "cleanup.step", "step": step, **base}
        for step in steps
    ]


def clean_run(obj: str = "0x1") -> list[dict[str, Any]]:
    """A minimal well-formed lifecycle: scopes, KV, compile, gate, trace, cleanup."""
    return [
        scope("entered", "runtime"),
        scope("entered", "runtime/lane0"),
        lane_device(0, "cpu:0/lane0"),
        kv("allocated", obj),
        compiled("decode[b4 w32]", obj),
        gate("closed", obj),
        trace("captured", "t1", obj),
        *cleanup(SPEC_LANE_CLEANUP[:4], obj),
        trace("released", "t1", obj),
        *cleanup(SPEC_LANE_CLEANUP[4:], obj)[1:],
        {"event": "programs.released", "component": "program_compiler", "object_id": obj},
        kv("released", obj),
        scope("exited", "runtime/lane0"),
        scope("exited", "runtime"),
    ]


@pytest.mark.parametrize(
    "overrides",
    [[], ["--set", "lanes=2", "--set", "trace.mode=all"]],
    ids=["default", "2-lanes-all-traced"],
)
def test_a_real_generate_log_audits_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str]
) -> None:
    log = tmp_path / "run.jsonl"
    argv = [
        "generate",
        "tiny-llama",
        "--prompt",
        "hi",
        "--prompt",
        "there",
        "--max-new-tokens",
        "3",
    ]
    assert main([*argv, "--json", "--audit-log", str(log), *overrides]) == 0
    capsys.readouterr()
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    lanes = 2 if overrides else 1
    for name in ("kv.allocated", "kv.released", "trace.captured", "trace.released"):
        assert events.count(name) >= lanes, name
    assert events.count("compile_gate.closed") == lanes
    assert events.count("cleanup.step") >= lanes * len(SPEC_LANE_CLEANUP)
    assert events[0] == "scope.entered" and events[-1] == "scope.exited"
    code, out = audit(capsys, log)
    assert (code, out) == (0, [f"{log}: lifecycle contract holds"])
    assert main(["audit", "--json", str(log)]) == 0
    assert json.loads(capsys.readouterr().out) == {"file": str(log), "violations": []}


def test_a_hand_made_clean_log_and_reused_object_ids_audit_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two runtimes in one log whose objects happen to get the same addresses.
    log = write_log(tmp_path / "ok.jsonl", clean_run("0x1") + clean_run("0x1"))
    assert audit(capsys, log)[0] == 0
    reopened = [gate("closed"), gate("opened"), compiled("prefill[b1 s32]"), gate("closed")]
    assert check(enumerate(reopened, start=1)) == []


CASES: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
    "double-release": (
        [lane_device(0, "cpu:0/lane0"), kv("allocated"), kv("released"), kv("released")],
        ["[kv-once] line 4: KV cache 0xkv released twice"],
    ),
    "release-without-allocation": (
        [kv("released", "0xghost")],
        ["[kv-once] line 1: KV cache 0xghost released but never allocated"],
    ),
    "double-trace-release": (
        [trace("captured"), trace("released"), trace("released")],
        ["[trace-once] line 3: trace t1 released twice"],
    ),
    "compile-after-gate-closed": (
        [compiled("decode[b4 w32]"), gate("closed"), compiled("prefill[regular b2 s64 w32]")],
        [
            "[no-compile-after-activation] line 3: lane 0: program prefill[regular b2 s64 w32] "
            "compiled after the compile gate closed (line 2)"
        ],
    ),
    "cleanup-out-of-order": (
        cleanup([*SPEC_LANE_CLEANUP[:4], "paged_kv_cache", "traces", *SPEC_LANE_CLEANUP[5:7]]),
        [
            "[lane-cleanup-order] line 1: lane 0 executor 0xme cleaned up as "
            f"{[*SPEC_LANE_CLEANUP[:4], 'paged_kv_cache', 'traces', *SPEC_LANE_CLEANUP[5:7]]}, "
            f"expected the order {SPEC_LANE_CLEANUP}"
        ],
    ),
    "cleanup-step-missing": (
        cleanup([s for s in SPEC_LANE_CLEANUP if s != "decode_transients"]),
        [
            "[lane-cleanup-missing] line 1: lane 0 executor 0xme never completed cleanup "
            "step(s) ['decode_transients']"
        ],
    ),
    "cleanup-step-twice": (
        cleanup([*SPEC_LANE_CLEANUP, "paged_kv_cache"]),
        [
            "[lane-cleanup-order] line 10: lane 0 executor 0xme completed "
            "['paged_kv_cache'] more than once"
        ],
    ),
    "cleanup-failed-never-retried": (
        [*cleanup(SPEC_LANE_CLEANUP, failed=["traces"])],
        [
            "[lane-cleanup-missing] line 1: lane 0 executor 0xme never completed cleanup "
            "step(s) ['traces']",
            "[cleanup-failed] line 6: model_executor lane 0 0xme: cleanup step traces failed "
            "and was never retried successfully (None)",
        ],
    ),
    "orphan-left": (
        [
            {
                "event": "resource.orphaned",
                "component": "trace_compiler",
                "lane": 0,
                "object_id": "0xtc",
                "path": "trace t1",
            },
            {
                "event": "resource.orphaned",
                "component": "trace_compiler",
                "lane": 0,
                "object_id": "0xtc",
                "path": "trace t2",
            },
            {
                "event": "resource.recovered",
                "component": "trace_compiler",
                "lane": 0,
                "object_id": "0xtc",
                "path": "trace t2",
            },
        ],
        ["[orphan] line 1: trace_compiler lane 0 0xtc: trace t1 orphaned and never recovered"],
    ),
    "tensor-orphans-sharing-a-path": (
        [
            {
                "event": "resource.orphaned",
                "component": "tensor_resources",
                "path": "resources[0][0]",
                "tensor": "0xa",
            },
            {
                "event": "resource.orphaned",
                "component": "tensor_resources",
                "path": "resources[0][0]",
                "tensor": "0xb",
            },
            {
                "event": "resource.recovered",
                "component": "tensor_resources",
                "path": "resources[0][0]",
                "tensor": "0xb",
            },
        ],
        [
            "[orphan] line 1: tensor_resources lane None None: resources[0][0] orphaned and "
            "never recovered"
        ],
    ),
    "recompile-after-gate-closed": (
        [gate("closed"), compiled("decode[b4 w32]", event="recompiled")],
        [
            "[no-compile-after-activation] line 2: lane 0: program decode[b4 w32] recompiled "
            "after the compile gate closed (line 1)"
        ],
    ),
    "kv-on-another-lanes-device": (
        [
            lane_device(0, "cpu:0/lane0"),
            lane_device(1, "cpu:0/lane1"),
            kv("allocated", "0xk0", lane=0, device="cpu:0/lane1"),
            kv("released", "0xk0", lane=0),
            {**kv("allocated", "0xk1", lane=1), "device": None},
            kv("released", "0xk1", lane=1),
        ],
        [
            "[one-mesh-per-lane] line 3: lane 0 allocated KV on cpu:0/lane1, not its own "
            "device cpu:0/lane0",
            "[one-mesh-per-lane] line 5: kv.allocated of 0xk1 names no device",
        ],
    ),
    "kv-on-a-lane-with-no-device-open": (
        [kv("allocated", "0xk2", lane=2), kv("released", "0xk2", lane=2)],
        [
            "[one-mesh-per-lane] line 1: lane 2 allocated KV on cpu:0/lane0 with no device of "
            "its own open"
        ],
    ),
    "unknown-event": (
        [{"event": "cleanup.stepp", "component": "scope"}],
        [
            "[unknown-event] line 1: event 'cleanup.stepp' is not one of the lifecycle "
            "catalogue's (llmrt.lifecycle.events): a misspelt or foreign line"
        ],
    ),
    "owned-closed-but-never-recorded": (
        [owned("device", 0), closed("model", 1), closed("device", 0)],
        [
            "[owned-unknown] line 2: runtime/model (created #1) closed, but no scope.owned "
            "line recorded it"
        ],
    ),
    "owned-closed-out-of-order": (
        [
            owned("device", 0),
            owned("model", 1),
            owned("executor", 2),
            closed("executor", 2),
            closed("device", 0),
            closed("model", 1),
        ],
        [
            "[owned-reverse] line 5: runtime/device (created #0) closed while runtime/model "
            "(created #1, line 2) is still open"
        ],
    ),
    "owned-never-closed": (
        [
            {**scope("entered", "runtime"), "root": "0xr"},
            owned("device", 0),
            owned("weights", 1),
            closed("weights", 1),
            {**scope("exited", "runtime"), "root": "0xr"},
        ],
        [
            "[owned-not-closed] line 5: scope tree 0xr ended with 1 owned object(s) never "
            "closed: runtime/device"
        ],
    ),
    "scopes-closed-out-of-order": (
        [
            scope("entered", "runtime"),
            scope("entered", "runtime/device"),
            scope("entered", "runtime/model"),
            scope("exited", "runtime/device"),
            scope("exited", "runtime"),
            scope("exited", "runtime/model"),
        ],
        [
            "[scope-reverse] line 4: scope runtime/device exited while runtime/model "
            "(entered later) is open",
            "[scope-reverse] line 5: scope runtime exited before runtime/model",
        ],
    ),
    "never-released": (
        [
            scope("entered", "runtime"),
            lane_device(0, "cpu:0/lane0"),
            kv("allocated"),
            trace("captured", "t9"),
        ],
        [
            "[kv-once] line 3: KV cache 0xkv never released",
            "[trace-once] line 4: trace t9 never released",
            "[scope-reverse] scope runtime was entered but never exited",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_broken_rule_exits_1_and_is_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    records, expected = CASES[case]
    log = write_log(tmp_path / f"{case}.jsonl", records)
    code, out = audit(capsys, log)
    assert code == 1
    assert out == [*expected, f"{len(expected)} violation(s) in {log}"]


def test_every_violation_of_a_log_is_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records: list[dict[str, Any]] = []
    for number, case in enumerate(sorted(CASES)):
        # Distinct objects, lanes and scope trees per case, so the rules do not interact.
        for r in CASES[case][0]:
            moved = dict(r)
            if "scope" not in r and "object_id" in r:
                moved["object_id"] = f"{r['object_id']}-{case}"
            if "lane" in r:
                moved["lane"] = 100 * (number + 1) + r["lane"]
            if "root" in r:
                moved["root"] = f"{r['root']}-{case}"
            records.append(moved)
    log = write_log(tmp_path / "all.jsonl", records)
    code, out = audit(capsys, log)
    assert code == 1
    assert out[-1] == f"{len(out) - 1} violation(s) in {log}"
    rules = [line.split("]")[0] + "]" for line in out[:-1]]
    assert sorted(set(rules)) == [
        "[cleanup-failed]",
        "[kv-once]",
        "[lane-cleanup-missing]",
        "[lane-cleanup-order]",
        "[no-compile-after-activation]",
        "[one-mesh-per-lane]",
        "[orphan]",
        "[owned-not-closed]",
        "[owned-reverse]",
        "[owned-unknown]",
        "[scope-reverse]",
        "[trace-once]",
        "[unknown-event]",
    ]
    assert len(out) - 1 == sum(len(expected) for _, expected in CASES.values())
    assert main(["audit", "--json", str(log)]) == 1
    assert json.loads(capsys.readouterr().out)["violations"] == out[:-1]


def test_a_malformed_log_is_a_one_line_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps(kv("allocated")) + "\n{not json\n", encoding="utf-8")
    assert main(["audit", str(log)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"llmrt: error: {log}:2: not a JSON line "
        "(Expecting property name enclosed in double quotes)"
    ]
    log.write_text('{"no_event": 1}\n', encoding="utf-8")
    assert main(["audit", str(log)]) == 2
    assert "needs an 'event' field" in capsys.readouterr().err
