"""The decoder families on the ttnn backend, through the containers, on llmrt's ttnn emulator.

Tiny random Llama (GQA), Qwen2 (q/k/v biases, tied head), Qwen3 (per-head q/k RMSNorm),
Mistral (a sliding window shorter than the prompts), Llama with llama3 RoPE scaling, Granite
(embedding, residual and logit multipliers, its own attention scale), Helium (GPT-J RoPE
pairs), Phi-3 (fused q/k/v and gate/up projections), SmolLM3 (a layer without RoPE) and
Gemma (1 + w norms, scaled embeddings, GELU-tanh MLP) checkpoints saved by transformers
load from the ``hf`` recipe with ``device.backend=ttnn`` and the emulator, on a 1x1 mesh, a
1x2 mesh (N300) and, for Llama and Qwen2, a 1x8 mesh (T3K) with tensor-parallel layers
(weights column/row-sharded over the lane's chips, each chip holding its share of the KV
heads), and run the product's path: batched and chunked prefill over the paged cache,
traced paged decode, device sampling. Their greedy tokens are transformers' float32 greedy
tokens wherever the reference's top-2 margin exceeds the stated bfloat16 tolerance
(teacher-forced on the runtime's own tokens, so one near-tie does not end the comparison); a
tensor-parallel lane's tokens equal the one-chip lane's up to the first such near-tie (the
chips' bfloat16 partial sums and bfloat16 collectives round differently from one chip's matmul).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmrt.errors import ConfigError, UnsupportedError
from llmrt.families.ttnn_model import TtnnCausalLM

transformers = pytest.importorskip("transformers")

#: |ttnn - float32| logits over the float32 logits' largest magnitude with bfloat16 weights
#: and activations (measured 0.016 on these models on one chip; on a 1x8 lane, with the
#: collectives reducing in bfloat16, 0.014 for the 8-query/2-KV-head Llama and Qwen2 against
#: 0.013 on one chip); a token is compared where the reference's top-2 margin exceeds twice it.
TOLERANCE = 0.03
STEPS = 6
PROMPTS = (
    [5, 17, 99, 3, 250, 41, 7, 7, 120, 64, 33],
    [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [9, 8],
    # longer than prefill.max_chunk_size=32: two chunks, the second over the cached first
    list(range(40, 80)),
)
COMMON = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


#: Eight query and eight KV heads: every chip of a 1x8 lane holds one of each.
EIGHT_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 8}


#: A window shorter than three of the four prompts (and than the first chunk).
WINDOW = 8
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
#: Each kind's transformers class prefix and config changes.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3", {}),
    "mistral": ("Mistral", {"sliding_window": WINDOW}),
    "llama3-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "granite": (
        "Granite",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 1.5,
            "logits_scaling": 4.0,
            "attention_multiplier": 0.125,
        },
    ),
    "helium": ("Helium", {}),
    "phi3": ("Phi3", {"pad_token_id": 0}),  # fused [q; k; v] and [gate; up] projections
    # SmolLM3: its first layer without RoPE
    "smollm3": ("SmolLM3", {"no_rope_layers": [0, 1], "pad_token_id": 0}),
    # Gemma: 1 + w norms, embeddings scaled by sqrt(hidden), GELU (tanh) MLP, tied head
    "gemma": ("Gemma", {"tie_word_embeddings": True}),
}


def _hf(kind: str, **changes: Any) -> Any:
    torch.manual_seed(0)
    name, own = KINDS[kind]
    config = getattr(transformers, f"{name}Config")(**{**COMMON, **own, **changes})
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():  # random init is tiny: widen it so logits separate
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "q_norm" in pname or "k_norm" in pname:  # channels told apart
                p.copy_(torch.rand(p.shape) * 1.5 + 0.25)
    return model.eval()


def _saved(
    kind: str, tmp_path_factory: pytest.TempPathFactory, tiny_hf_checkpoint: Path
) -> tuple[str, Path, Any]:
    model = _hf(kind)
    directory = tmp_path_factory.mktemp(f"ttnn-{kind}")
    _save(model, directory, tiny_hf_checkpoint)
    return kind, directory, model


def _save(model: Any, directory: Path, tiny_hf_checkpoint: Path) -> None:
    """``model`` as a checkpoint directory the ``hf`` recipe loads (the tiny tokenizer beside)."""
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(tiny_hf_checkpoint / "tokenizer.json", directory / "tokenizer.json")


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_hf_checkpoint: Path,
) -> tuple[str, Path, Any]:
    """Every kind's checkpoint (the parity tests)."""
    return _saved(request.param, tmp_path_factory, tiny_hf_checkpoint)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_checkpoint(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_hf_checkpoint: Path,
) -> tuple[str, Path, Any]:
    """Llama's and Qwen2's (what does not depend on the parts: caching, mesh splits)."""
    return _saved(request.param, tmp_path_factory, tiny_hf_checkpoint)


def overrides(directory: Path, mesh: list[int]) -> list[str]:
    return [
        f"checkpoint.path={directory}",
        "device.backend=ttnn",
        # scripts/tt_check.sh runs these on a chip (LLMRT_TTNN_MODULE=ttnn)
        f"device.ttnn.module={os.environ.get('LLMRT_TTNN_MODULE', 'emulator')}",
        "device.ttnn.weight_dtype=bfloat16",
        "device.ttnn.trace_region_size=4194304",
        f"device.mesh_shape={mesh}",
        "kv_cache.block_size=16",
        "kv_cache.num_blocks=64",
        "kv_cache.max_num_blocks=64",
        "kv_cache.dtype=bfloat16",
        "prefill.max_chunk_size=32",
        "prefill.max_batch_size=4",
        "prefill.seq_len_buckets=fine",
        "decode.lane_capacity=4",
        "warmup.prefill_seq_lens=[32]",
        "warmup.prefill_batch_sizes=[1, 2]",
        "serving.max_model_len=256",
        "serving.max_num_batched_tokens=256",
    ]


def _tensor_parallel_tokens(
    directory: Path,
    mesh: list[int],
    build: Callable[..., Any],
    *,
    lanes: int = 1,
    inspect: Callable[[TtnnCausalLM, Any], None] | None = None,
) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` on ``lanes`` lanes over ``mesh``, checked to be
    tensor-parallel: each chip holds its share of the KV heads and the steps ran the
    collectives; ``inspect(model, fake_ttnn)`` looks at the first lane's model first."""
    runtime = build("hf", [*overrides(directory, mesh), f"lanes={lanes}"]).ready()
    chips = mesh[0] * mesh[1] // lanes
    assert len(runtime.container.lanes()) == lanes
    lane = runtime.container.lanes()[0]
    model = lane.model()
    assert isinstance(model, TtnnCausalLM)
    assert model.borrowed_mesh.get_num_devices() == chips
    # a lane is chips of one mesh row, or whole rows (a 2-D lane)
    shape = (1, chips) if mesh[1] % chips == 0 else (chips // mesh[1], mesh[1])
    assert tuple(model.borrowed_mesh.shape) == shape
    meta = model.attention_metadata()
    # the vLLM TT plugin's per-chip heads: split, or one replicated head when fewer than chips
    heads = meta.num_kv_heads // chips if meta.num_kv_heads >= chips else 1
    assert (meta.tensor_parallel, meta.kv_heads_per_device) == (chips, heads)
    fake = runtime.container.device.ttnn_module()
    if inspect is not None:
        inspect(model, fake)
    before = fake.call_names()
    tokens: list[list[int]] = runtime.generate(list(PROMPTS), steps=STEPS).tokens
    collectives = {"reduce_scatter", "all_gather"} & set(fake.call_names()[len(before) :])
    assert collectives == (set() if chips == 1 else {"reduce_scatter", "all_gather"})
    runtime.close()
    return tokens


def _check_against_transformers(
    kind: str, hf: Any, generated: list[list[int]], where: str, *, at_least: int
) -> None:
    compared = 0
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, generated, strict=True):
            sequence = torch.tensor([prompt + tokens])
            logits = hf(sequence).logits[0, len(prompt) - 1 : -1]  # predicts each emitted token
            scale = float(logits.abs().max())
            top2 = logits.topk(2).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * TOLERANCE * scale
            assert torch.equal(torch.tensor(tokens)[clear], logits.argmax(-1)[clear]), (
                f"{kind} on {where}: {tokens} vs transformers {logits.argmax(-1).tolist()}"
            )
            compared += int(clear.sum())
    assert compared >= at_least  # the comparison really ran


def _agree_where_clear(hf: Any, one: list[list[int]], other: list[list[int]], where: str) -> int:
    """``other`` (a tensor-parallel lane's tokens) equals ``one`` (the one-chip lane's) up to
    each prompt's first step where transformers' float32 top-2 margin, on their common
    prefix, is within the bfloat16 tolerance: there the chips' partial sums, rounded to
    bfloat16 and reduced in bfloat16 as ttnn 0.81.1's collectives do, may pick the other
    token, and the two continuations part. Returns the steps compared."""
    compared = 0
    with torch.no_grad():
        for prompt, a, b in zip(PROMPTS, one, other, strict=True):
            logits = hf(torch.tensor([prompt + a])).logits[0, len(prompt) - 1 : -1]
            scale = float(logits.abs().max())
            top2 = logits.topk(2).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * TOLERANCE * scale
            for step, (x, y) in enumerate(zip(a, b, strict=True)):
                if x != y:
                    assert not clear[step], f"{where}: {b} vs one chip's {a} at step {step}"
                    break
                compared += 1
    return compared


@pytest.mark.parametrize("mesh", [[1, 1], [1, 2]], ids=["1x1", "1x2"])
def test_greedy_tokens_follow_transformers_float32(
    checkpoint: tuple[str, Path, Any], mesh: list[int], build: Callable[..., Any]
) -> None:
    """Each kind's greedy tokens are transformers' where its margin allows; on 1x1 the lane's
    decoder is first checked to carry what the checkpoint declares."""
    kind, directory, hf = checkpoint
    inspect = _carries_the_parts(kind, hf) if mesh == [1, 1] else None
    generated = _tensor_parallel_tokens(directory, mesh, build, inspect=inspect)
    _check_against_transformers(kind, hf, generated, f"{mesh}", at_least=len(PROMPTS) * STEPS // 2)


def _carries_the_parts(kind: str, hf: Any) -> Callable[[TtnnCausalLM, Any], None]:
    """What the checkpoint declares reaches the decoder the lane runs: the window on every
    Mistral layer, Qwen3's q/k norm epsilon, the llama3 RoPE and its cos/sin tables
    (transformers' own angles), Granite's multipliers, Helium's RoPE pairs."""

    def check(model: TtnnCausalLM, fake: Any) -> None:
        config = model.decoder_config
        layers = COMMON["num_hidden_layers"]
        assert config.windows == ((WINDOW,) if kind == "mistral" else (None,)) * layers
        assert config.qk_norm_eps == (COMMON["rms_norm_eps"] if kind == "qwen3" else None)
        assert config.rope.kind == ("llama3" if kind == "llama3-rope" else "default")
        assert config.rope_interleaved == (kind == "helium")
        assert config.rope_layers == ((False, True) if kind == "smollm3" else (True,) * layers)
        granite = KINDS["granite"][1]
        assert (config.embedding_scale, config.residual_multiplier, config.logit_scale) == (
            (granite["embedding_multiplier"], granite["residual_multiplier"], 0.25)
            if kind == "granite"
            else (COMMON["hidden_size"] ** 0.5 if kind == "gemma" else 1.0, 1.0, 1.0)
        )
        gemma = kind == "gemma"
        assert (config.norm_unit_offset, config.mlp_activation) == (
            (True, "gelu_tanh") if gemma else (False, "silu")
        )
        if kind == "llama3-rope":
            position = torch.arange(COMMON["max_position_embeddings"])[None]
            cos, _ = hf.model.rotary_emb(torch.zeros(1), position)
            held = fake.to_torch(model._decoder.cos).float()[:, ::2]  # each pair's angle
            expected = cos[0, :, : COMMON["head_dim"] // 2].bfloat16().float()
            torch.testing.assert_close(held, expected)

    return check


def _check_meshes_against_one_chip(
    kind: str, hf: Any, directory: Path, meshes: list[list[int]], build: Callable[..., Any]
) -> None:
    """The one-chip lane's tokens and each mesh's are transformers' where the margin is clear,
    and each mesh's equal the one-chip lane's up to a near-tie (``_agree_where_clear``)."""
    one = _tensor_parallel_tokens(directory, [1, 1], build)
    _check_against_transformers(kind, hf, one, "1x1", at_least=len(PROMPTS) * STEPS // 3)
    for mesh in meshes:
        tokens = _tensor_parallel_tokens(directory, mesh, build)
        _check_against_transformers(kind, hf, tokens, f"{mesh}", at_least=len(PROMPTS) * STEPS // 3)
        assert _agree_where_clear(hf, one, tokens, f"{mesh}") >= len(PROMPTS) * STEPS // 2


@pytest.mark.parametrize(
    ("kind", "meshes"),
    [("llama", [[1, 2], [1, 8]]), ("qwen2", [[1, 8]])],
    ids=["llama", "qwen2"],
)
def test_a_1x8_tensor_parallel_lane_gives_the_one_chip_tokens(
    kind: str,
    meshes: list[list[int]],
    tmp_path: Path,
    tiny_hf_checkpoint: Path,
    build: Callable[..., Any],
) -> None:
    """T3K's layout: the same checkpoint on a 1x1 lane and on tensor-parallel 1x8 (and 1x2)
    lanes: each lane's tokens are transformers' where its top-2 margin allows (these
    eight-head models separate less: a third of the steps are clear), and the lanes emit the
    same tokens until a step whose margin is within the bfloat16 tolerance
    (``_agree_where_clear``)."""
    hf = _hf(kind, **EIGHT_HEADS)
    _save(hf, tmp_path, tiny_hf_checkpoint)
    _check_meshes_against_one_chip(kind, hf, tmp_path, meshes, build)


@pytest.mark.slow
def test_a_galaxy_as_four_1x8_lanes_gives_the_one_chip_tokens(
    tmp_path: Path, tiny_hf_checkpoint: Path, build: Callable[..., Any]
) -> None:
    """Galaxy's layout: a 4x8 mesh as four data-parallel 1x8 lanes, each tensor-parallel
    over its row (half a minute on the emulator's 32 chips, on top of the 1x8 tests that
    cover the same lane: kept out of the default suite)."""
    hf = _hf("llama", **EIGHT_HEADS)
    _save(hf, tmp_path, tiny_hf_checkpoint)
    one = _tensor_parallel_tokens(tmp_path, [1, 1], build)
    tokens = _tensor_parallel_tokens(tmp_path, [4, 8], build, lanes=4)
    assert _agree_where_clear(hf, one, tokens, "4x8") >= len(PROMPTS) * STEPS // 2


@pytest.mark.parametrize(
    ("kind", "meshes"),
    [("llama", [[1, 4], [1, 8]]), ("qwen2", [[1, 8], [2, 4]])],
    ids=["llama", "qwen2"],
)
def test_fewer_kv_heads_than_a_1x8_lanes_chips_are_replicated_and_give_the_one_chip_tokens(
    kind: str,
    meshes: list[list[int]],
    tmp_path: Path,
    tiny_hf_checkpoint: Path,
    build: Callable[..., Any],
) -> None:
    """Two KV heads on a T3K lane (and on 1x4, and on a 2x4 lane: 2-D tensor parallelism,
    its collectives along each mesh axis): each chip holds the one KV head its query heads
    read (the vLLM plugin's ``2 // min(8, 2)``), replicated over 4 (2) chips with Qwen2's
    k/v biases; the tokens are the one-chip lane's until a near-tie
    (``_agree_where_clear``) and transformers' where the margin is clear."""
    hf = _hf(kind, num_attention_heads=8, num_key_value_heads=2)
    _save(hf, tmp_path, tiny_hf_checkpoint)
    _check_meshes_against_one_chip(kind, hf, tmp_path, meshes, build)


@pytest.mark.slow
def test_a_galaxy_as_one_4x8_lane_gives_the_one_chip_tokens(
    tmp_path: Path, tiny_hf_checkpoint: Path, build: Callable[..., Any]
) -> None:
    """Galaxy's 32 chips as one 2-D tensor-parallel lane: 32 query heads one a chip, 8 KV
    heads each replicated on 4 chips, the vocabulary padded to whole tiles on every chip,
    reductions along the rows then the columns (a minute on the emulator's 32 chips)."""
    hf = _hf("llama", num_attention_heads=32, num_key_value_heads=8)
    _save(hf, tmp_path, tiny_hf_checkpoint)
    one = _tensor_parallel_tokens(tmp_path, [1, 1], build)
    tokens = _tensor_parallel_tokens(tmp_path, [4, 8], build, lanes=1)
    _check_against_transformers("llama", hf, tokens, "4x8", at_least=len(PROMPTS) * STEPS // 3)
    assert _agree_where_clear(hf, one, tokens, "4x8") >= len(PROMPTS) * STEPS // 2


def test_heads_that_do_not_split_over_a_1x8_lane_are_named(
    base_checkpoint: tuple[str, Path, Any], build: Callable[..., Any]
) -> None:
    """Four query heads cannot be split over a 1x8 lane's chips: the build names the field."""
    _, directory, _ = base_checkpoint
    with pytest.raises(ConfigError, match=r"num_attention_heads.*divisible by 8"):
        build("hf", overrides(directory, [1, 8])).ready()


def test_kv_heads_that_neither_split_nor_replicate_over_a_1x8_lane_are_named(
    tmp_path: Path, tiny_hf_checkpoint: Path, build: Callable[..., Any]
) -> None:
    """Three KV heads neither divide over 8 chips nor replicate evenly onto them."""
    _save(
        _hf("llama", hidden_size=768, num_attention_heads=24, num_key_value_heads=3),
        tmp_path,
        tiny_hf_checkpoint,
    )
    divisor = r"num_key_value_heads: .*or for KV heads a divisor of 8.*got 3"
    with pytest.raises(ConfigError, match=divisor):
        build("hf", overrides(tmp_path, [1, 8])).ready()


def test_a_part_the_ttnn_decoder_lacks_is_refused_at_build_naming_it(
    tiny_hf_checkpoint: Path, tmp_path: Path, build: Callable[..., Any]
) -> None:
    """OLMo2 normalizes q and k over the whole projection (not per head, as Qwen3): the
    ttnn decoder has no realisation of it, and the build names the part."""
    config = transformers.Olmo2Config(**{**COMMON, "tie_word_embeddings": False})
    torch.manual_seed(0)
    _save(transformers.Olmo2ForCausalLM(config), tmp_path, tiny_hf_checkpoint)
    with pytest.raises(UnsupportedError, match=r"attention\.qk_norm='proj'"):
        build("hf", overrides(tmp_path, [1, 1])).ready()


def test_converted_weights_are_cached_and_loaded_by_the_next_build(
    base_checkpoint: tuple[str, Path, Any],
    build: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first build converts the matmul weights and keeps them (``ttnn.as_tensor``'s
    cache files under the cache directory); the second loads every one and generates the
    same tokens."""
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path))
    _, directory, _ = base_checkpoint
    settings = [*overrides(directory, [1, 1]), "device.ttnn.weight_dtype=bfloat8_b"]
    runs, loads = [], []
    for _ in range(2):
        runtime = build("hf", settings).ready()
        runs.append(runtime.generate([PROMPTS[0]], steps=2).tokens)
        loads.append(runtime.container.device.ttnn_module().cache_loads)
        runtime.close()
    files = sorted((tmp_path / "ttnn").glob("*/*.tensorbin"))
    linears = COMMON["num_hidden_layers"] * 7 + 1
    assert len(files) == linears and all("BFLOAT8_B" in f.name for f in files)
    assert loads == [0, linears]
    assert runs[0] == runs[1]
