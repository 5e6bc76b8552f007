"""A ttnn recipe through the containers: the toy TTTv2 family over the strict fake ttnn.

The fake is injected the dependency-injector way (``container.device.ttnn_module``), so the
containers open the mesh, split lanes, build the family on each lane's mesh, warm (program
cache filled before every capture), serve through ``LLM`` and tear down exactly as on a chip.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from dependency_injector import providers
from lane_fixtures import single_torch_thread  # noqa: F401  (autouse fixture)
from llmrt.containers import RuntimeContainer
from structlog.testing import capture_logs

from llmrt.errors import DeviceError
from llmrt.lifecycle.audit import check
from llmrt.recipe.loader import Overrides, load_recipe
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.testing.fake_ttnn import FakeTtnn, TtnnRuleViolation
from llmrt.testing.ttnn_toy_model import ToyTtnnModel

PROMPTS = ([72, 105, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [200])
STEPS = 5


def tt_llm(fake: FakeTtnn, overrides: Overrides = ()) -> LLM:
    """``LLM`` over the bundled ``toy-ttnn`` recipe, its device container using ``fake``."""
    recipe = load_recipe("toy-ttnn", overrides=overrides)
    container = RuntimeContainer(recipe=recipe)
    container.device.ttnn_module.override(providers.Object(fake))
    return LLM(recipe=recipe, container=container)


def reference_greedy(model: ToyTtnnModel, prompt: Sequence[int], steps: int) -> list[int]:
    """The toy model's greedy continuation computed on the host from its token history."""
    history, out = list(prompt), []
    for _ in range(steps):
        token = int(model.reference_logits(history).argmax())
        out.append(token)
        history.append(token)
    return out


def test_a_ttnn_recipe_serves_through_llm_and_matches_the_torch_reference() -> None:
    fake = FakeTtnn(system_mesh_shape=(1, 1))
    with capture_logs() as logs:
        llm = tt_llm(fake)
        with llm:
            lane = llm.container.lanes()[0]
            model = lane.model()
            assert isinstance(model, ToyTtnnModel)
            assert model.borrowed_mesh is lane.device().mesh_device  # the lane's own mesh
            outputs = llm.generate(
                list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
            )
            expected = [reference_greedy(model, p, STEPS) for p in PROMPTS]
            assert [list(o.token_ids) for o in outputs] == expected
            assert fake.call_names().count("begin_trace_capture") >= 2  # prefill and decode
            assert fake.call_names().count("execute_trace") >= STEPS
    assert fake.violations == ()
    names = fake.call_names()
    assert names[0] == "open_mesh_device" and names[-1] == "close_mesh_device"
    assert check(enumerate(logs, start=1)) == []


def test_seeded_sampling_through_the_ttnn_recipe_is_reproducible() -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=STEPS, ignore_eos=True)
    runs = []
    for _ in range(2):
        fake = FakeTtnn()
        with tt_llm(fake) as llm:
            runs.append([list(o.token_ids) for o in llm.generate(list(PROMPTS), params)])
        assert fake.violations == ()
    assert runs[0] == runs[1]


def test_mesh_options_are_applied_in_ttnn_order_and_lanes_get_submeshes() -> None:
    fake = FakeTtnn(system_mesh_shape=(1, 2))
    overrides = [
        "device.mesh_shape=[1, 2]",
        "lanes=2",
        "device.ttnn.fabric_config=fabric_1d",
        "device.ttnn.dispatch_core_type=eth",
        "device.ttnn.num_command_queues=2",
        "device.ttnn.l1_small_size=8192",
        "device.ttnn.trace_region_size=2000000",
    ]
    with tt_llm(fake, overrides) as llm:
        meshes = [lane.model().borrowed_mesh for lane in llm.container.lanes()]
        assert [m.get_num_devices() for m in meshes] == [1, 1]
        assert meshes[0] is not meshes[1]
        outputs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=2))
        assert all(len(o.token_ids) >= 1 for o in outputs)
    opened = next(c for c in fake.calls if c.name == "open_mesh_device")
    assert opened.detail == (
        "MeshShape([1, 2]) l1_small_size=8192 trace_region_size=2000000 num_command_queues=2 "
        "dispatch_core_type=ETH fabric=FABRIC_1D"
    )
    names = fake.call_names()
    assert names.index("set_fabric_config") < names.index("open_mesh_device")
    assert names[-2:] == ["close_mesh_device", "set_fabric_config"]  # fabric disabled after
    assert fake.fabric_config is fake.FabricConfig.DISABLED
    assert fake.violations == ()


def test_a_trace_over_the_region_budget_fails_startup_with_ttnns_message_and_tears_down() -> None:
    fake = FakeTtnn()
    with pytest.raises(DeviceError, match=r"Creating trace buffers of size \d+B on MeshDevice"):
        tt_llm(fake, ["device.ttnn.trace_region_size=8192"])
    assert fake.violations[0].rule == "trace region"
    assert fake.call_names()[-1] == "close_mesh_device"


def test_the_strict_fake_rejects_what_ttnn_rejects() -> None:
    fake = FakeTtnn()
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=1 << 20)
    ids = fake.from_torch(torch.tensor([[1, 2]], dtype=torch.int32), device=mesh)
    weight = fake.from_torch(torch.ones(4, 8), device=mesh, layout=fake.ROW_MAJOR_LAYOUT)
    with pytest.raises(TtnnRuleViolation, match="Input must be UINT32 or BFLOAT16"):
        fake.embedding(ids, weight)
    with pytest.raises(TtnnRuleViolation, match="Inputs to matmul must be tilized"):
        fake.matmul(weight, weight)
    with pytest.raises(TtnnRuleViolation, match="torch function on a ttnn tensor"):
        torch.add(weight, 1)
    for method in ("sum", "float", "view"):
        with pytest.raises(AttributeError, match=f"object has no attribute '{method}'"):
            getattr(weight, method)
    with pytest.raises(TypeError):
        -weight  # noqa: B018  (ttnn.Tensor has no __neg__)


def test_the_emulator_is_selected_from_the_recipe_without_a_chip() -> None:
    """``device.ttnn.module=emulator``: the containers open the recipe's mesh on llmrt's
    computing ttnn emulator (no override, no wheel) and serve the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    with tt_llm(FakeTtnn()) as llm:
        expected = [list(o.token_ids) for o in llm.generate(list(PROMPTS), params)]
    recipe = load_recipe("toy-ttnn", overrides=["device.ttnn.module=emulator"])
    with LLM(recipe=recipe, container=RuntimeContainer(recipe=recipe)) as llm:
        device = llm.container.lanes()[0].device()
        assert isinstance(device.ttnn_module, FakeTtnn)
        assert [list(o.token_ids) for o in llm.generate(list(PROMPTS), params)] == expected
        fake = device.ttnn_module
    assert fake.violations == () and fake.call_names()[-1] == "close_mesh_device"


def test_an_unknown_ttnn_module_is_refused_naming_the_choices() -> None:
    from llmrt.errors import ConfigError

    recipe = load_recipe("toy-ttnn", overrides=["device.ttnn.module=simulator"])
    with pytest.raises(ConfigError, match=r"^device.ttnn.module: .*one of \['emulator'"):
        RuntimeContainer(recipe=recipe).device.device()


def test_the_cli_runs_a_ttnn_recipe_on_the_emulator(capsys: pytest.CaptureFixture[str]) -> None:
    from llmrt.cli.main import main

    argv = ["generate", "toy-ttnn", "--set", "device.ttnn.module=emulator"]
    flags = ["--max-new-tokens", str(STEPS), "--temperature", "0", "--json"]
    code = main([*argv, "--prompt-ids", "72,105,33", *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    fake = FakeTtnn()
    with tt_llm(fake) as llm:
        (expected,) = llm.generate(
            [list(PROMPTS[0])], SamplingParams(temperature=0.0, max_tokens=STEPS)
        )
    assert f'"token_ids": {list(expected.token_ids)}'.replace(" ", "") in out.replace(" ", "")
