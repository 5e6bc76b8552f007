"""llmrt's pytest plugin (``pytest11`` entry point ``llmrt``): fixtures for container-driven
tests of a family, a recipe or the runtime itself.

- ``llmrt_runtime(recipe, overrides=..., providers=...)``: a ``RuntimeContainer`` built from
  a recipe, with dependency-injector providers replaced by dotted path
  (``{"device.device": my_device}``; a number picks a declared lane:
  ``{"lane_containers.0.output_reader": reader}``); closed at teardown, every container's
  cleanup errors together failing the test.
  ``llmrt_module_runtime`` / ``llmrt_session_runtime`` are the same for containers a test
  module / the whole session shares.
- ``faulty_device(fail=..., interrupt=..., inner=None)``: a ``FaultyDevice`` over a CPU
  ``TorchDevice`` (or ``inner``) that fails the Nth call of the named operations (or raises
  ``KeyboardInterrupt`` there, as a Ctrl-C would).
- ``lifecycle_log``: the structured lifecycle log written to a JSON-lines file for the
  test; at teardown ``llmrt.lifecycle.audit.check`` runs over it and the test fails on a violation.
- ``parity_harness(config=RAW | hf_model=..., family=None, device="cpu")``: the
  transformers parity harness (``llmrt.testing.parity.Harness``) over a family's model built
  on ``device`` from the same weights and the same raw ``config.json`` the runtime reads.
- ``torch_device`` (module scope): ``"cpu"``, then ``"cuda:0"`` marked ``cuda`` and skipped
  with the reason where no GPU is present (``llmrt.testing.devices``); a test or fixture that
  asks for it runs on every torch device.

The fixtures only assemble the project's own pieces; import nothing heavy at load time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from llmrt.testing.devices import TORCH_DEVICES, require_device

if TYPE_CHECKING:
    from llmrt.device.base import Device
    from llmrt.families.base import Family
    from llmrt.recipe.loader import Overrides
    from llmrt.testing.faulty_device import FaultyDevice
    from llmrt.testing.parity import Harness


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``cuda`` marker the ``torch_device`` fixture's GPU case carries."""
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


@pytest.fixture(scope="module", params=TORCH_DEVICES)
def torch_device(request: pytest.FixtureRequest) -> str:
    """A torch device string: ``cpu``, then ``cuda:0`` (skipped, with why, without a GPU).

    Module scope, so a module's lane or harness fixtures can build on it once per device.
    """
    return require_device(str(request.param))


def _runtime_factory() -> Iterator[Callable[..., Any]]:
    """Yield ``make(recipe, overrides=..., providers=...)``; close what it built after."""
    from dependency_injector import providers as di

    from llmrt.containers import RuntimeContainer, close_runtime
    from llmrt.errors import CleanupError
    from llmrt.recipe.loader import load_recipe

    built: list[Any] = []

    def make(
        recipe: str,
        overrides: Overrides = (),
        *,
        providers: Mapping[str, Any] | None = None,
    ) -> Any:
        container = RuntimeContainer(recipe=load_recipe(recipe, overrides=overrides))
        built.append(container)
        for path, value in (providers or {}).items():
            target: Any = container
            for part in path.split("."):
                if part.isdigit():  # a declared lane: lane_containers.0
                    target = (target() if isinstance(target, di.Provider) else target)[int(part)]
                else:
                    target = getattr(target, part)
            target.override(value if isinstance(value, di.Provider) else di.Object(value))
        return container

    yield make
    failures: list[tuple[str, BaseException]] = []
    for number, container in reversed(list(enumerate(built))):
        try:
            close_runtime(container)
        except CleanupError as exc:  # every container is closed; all failures are raised
            failures += [(f"container {number}: {step}", error) for step, error in exc.failures]
        except Exception as exc:
            failures.append((f"container {number}", exc))
    if failures:
        raise CleanupError(failures)


@pytest.fixture
def llmrt_runtime(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Factory: ``llmrt_runtime(recipe, overrides=(), providers={})`` -> ``RuntimeContainer``.

    ``overrides`` are ``--set``-style strings or a mapping of dotted paths. With
    ``lifecycle_log`` in the same test, the log starts first and is audited after every
    container here is closed, so the audit sees whole lifetimes.
    """
    if "lifecycle_log" in request.fixturenames:
        request.getfixturevalue("lifecycle_log")
    yield from _runtime_factory()


@pytest.fixture(scope="module")
def llmrt_module_runtime() -> Iterator[Callable[..., Any]]:
    """``llmrt_runtime`` for containers a whole test module shares (closed after its last
    test; no ``lifecycle_log``, which is per test)."""
    yield from _runtime_factory()


@pytest.fixture(scope="session")
def llmrt_session_runtime() -> Iterator[Callable[..., Any]]:
    """``llmrt_runtime`` for containers the whole session shares (a large model built once)."""
    yield from _runtime_factory()


@pytest.fixture(scope="session")
def faulty_device() -> Callable[..., FaultyDevice]:
    """Factory: ``faulty_device(fail={"deallocate": 2}, interrupt={"close": 1}, inner=None)``
    -> ``FaultyDevice`` (``interrupt``: calls that raise ``KeyboardInterrupt``)."""
    from llmrt.device.torch import TorchDevice
    from llmrt.testing.faulty_device import FaultyDevice

    def make(
        *,
        fail: Mapping[str, int | Sequence[int]] | None = None,
        interrupt: Mapping[str, int | Sequence[int]] | None = None,
        inner: Device | None = None,
    ) -> FaultyDevice:
        return FaultyDevice(
            inner if inner is not None else TorchDevice("cpu"),
            fail=fail or {},
            interrupt=interrupt,
        )

    return make


@pytest.fixture
def lifecycle_log(tmp_path: Path) -> Iterator[Path]:
    """The lifecycle log of this test (JSON lines), audited at teardown."""
    from llmrt.lifecycle.audit import check, read_events
    from llmrt.lifecycle.events import configure_logging, reset_logging

    path = tmp_path / "lifecycle.jsonl"
    configure_logging(level="error", audit_path=path, console=False, audit_level="debug")
    yield path
    reset_logging()
    violations = check(read_events(str(path)))
    if violations:
        shown = "\n".join(str(v) for v in violations[:10])
        pytest.fail(f"lifecycle contract broken ({len(violations)} violation(s)):\n{shown}")


@pytest.fixture(scope="session")
def parity_harness() -> Callable[..., Harness]:
    """Factory: ``parity_harness(config=RAW, family=None, seed=0, device="cpu")`` -> parity
    ``Harness``.

    ``config`` is a raw ``config.json`` mapping (``model_type`` included): transformers builds
    a random model of it (``parity.reference_model``) and llmrt builds its model from
    ``config`` itself, as the runtime does, on the same weights. Or pass ``hf_model`` (a
    transformers model) with ``hf_config`` (the raw mapping it was made from; read from its
    directory when it was loaded by ``from_pretrained``). ``family`` defaults to the one
    ``family: auto`` picks for the config's ``model_type``. The model is built on ``device``
    (transformers stays on the CPU, in float32) and uses the linear kernel
    ``device.linear: auto`` picks there, as serving does.
    """
    import torch

    from llmrt.families.layers import select_linear_kernel
    from llmrt.families.registry import family_for_model_type
    from llmrt.testing.parity import Harness, raw_config, reference_model

    def make(
        *,
        config: Mapping[str, Any] | None = None,
        hf_model: Any = None,
        hf_config: Mapping[str, Any] | None = None,
        family: Family | None = None,
        seed: int = 0,
        device: str = "cpu",
    ) -> Harness:
        if (config is None) == (hf_model is None):
            raise TypeError("parity_harness needs exactly one of config= and hf_model=")
        if config is not None:
            hf_model, raw = reference_model(config, seed=seed), dict(config)
        else:
            raw = dict(hf_config) if hf_config is not None else raw_config(hf_model)
        hf_model.eval()
        if family is None:
            family = family_for_model_type(str(raw.get("model_type")))
        model = family.build(
            hf_config=raw,
            tensors=hf_model.state_dict(),
            dtype=torch.float32,
            device=device,
        )
        select_linear_kernel(model, choice="auto", device=torch.device(device), dtype=torch.float32)
        return Harness(
            hf_model=hf_model,
            model=model,
            vocab_size=model.config.vocab_size,
            seed=seed,
            device=device,
        )

    return make
