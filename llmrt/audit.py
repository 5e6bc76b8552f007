"""Check a JSON-lines lifecycle log against the runtime's lifecycle contract.

Rules: every KV allocation and trace capture is released exactly once; nothing
is compiled on a lane after its compile gate closed; each lane's cleanup steps
follow the spec's order; scopes exit in reverse order of entry; each lane
allocates its KV on one device.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from llmrt.model_executor import CLEANUP_STEPS


@attrs.frozen(kw_only=True)
class Violation:
    rule: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        return f"[{self.rule}] {where}{self.message}"


def read_events(path: str) -> list[tuple[int, dict[str, Any]]]:
    events = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or "event" not in record:
                raise ValueError(f"{path}:{number}: a lifecycle record needs an 'event' field")
            events.append((number, record))
    return events


def check(events: Iterable[tuple[int, Mapping[str, Any]]]) -> list[Violation]:
    """Every violation of the lifecycle contract, in log order."""
    found: list[Violation] = []
    kv_alloc: dict[str, int] = {}
    kv_released: dict[str, int] = defaultdict(int)
    traces: dict[tuple[Any, str], int] = {}
    trace_released: dict[tuple[Any, str], int] = defaultdict(int)
    gate_closed: dict[str, int] = {}
    cleanup_seen: dict[Any, list[str]] = defaultdict(list)
    scopes: list[str] = []
    lane_devices: dict[Any, set[str]] = defaultdict(set)
    for number, e in events:
        name = e.get("event")
        obj = str(e.get("object_id"))
        lane = e.get("lane")
        if name == "kv.allocated":
            if obj in kv_alloc:
                found.append(
                    Violation(
                        rule="kv-once", line=number, message=f"KV cache {obj} allocated twice"
                    )
                )
            kv_alloc[obj] = number
            if "device" in e:
                lane_devices[lane].add(str(e["device"]))
        elif name == "kv.released":
            kv_released[obj] += 1
            if obj not in kv_alloc:
                found.append(
                    Violation(
                        rule="kv-once",
                        line=number,
                        message=f"KV cache {obj} released but never allocated",
                    )
                )
        elif name == "trace.captured":
            traces[(obj, str(e.get("trace")))] = number
        elif name == "trace.released":
            key = (obj, str(e.get("trace")))
            trace_released[key] += 1
            if key not in traces:
                found.append(
                    Violation(
                        rule="trace-once",
                        line=number,
                        message=f"trace {key[1]} released but never captured",
                    )
                )
        elif name == "compile_gate.closed":
            gate_closed.setdefault(obj, number)
        elif name == "program.compiled" and obj in gate_closed:
            found.append(
                Violation(
                    rule="no-compile-after-activation",
                    line=number,
                    message=f"lane {lane}: program {e.get('signature')} compiled after the "
                    "compile gate "
                    f"closed (line {gate_closed[obj]})",
                )
            )
        elif name == "cleanup.step" and e.get("component") == "model_executor":
            cleanup_seen[(lane, obj)].append(str(e.get("step")))
        elif name == "scope.entered":
            scopes.append(str(e.get("scope")))
        elif name == "scope.exited":
            scope = str(e.get("scope"))
            open_children = [s for s in scopes if s.startswith(scope + "/")]
            if open_children:
                found.append(
                    Violation(
                        rule="scope-reverse",
                        line=number,
                        message=f"scope {scope} exited before {open_children[-1]}",
                    )
                )
            if scope in scopes:
                if scopes[-1] != scope and not open_children:
                    found.append(
                        Violation(
                            rule="scope-reverse",
                            line=number,
                            message=f"scope {scope} exited while {scopes[-1]} "
                            "(entered later) is open",
                        )
                    )
                scopes.remove(scope)
            else:
                found.append(
                    Violation(
                        rule="scope-reverse",
                        line=number,
                        message=f"scope {scope} exited but was never entered",
                    )
                )
    for obj, line in kv_alloc.items():
        count = kv_released.get(obj, 0)
        if count != 1:
            found.append(
                Violation(
                    rule="kv-once",
                    line=line,
                    message=f"KV cache {obj} released {count} times (expected once)",
                )
            )
    for key, line in traces.items():
        count = trace_released.get(key, 0)
        if count != 1:
            found.append(
                Violation(
                    rule="trace-once",
                    line=line,
                    message=f"trace {key[1]} released {count} times (expected once)",
                )
            )
    for (lane, obj), steps in cleanup_seen.items():
        order = [CLEANUP_STEPS.index(s) for s in steps if s in CLEANUP_STEPS]
        if order != sorted(order):
            found.append(
                Violation(
                    rule="lane-cleanup-order",
                    line=None,
                    message=f"lane {lane} executor {obj} cleaned up as {steps}, "
                    f"expected the order {list(CLEANUP_STEPS)}",
                )
            )
    for scope in scopes:
        found.append(
            Violation(
                rule="scope-reverse",
                line=None,
                message=f"scope {scope} was entered but never exited",
            )
        )
    for lane, devices in lane_devices.items():
        if len(devices) > 1:
            found.append(
                Violation(
                    rule="one-mesh-per-lane",
                    line=None,
                    message=f"lane {lane} allocated KV on {sorted(devices)}",
                )
            )
    return found


def audit_file(path: str, *, as_json: bool = False) -> int:
    """CLI entry: print violations; exit status 0 when clean, 1 otherwise."""
    violations = check(read_events(path))
    if as_json:
        print(json.dumps({"file": path, "violations": [str(v) for v in violations]}, indent=2))
    elif violations:
        for v in violations:
            print(v)
        print(f"{len(violations)} violation(s) in {path}")
    else:
        print(f"{path}: lifecycle contract holds")
    return 1 if violations else 0
