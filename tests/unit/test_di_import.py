"""``llmrt.containers`` imports dependency_injector without the web frameworks it probes for
(FastAPI, pydantic-settings, pydantic, werkzeug, Flask, Starlette: ~0.7-1 s of every
process), and leaves them importable afterwards. Fresh interpreters, since a test session has
imported them already."""

from __future__ import annotations

import subprocess
import sys

PROBED = (
    "('fastapi', 'fast_depends', 'flask', 'werkzeug', 'pydantic_settings', 'pydantic', 'starlette')"
)


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_containers_import_without_the_probed_frameworks_and_leave_them_importable() -> None:
    out = _run(
        "import sys\n"
        "import llmrt.containers as c\n"
        f"print(len([n for n in {PROBED} if n in sys.modules]))\n"
        "import fastapi, pydantic\n"
        "print(type(fastapi.FastAPI()).__name__)\n"
        "print(pydantic.BaseModel.__name__)\n"
        "from dependency_injector import providers\n"
        "print(providers.Singleton(dict, a=1)()['a'])\n"
    )
    assert out == ["0", "FastAPI", "BaseModel", "1"]


def test_a_framework_imported_before_stays_the_real_module() -> None:
    out = _run(
        "import sys, fastapi\n"
        "before = sys.modules['fastapi']\n"
        "import llmrt.containers\n"
        "print(sys.modules['fastapi'] is before)\n"
    )
    assert out == ["True"]


def test_the_hidden_import_leaves_no_finder_and_working_providers() -> None:
    """The import leaves no finder behind and the DI providers work (no pydantic needed)."""
    out = _run(
        "import sys\n"
        "import llmrt.containers\n"
        "print(any(type(f).__name__ == '_Hidden' for f in sys.meta_path))\n"
        "from dependency_injector import containers, providers\n"
        "class C(containers.DeclarativeContainer):\n"
        "    config = providers.Configuration()\n"
        "    thing = providers.Factory(dict, size=config.size)\n"
        "c = C(); c.config.from_dict({'size': 3}); print(c.thing()['size'])\n"
    )
    assert out == ["False", "3"]
