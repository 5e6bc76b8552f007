"""LifetimeScope: exact reverse creation order across nested scopes, failures, idempotence."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from llmrt.errors import CleanupError
from llmrt.lifecycle.scope import LifetimeScope


def recorder(log: list[str], name: str) -> Callable[[], None]:
    def close() -> None:
        log.append(name)

    return close


def failing(log: list[str], name: str, error: Exception) -> Callable[[], None]:
    def close() -> None:
        log.append(name)
        raise error

    return close


def test_objects_close_in_reverse_creation_order() -> None:
    log: list[str] = []
    scope = LifetimeScope("root")
    for name in ("a", "b", "c"):
        assert scope.own(name, object(), recorder(log, name)) is not None

    assert scope.names() == ["a", "b", "c"]
    scope.close()

    assert log == ["c", "b", "a"]
    assert scope.closed
    assert scope.names() == []


def test_own_returns_the_object_and_a_missing_close_is_fine() -> None:
    scope = LifetimeScope("root")
    thing = object()
    assert scope.own("thing", thing) is thing
    scope.close()


def test_nested_scopes_close_at_their_creation_slot() -> None:
    log: list[str] = []
    root = LifetimeScope("root")
    root.own("device", 1, recorder(log, "device"))
    lane = root.child("lane0", lane=0)
    lane.own("kv", 2, recorder(log, "kv"))
    inner = lane.child("inner")
    inner.own("trace", 3, recorder(log, "trace"))
    lane.own("executor", 4, recorder(log, "executor"))
    root.own("group", 5, recorder(log, "group"))

    assert root.creation_order() == [
        "root/device",
        "root/lane0/kv",
        "root/lane0/inner/trace",
        "root/lane0/executor",
        "root/group",
    ]
    assert inner.lane == 0  # a child inherits its parent's lane
    root.close()

    assert log == ["group", "executor", "trace", "kv", "device"]
    assert lane.closed and inner.closed


def test_order_is_global_across_scopes_not_per_scope_blocks() -> None:
    """An object created late in an outer scope closes before earlier inner-scope objects."""
    log: list[str] = []
    root = LifetimeScope("root")
    model = root.child("model")
    model.own("weights", 1, recorder(log, "weights"))
    lane = root.child("lane0")
    lane.own("kv", 2, recorder(log, "kv"))
    model.own("tokenizer", 3, recorder(log, "tokenizer"))  # loaded lazily, after the lane

    root.close()

    assert log == ["tokenizer", "kv", "weights"]


def test_a_failure_stops_teardown_until_its_retry_succeeds() -> None:
    """Like an unwinding stack: what was created before a failed step may still serve it."""
    log: list[str] = []
    first, second = RuntimeError("first"), ValueError("second")
    primary = KeyError("the request that failed")
    root = LifetimeScope("root")
    root.own("a", 1, recorder(log, "a"))
    flaky_b = iter([first, None])
    flaky_c = iter([second, None])

    def b() -> None:
        log.append("b")
        error = next(flaky_b)
        if error is not None:
            raise error

    def c() -> None:
        log.append("c")
        error = next(flaky_c)
        if error is not None:
            raise error

    root.own("b", 2, b)
    child = root.child("lane0")
    child.own("c", 3, c)
    child.own("d", 4, recorder(log, "d"))

    with pytest.raises(CleanupError) as info:
        root.close(primary=primary)

    assert log == ["d", "c"]  # nothing created before c was closed
    err = info.value
    assert err.primary is primary
    assert err.failures == (("root/lane0/c", second),)
    assert "1 cleanup step(s) failed while handling KeyError" in str(err)
    assert root.orphans() == ["root/lane0/c"] and not root.closed
    assert root.creation_order() == ["root/a", "root/b", "root/lane0/c"]

    with pytest.raises(CleanupError) as info:
        root.close()  # c succeeds now, then b fails: a stays open
    assert log == ["d", "c", "c", "b"]
    assert info.value.failures == (("root/b", first),)
    assert root.orphans() == ["root/b"]

    root.close()
    assert log == ["d", "c", "c", "b", "b", "a"]
    assert root.closed and root.orphans() == []


def test_an_interrupt_is_a_failed_step_and_is_re_raised_untouched() -> None:
    log: list[str] = []
    attempts = iter([KeyboardInterrupt(), None])

    def interrupted() -> None:
        log.append("x")
        error = next(attempts)
        if error is not None:
            raise error

    root = LifetimeScope("root")
    root.own("a", 1, recorder(log, "a"))
    root.own("x", 2, interrupted)
    root.own("y", 3, recorder(log, "y"))
    with capture_logs() as events, pytest.raises(KeyboardInterrupt) as info:
        root.close()
    assert log == ["y", "x"]
    assert root.orphans() == ["root/x"] and not root.closed
    assert root.orphan_causes() == {"root/x": info.value}
    failed = [e for e in events if e["event"] == "cleanup.failed"]
    assert [(e["step"], e["interrupted"]) for e in failed] == [("root/x", True)]
    assert any("close again to retry" in note for note in info.value.__notes__)

    root.close()
    assert log == ["y", "x", "x", "a"] and root.closed


def test_a_components_own_cleanup_error_is_flattened() -> None:
    inner = CleanupError([("lane0/traces", RuntimeError("t")), ("lane0/kv", OSError("k"))])
    root = LifetimeScope("root")
    root.own("executor", 1, failing([], "executor", inner))

    with pytest.raises(CleanupError) as info:
        root.close()

    assert [step for step, _ in info.value.failures] == ["lane0/traces", "lane0/kv"]
    assert info.value.primary is None


def test_a_failed_step_is_an_orphan_that_the_next_close_retries_alone() -> None:
    log: list[str] = []
    attempts = iter([RuntimeError("once"), None])

    def flaky() -> None:
        log.append("x")
        error = next(attempts)
        if error is not None:
            raise error

    root = LifetimeScope("root")
    root.own("a", 1, recorder(log, "a"))
    child = root.child("child")
    child.own("x", 1, flaky)
    child.own("y", 2, recorder(log, "y"))

    with pytest.raises(CleanupError):
        root.close()
    assert log == ["y", "x"]
    assert not root.closed and root.orphans() == ["root/child/x"]
    with capture_logs() as events:
        root.close()  # retries the failed step, then carries on
    assert log == ["y", "x", "x", "a"]
    assert root.orphans() == []
    assert [(e["event"], e.get("step") or e.get("scope")) for e in events] == [
        ("cleanup.step", "root/child/x"),
        ("scope.exited", "root/child"),
        ("cleanup.step", "root/a"),
        ("scope.exited", "root"),
    ]
    root.close()  # nothing left: nothing runs, nothing raises
    child.close()
    assert log == ["y", "x", "x", "a"]
    with pytest.raises(RuntimeError, match="root/child is closed"):
        child.own("late", 2)
    with pytest.raises(RuntimeError, match="root is closed"):
        root.child("late")


def test_owned_objects_are_logged_with_scope_index_and_root() -> None:
    with capture_logs() as events:
        root = LifetimeScope("root")
        root.own("device", object())
        lane = root.child("lane0", lane=0)
        lane.own("kv", [], borrowed=True)
        root.own("tokenizer", object(), lambda: None)
        root.close()
    owned = [
        (e["scope"], e["object"], e["index"], e["borrowed"])
        for e in events
        if e["event"] == "scope.owned"
    ]
    assert owned == [
        ("root", "device", 0, False),
        ("root/lane0", "kv", 2, True),
        ("root", "tokenizer", 3, False),
    ]
    assert {e["root"] for e in events if "root" in e} == {f"{id(root):#x}"}
    steps = {e["step"]: e["action"] for e in events if e["event"] == "cleanup.step"}
    assert steps == {
        "root/tokenizer": "closed",
        "root/lane0/kv": "borrowed: left alone",
        "root/device": "nothing to close",
    }


def test_a_child_closes_alone_only_when_nothing_later_is_open() -> None:
    log: list[str] = []
    root = LifetimeScope("root")
    root.own("a", 1, recorder(log, "a"))
    child = root.child("child")
    child.own("b", 2, recorder(log, "b"))
    root.own("c", 3, recorder(log, "c"))

    with pytest.raises(RuntimeError, match=r"root/child cannot close while root/c"):
        child.close()
    assert log == []

    late = root.child("late")
    late.own("d", 4, recorder(log, "d"))
    late.close()  # the newest subtree: closing it alone keeps the order
    assert log == ["d"] and late.closed
    root.close()
    assert log == ["d", "c", "b", "a"]


def test_lifecycle_events_name_every_step_and_scope() -> None:
    with capture_logs() as events:
        root = LifetimeScope("root")
        root.own("a", 1)
        lane = root.child("lane0", lane=0)
        lane.own("kv", 2, failing([], "kv", RuntimeError("boom")))
        with pytest.raises(CleanupError):
            root.close()

    seen = [(e["event"], e.get("scope") or e.get("step")) for e in events]
    assert seen == [
        ("scope.entered", "root"),
        ("scope.owned", "root"),
        ("scope.entered", "root/lane0"),
        ("scope.owned", "root/lane0"),
        ("cleanup.failed", "root/lane0/kv"),
    ]
    failed = next(e for e in events if e["event"] == "cleanup.failed")
    assert failed["error"] == "RuntimeError: boom"
    assert failed["lane"] == 0 and failed["log_level"] == "warning"


def test_an_empty_cleanup_error_still_stops_the_teardown() -> None:
    log: list[str] = []
    root = LifetimeScope("root")
    root.own("a", 1, recorder(log, "a"))
    root.own("b", 2, failing(log, "b", CleanupError([])))
    with pytest.raises(CleanupError) as info:
        root.close()
    assert [step for step, _ in info.value.failures] == ["root/b"]
    assert log == ["b"] and root.orphans() == ["root/b"] and not root.closed
