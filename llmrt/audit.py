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

from llmrt.errors import RequestError
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
    """``(line number, record)`` for every non-blank line; a malformed line is a user error."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RequestError(f"{path}:{number}", f"not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or "event" not in record:
                raise RequestError(f"{path}:{number}", "a lifecycle record needs an 'event' field")
            events.append((number, record))
    return events


def check(events: Iterable[tuple[int, Mapping[str, Any]]]) -> list[Violation]:
    """Every violation of the lifecycle contract, in log order (end-of-log leaks last).

    Object ids are memory addresses, which a later object may reuse once the first is gone,
    so an allocation after a release starts a new lifetime rather than counting as a second
    allocation, a lane's cleanup sequence starts afresh at ``executor.terminal``, and a
    runtime's closed compile gates are forgotten when its root scope exits.
    """
    found: list[Violation] = []
    kv_open: dict[str, int] = {}  # object id -> line of the unreleased allocation
    kv_done: set[str] = set()
    traces_open: dict[tuple[str, str], int] = {}
    traces_done: set[tuple[str, str]] = set()
    gate_closed: dict[str, int] = {}
    cleanup_seen: dict[tuple[Any, str], list[tuple[str, int]]] = {}
    cleanup_runs: list[tuple[Any, str, list[tuple[str, int]]]] = []
    scopes: list[str] = []
    lane_devices: dict[Any, set[str]] = defaultdict(set)
    for number, e in events:
        name = e.get("event")
        obj = str(e.get("object_id"))
        lane = e.get("lane")
        if name == "kv.allocated":
            if obj in kv_open:
                found.append(
                    Violation(
                        rule="kv-once",
                        line=number,
                        message=f"KV cache {obj} allocated again before its release "
                        f"(allocated on line {kv_open[obj]})",
                    )
                )
            kv_open[obj] = number
            kv_done.discard(obj)
            if "device" in e:
                lane_devices[lane].add(str(e["device"]))
        elif name == "kv.released":
            if kv_open.pop(obj, None) is not None:
                kv_done.add(obj)
            else:
                again = "released twice" if obj in kv_done else "released but never allocated"
                found.append(
                    Violation(rule="kv-once", line=number, message=f"KV cache {obj} {again}")
                )
        elif name == "trace.captured":
            key = (obj, str(e.get("trace")))
            if key in traces_open:
                found.append(
                    Violation(
                        rule="trace-once",
                        line=number,
                        message=f"trace {key[1]} captured again before its release "
                        f"(captured on line {traces_open[key]})",
                    )
                )
            traces_open[key] = number
            traces_done.discard(key)
        elif name == "trace.released":
            key = (obj, str(e.get("trace")))
            if traces_open.pop(key, None) is not None:
                traces_done.add(key)
            else:
                again = "released twice" if key in traces_done else "released but never captured"
                found.append(
                    Violation(rule="trace-once", line=number, message=f"trace {key[1]} {again}")
                )
        elif name == "compile_gate.closed":
            gate_closed.setdefault(obj, number)
        elif name == "compile_gate.opened":
            gate_closed.pop(obj, None)
        elif name == "program.compiled" and obj in gate_closed:
            found.append(
                Violation(
                    rule="no-compile-after-activation",
                    line=number,
                    message=f"lane {lane}: program {e.get('signature')} compiled after the "
                    f"compile gate closed (line {gate_closed[obj]})",
                )
            )
        elif name == "executor.terminal":
            run: list[tuple[str, int]] = []
            cleanup_seen[(lane, obj)] = run
            cleanup_runs.append((lane, obj, run))
        elif name == "cleanup.step" and e.get("component") == "model_executor":
            if (lane, obj) not in cleanup_seen:
                run = []
                cleanup_seen[(lane, obj)] = run
                cleanup_runs.append((lane, obj, run))
            cleanup_seen[(lane, obj)].append((str(e.get("step")), number))
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
            if "/" not in scope:
                gate_closed.clear()
    for lane, obj, steps in cleanup_runs:
        names = [step for step, _ in steps]
        order = [CLEANUP_STEPS.index(s) for s in names if s in CLEANUP_STEPS]
        if order != sorted(order):
            found.append(
                Violation(
                    rule="lane-cleanup-order",
                    line=steps[0][1] if steps else None,
                    message=f"lane {lane} executor {obj} cleaned up as {names}, "
                    f"expected the order {list(CLEANUP_STEPS)}",
                )
            )
    for obj, line in kv_open.items():
        found.append(Violation(rule="kv-once", line=line, message=f"KV cache {obj} never released"))
    for key, line in traces_open.items():
        found.append(
            Violation(rule="trace-once", line=line, message=f"trace {key[1]} never released")
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
