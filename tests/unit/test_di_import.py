"""``llmrt.containers`` imports dependency_injector without the web frameworks it probes for
(FastAPI, pydantic-settings, werkzeug, Flask, Starlette: ~0.6-0.9 s of every process), and
leaves them importable afterwards. Fresh interpreters, since a test session has imported them
already."""

from __future__ import annotations

import subprocess
import sys

PROBED = "('fastapi', 'fast_depends', 'flask', 'werkzeug', 'pydantic_settings', 'starlette')"


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_containers_import_without_the_probed_frameworks_and_leave_them_importable() -> None:
    out = _run(
        "import sys\n"
        "import llmrt.containers as c\n"
        f"print(len([n for n in {PROBED} if n in sys.modules]))\n"
        "import fastapi\n"
        "print(type(fastapi.FastAPI()).__name__)\n"
        "from dependency_injector import providers\n"
        "print(providers.Singleton(dict, a=1)()['a'])\n"
    )
    assert out == ["0", "FastAPI", "1"]


def test_a_framework_imported_before_stays_the_real_module() -> None:
    out = _run(
        "import sys, fastapi\n"
        "before = sys.modules['fastapi']\n"
        "import llmrt.containers\n"
        "print(sys.modules['fastapi'] is before)\n"
    )
    assert out == ["True"]
