"""Check a JSON-lines lifecycle log against the runtime's lifecycle contract.

``llmrt audit LOG`` exits 1 and lists every violation of these rules (0 when none):

- ``cleanup-failed``: a ``cleanup.failed`` step that no later retry of the same step (same
  component, lane, object, step and scope tree) completed;
- ``orphan``: a ``resource.orphaned`` resource never ``resource.recovered``;
- ``lane-cleanup-missing``: a lane executor that became terminal without completing each of
  the spec's eight cleanup steps;
- ``lane-cleanup-order``: a lane executor that attempted its cleanup steps out of the spec's
  order (first attempts; a retry of a failed step may come later), or completed a step twice;
- ``no-compile-after-activation``: ``program.compiled`` or ``program.recompiled`` by a program
  compiler (or its step compiler) whose compile gate is closed (``compile_gate.opened``, a
  capture rollback, reopens it);
- ``kv-once`` / ``trace-once``: a KV cache or trace released twice, released without being
  allocated/captured, or never released;
- ``one-mesh-per-lane``: KV allocated on a device other than one of its lane's open devices
  (``device.opened`` names each lane's device; ``kv.allocated`` must name its device);
- ``scope-reverse``: a scope closed before a scope opened inside it (or never closed);
- ``owned-reverse``: an owned object (``scope.owned``) closed, or its close attempted, while an
  object of its scope tree created after it is still open or orphaned;
- ``owned-not-closed``: an owned object with no ``cleanup.step`` by the time its root scope
  exits (or the log ends).

Every rule is keyed by object identity (the object id, the scope tree's ``root``), so any
number of runtimes may share one log.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from llmrt.errors import RequestError
from llmrt.lifecycle.events import CATALOGUE

Record = Mapping[str, Any]

#: The spec's cleanup order for a lane's model executor (seed README, "Cleanup and terminal
#: state"), as the ``cleanup.step`` events name the steps. Written here, not imported from
#: the executor: the audit checks the runtime against the contract, not against itself.
CLEANUP_STEPS: tuple[str, ...] = (
    "external_decode_leases",  # 1. outstanding external decode leases
    "pending_output_reads",  # 2. pending output reads
    "prefill_transients",  # 3. prefill transients
    "decode_transients",  # 4. decode transients
    "traces",  # 5. trace artifacts and persistent inputs
    "program_registry",  # 6. the program registry
    "device_sampling_buffers",  # 7. device sampling buffers
    "paged_kv_cache",  # 8. the model-bound paged KV cache
)


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


@attrs.define(kw_only=True, eq=False)
class _CleanupRun:
    """One lane executor's cleanup: every step attempt and every completion, in log order."""

    lane: Any
    obj: str
    line: int
    attempts: list[str] = attrs.Factory(list)
    completed: dict[str, list[int]] = attrs.Factory(lambda: defaultdict(list))


@attrs.define(kw_only=True, eq=False)
class _Ledger:
    """Resources each acquired once and released once (KV caches, traces), by key."""

    rule: str
    acquired: str  # the verb of acquiring: "allocated", "captured"
    open: dict[Any, tuple[int, str]] = attrs.Factory(dict)  # key -> (line, label)
    done: set[Any] = attrs.Factory(set)

    def acquire(self, audit: _Auditor, *, key: Any, label: str, line: int) -> None:
        if key in self.open:
            audit.add(
                self.rule,
                line,
                f"{label} {self.acquired} again before its release "
                f"({self.acquired} on line {self.open[key][0]})",
            )
        self.open[key] = (line, label)
        self.done.discard(key)

    def release(self, audit: _Auditor, *, key: Any, label: str, line: int) -> None:
        if self.open.pop(key, None) is not None:
            self.done.add(key)
            return
        again = "released twice" if key in self.done else f"released but never {self.acquired}"
        audit.add(self.rule, line, f"{label} {again}")

    def unreleased(self, audit: _Auditor) -> None:
        for line, label in self.open.values():
            audit.add(self.rule, line, f"{label} never released")


class _Auditor:
    """Folds a log into open resources and violations (one instance per ``check``)."""

    def __init__(self) -> None:
        self.found: list[Violation] = []
        self.kv = _Ledger(rule="kv-once", acquired="allocated")
        self.traces = _Ledger(rule="trace-once", acquired="captured")
        self.gate_closed: dict[str, int] = {}  # program compiler id -> line the gate closed
        self.gate_of: dict[str, str] = {}  # step compiler id -> its program compiler's id
        self.runs: dict[tuple[Any, str], _CleanupRun] = {}
        self.all_runs: list[_CleanupRun] = []
        self.failed: dict[tuple[Any, ...], tuple[int, str]] = {}
        self.orphans: dict[tuple[Any, ...], int] = {}
        self.scopes: list[tuple[Any, str]] = []  # (root, path) of every open scope
        self.lane_devices: dict[Any, dict[str, Any]] = defaultdict(dict)  # lane -> id -> parent
        # root -> creation index -> [path, state, line]; state: open, failed or closed
        self.owned: dict[str, dict[int, list[Any]]] = defaultdict(dict)

    def add(self, rule: str, line: int | None, message: str) -> None:
        self.found.append(Violation(rule=rule, line=line, message=message))

    # -- per event -----------------------------------------------------------------------

    def event(self, number: int, e: Record) -> None:
        name = e.get("event")
        if name not in CATALOGUE:
            self.add(
                "unknown-event",
                number,
                f"event {name!r} is not one of the lifecycle catalogue's "
                "(llmrt.lifecycle.events): a misspelt or foreign line",
            )
            return
        handler = getattr(self, "_on_" + str(name).replace(".", "_"), None)
        if handler is not None:
            handler(number, e)

    def _on_kv_allocated(self, number: int, e: Record) -> None:
        obj, lane = str(e.get("object_id")), e.get("lane")
        self.kv.acquire(self, key=obj, label=f"KV cache {obj}", line=number)
        device = e.get("device")
        if device is None:
            self.add("one-mesh-per-lane", number, f"kv.allocated of {obj} names no device")
            return
        expected = self.lane_devices.get(lane)
        if not expected:
            self.add(
                "one-mesh-per-lane",
                number,
                f"lane {lane} allocated KV on {device} with no device of its own open",
            )
        elif str(device) not in expected:
            self.add(
                "one-mesh-per-lane",
                number,
                f"lane {lane} allocated KV on {device}, not its own device {' or '.join(expected)}",
            )

    def _on_kv_released(self, number: int, e: Record) -> None:
        obj = str(e.get("object_id"))
        self.kv.release(self, key=obj, label=f"KV cache {obj}", line=number)

    def _on_device_opened(self, number: int, e: Record) -> None:
        if e.get("lane") is not None and e.get("device") is not None:
            self.lane_devices[e.get("lane")][str(e["device"])] = e.get("parent")

    def _on_device_closed(self, number: int, e: Record) -> None:
        """A closed device's lane devices are gone (their ids may be reused)."""
        closed = str(e.get("device"))
        for devices in self.lane_devices.values():
            for device, parent in list(devices.items()):
                if closed in (device, str(parent)):
                    del devices[device]

    def _on_trace_captured(self, number: int, e: Record) -> None:
        key = (str(e.get("object_id")), str(e.get("trace")))
        self.traces.acquire(self, key=key, label=f"trace {key[1]}", line=number)

    def _on_trace_released(self, number: int, e: Record) -> None:
        key = (str(e.get("object_id")), str(e.get("trace")))
        self.traces.release(self, key=key, label=f"trace {key[1]}", line=number)

    def _on_compile_gate_closed(self, number: int, e: Record) -> None:
        compiler = str(e.get("object_id"))
        self.gate_closed.setdefault(compiler, number)
        if e.get("step_compiler") is not None:
            self.gate_of[str(e["step_compiler"])] = compiler

    def _on_compile_gate_opened(self, number: int, e: Record) -> None:
        self.gate_closed.pop(str(e.get("object_id")), None)

    def _on_programs_released(self, number: int, e: Record) -> None:
        """A cleaned-up compiler's gate is forgotten (its id may be reused)."""
        compiler = str(e.get("object_id"))
        self.gate_closed.pop(compiler, None)
        for steps in [s for s, c in self.gate_of.items() if c == compiler]:
            del self.gate_of[steps]

    def _on_program_compiled(self, number: int, e: Record, verb: str = "compiled") -> None:
        obj = str(e.get("object_id"))
        compiler = self.gate_of.get(obj, obj)
        if compiler in self.gate_closed:
            self.add(
                "no-compile-after-activation",
                number,
                f"lane {e.get('lane')}: program {e.get('signature')} {verb} after the compile "
                f"gate closed (line {self.gate_closed[compiler]})",
            )

    def _on_program_recompiled(self, number: int, e: Record) -> None:
        self._on_program_compiled(number, e, verb="recompiled")

    def _on_executor_terminal(self, number: int, e: Record) -> None:
        key = (e.get("lane"), str(e.get("object_id")))
        run = _CleanupRun(lane=key[0], obj=key[1], line=number)
        self.runs[key] = run
        self.all_runs.append(run)

    def _run_for(self, number: int, e: Record) -> _CleanupRun:
        key = (e.get("lane"), str(e.get("object_id")))
        run = self.runs.get(key)
        if run is None:  # a log that starts mid-cleanup
            run = _CleanupRun(lane=key[0], obj=key[1], line=number)
            self.runs[key] = run
            self.all_runs.append(run)
        return run

    def _failure_key(self, e: Record) -> tuple[Any, ...]:
        return (e.get("component"), e.get("lane"), e.get("object_id"), e.get("step"), e.get("root"))

    def _on_cleanup_step(self, number: int, e: Record) -> None:
        self.failed.pop(self._failure_key(e), None)
        if e.get("component") == "model_executor":
            run = self._run_for(number, e)
            step = str(e.get("step"))
            if step not in run.attempts:
                run.attempts.append(step)
            run.completed[step].append(number)
        elif e.get("component") == "scope":
            self._owned_closed(number, e, state="closed")

    def _on_cleanup_failed(self, number: int, e: Record) -> None:
        self.failed.setdefault(self._failure_key(e), (number, str(e.get("error"))))
        if e.get("component") == "model_executor":
            run = self._run_for(number, e)
            step = str(e.get("step"))
            if step not in run.attempts:
                run.attempts.append(step)
        elif e.get("component") == "scope":
            self._owned_closed(number, e, state="failed")

    def _on_scope_owned(self, number: int, e: Record) -> None:
        root, index = e.get("root"), e.get("index")
        if root is None or not isinstance(index, int):
            return
        self.owned[str(root)][index] = [f"{e.get('scope')}/{e.get('object')}", "open", number]

    def _owned_closed(self, number: int, e: Record, *, state: str) -> None:
        """A close (or attempt) of an owned object while one created after it is still open."""
        root, index = e.get("root"), e.get("index")
        if root is None or not isinstance(index, int):
            return
        objects = self.owned[str(root)]
        later = [(i, o) for i, o in sorted(objects.items()) if i > index and o[1] != "closed"]
        if later:
            i, (path, status, line) = later[-1]
            self.add(
                "owned-reverse",
                number,
                f"{e.get('step')} (created #{index}) closed while {path} (created #{i}, "
                f"line {line}) is still {'orphaned' if status == 'failed' else 'open'}",
            )
        known = objects.get(index)
        if known is None:
            self.add(
                "owned-unknown",
                number,
                f"{e.get('step')} (created #{index}) closed, but no scope.owned line recorded it",
            )
            return
        known[1] = state

    def _unclosed(self, root: str, line: int | None) -> None:
        left = [o[0] for _, o in sorted(self.owned.pop(root, {}).items()) if o[1] != "closed"]
        if left:
            self.add(
                "owned-not-closed",
                line,
                f"scope tree {root} ended with {len(left)} owned object(s) never closed: "
                f"{', '.join(left)}",
            )

    def _orphan_key(self, e: Record) -> tuple[Any, ...]:
        """Who left it and which: a tensor orphan also names the tensor (paths repeat)."""
        return (
            e.get("component"),
            e.get("lane"),
            e.get("object_id"),
            e.get("path"),
            e.get("tensor"),
        )

    def _on_resource_orphaned(self, number: int, e: Record) -> None:
        self.orphans.setdefault(self._orphan_key(e), number)

    def _on_resource_recovered(self, number: int, e: Record) -> None:
        self.orphans.pop(self._orphan_key(e), None)

    def _on_scope_entered(self, number: int, e: Record) -> None:
        self.scopes.append((e.get("root"), str(e.get("scope"))))

    def _on_scope_exited(self, number: int, e: Record) -> None:
        root, scope = e.get("root"), str(e.get("scope"))
        mine = [s for r, s in self.scopes if r == root]
        open_children = [s for s in mine if s.startswith(scope + "/")]
        if open_children:
            self.add("scope-reverse", number, f"scope {scope} exited before {open_children[-1]}")
        if scope in mine:
            if mine[-1] != scope and not open_children:
                self.add(
                    "scope-reverse",
                    number,
                    f"scope {scope} exited while {mine[-1]} (entered later) is open",
                )
            self.scopes.remove((root, scope))
        else:
            self.add("scope-reverse", number, f"scope {scope} exited but was never entered")
        if "/" not in scope and root is not None:
            self._unclosed(str(root), number)

    # -- end of log ----------------------------------------------------------------------

    def finish(self) -> list[Violation]:
        for run in self.all_runs:
            self._check_run(run)
        for (component, lane, obj, step, _), (line, error) in self.failed.items():
            self.add(
                "cleanup-failed",
                line,
                f"{component} lane {lane} {obj}: cleanup step {step} failed and was never "
                f"retried successfully ({error})",
            )
        for (component, lane, obj, path, _), line in self.orphans.items():
            self.add(
                "orphan",
                line,
                f"{component} lane {lane} {obj}: {path} orphaned and never recovered",
            )
        self.kv.unreleased(self)
        self.traces.unreleased(self)
        for _, scope in self.scopes:
            self.add("scope-reverse", None, f"scope {scope} was entered but never exited")
        for root in list(self.owned):
            self._unclosed(root, None)
        return self.found

    def _check_run(self, run: _CleanupRun) -> None:
        order = [CLEANUP_STEPS.index(s) for s in run.attempts if s in CLEANUP_STEPS]
        if order != sorted(order):
            self.add(
                "lane-cleanup-order",
                run.line,
                f"lane {run.lane} executor {run.obj} cleaned up as {run.attempts}, "
                f"expected the order {list(CLEANUP_STEPS)}",
            )
        twice = [s for s, lines in run.completed.items() if len(lines) > 1]
        if twice:
            self.add(
                "lane-cleanup-order",
                run.completed[twice[0]][1],
                f"lane {run.lane} executor {run.obj} completed {twice} more than once",
            )
        missing = [s for s in CLEANUP_STEPS if s not in run.completed]
        if missing:
            self.add(
                "lane-cleanup-missing",
                run.line,
                f"lane {run.lane} executor {run.obj} never completed cleanup step(s) {missing}",
            )


def check(events: Iterable[tuple[int, Record]]) -> list[Violation]:
    """Every violation of the lifecycle contract, in log order (end-of-log findings last).

    Object ids are memory addresses, which a later object may reuse once the first is gone,
    so an allocation after a release starts a new lifetime rather than counting as a second
    allocation, and a closed device's lane devices are forgotten.
    """
    auditor = _Auditor()
    for number, e in events:
        auditor.event(number, e)
    return auditor.finish()


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
