"""Child processes measured as a user meets them: wall time and the child's own peak RSS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen(kw_only=True)
class ProcessRun:
    """One finished child: wall seconds, its peak resident set (bytes), exit code, stderr."""

    argv: tuple[str, ...]
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    timed_out: bool
    stderr_tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# Runs the measured command from a fresh, small interpreter: a child forked from a large
# process (pytest, a bench that loaded a model) reports that process's resident set as its
# own peak (Linux records the pre-exec high-water mark in ru_maxrss).
_LAUNCHER = """
import json, os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as fh:
    json.dump({"wall_s": wall, "maxrss_kb": usage.ru_maxrss,
               "returncode": os.waitstatus_to_exitcode(status)}, fh)
"""


def run_process(
    argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None
) -> ProcessRun:
    """Run ``argv`` to completion (killed after ``timeout_s``) and measure it.

    The peak RSS is the command's own (``wait4`` rusage, like ``/usr/bin/time -v``; Linux
    reports kilobytes), measured by a small launcher so this process's size never leaks in.
    """
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "err"), "w+b") as err:
        result = os.path.join(tmp, "result.json")
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, result, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=None if env is None else dict(env),
            start_new_session=True,  # a timeout kills the launcher and the command together
        )
        start = time.perf_counter()
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        elapsed = time.perf_counter() - start
        err.seek(0)
        tail = err.read()[-2000:].decode("utf-8", "replace")
        try:
            with open(result, encoding="utf-8") as fh:
                measured = json.load(fh)
        except (OSError, ValueError):
            measured = {"wall_s": elapsed, "maxrss_kb": 0, "returncode": proc.returncode or -1}
    return ProcessRun(
        argv=tuple(argv),
        wall_s=float(measured["wall_s"]),
        peak_rss_bytes=int(measured["maxrss_kb"]) * 1024,
        returncode=int(measured["returncode"]),
        timed_out=timed_out,
        stderr_tail=tail,
    )
