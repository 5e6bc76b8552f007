"""The guide's external family package (``docs/examples/llmrt-arcee``), pip-installed as a
model author would: its entry points reach ``family: auto``, ``llmrt recipes validate``,
``llmrt check`` and llmrt's pytest plugin, with no llmrt file edited.

Installed into a temporary directory as pip lays out a wheel (the package and a
``.dist-info`` whose ``entry_points.txt`` comes from the package's ``pyproject.toml``; no
wheel is built, so no build backend or network is needed) and run in subprocesses that put
it on ``PYTHONPATH``, so the test's own interpreter (and registry) stay as they were.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

PACKAGE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "llmrt-arcee"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("arcee")
    source = root / "llmrt-arcee"
    shutil.copytree(PACKAGE, source)
    site = root / "site"
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    for package in ("llmrt_arcee",):
        shutil.copytree(source / package, site / package)
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
            for group, points in project["entry-points"].items()
        )
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    return source, env


def _run(args: list[str], *, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_the_installed_family_passes_validate_and_check(
    installed: tuple[Path, dict[str, str]],
) -> None:
    source, env = installed
    recipe = str(source / "tiny-arcee.yaml")
    validate = _run(["-m", "llmrt.cli", "recipes", "validate", recipe], env=env, cwd=source)
    assert validate.returncode == 0, validate.stderr
    check = _run(["-m", "llmrt.cli", "check", recipe, "--steps", "4"], env=env, cwd=source)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "(family arcee)" in check.stdout and check.stdout.rstrip().endswith("ok")


def test_the_packages_own_tests_pass_with_the_plugin(
    installed: tuple[Path, dict[str, str]],
) -> None:
    source, env = installed
    result = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], env=env, cwd=source)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_without_the_package_the_model_type_is_refused_naming_the_guide() -> None:
    from llmrt.errors import FamilyError
    from llmrt.families.registry import family_for_model_type

    with pytest.raises(FamilyError, match=r"'arcee'.*docs/writing-a-family.md"):
        family_for_model_type("arcee")
