"""The ttnn decoder on llmrt's ttnn emulator against transformers' float32 models.

Tiny random Llama (GQA), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm with random
weights), Mistral (a sliding window shorter than the prompts), Qwen2 with one windowed layer
of two, Llama with llama3 RoPE scaling and Qwen2 with yarn checkpoints: prefill logits of a
prompt and paged decode logits of a two-row batch, teacher-forced with transformers' greedy
tokens, stay within the stated tolerance of transformers' and pick its tokens wherever the
top-2 margin exceeds twice that tolerance. Granite (embedding, residual and logit
multipliers), Helium (GPT-J RoPE pairs), SmolLM3 (a layer without RoPE) and Gemma (1 + w
norms, scaled embeddings, GELU-tanh MLP) as well. For each part, the same weights without it
give logits beyond that tolerance, so a decoder ignoring the part fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from llmrt.errors import ConfigError
from llmrt.families.registry import family_for_model_type
from llmrt.families.ttnn_decoder import TtnnDecoder, TtnnDecoderConfig, tensor_parallel_refusal
from llmrt.families.ttnn_model import decoder_config
from llmrt.testing.fake_ttnn import FakeTtnn

transformers = pytest.importorskip("transformers")

BS, BLOCKS, WIDTH = 16, 16, 4
PROMPTS = (
    [5, 17, 99, 3, 250, 41, 7, 7, 120, 64, 33],
    [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
)
STEPS = 6
#: |ttnn - float32| over the float32 logits' largest magnitude, per weight dtype.
TOLERANCE = {"bfloat16": 0.03, "bfloat8_b": 0.07}  # measured: 0.018, 0.056 (all kinds)

COMMON = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
GRANITE = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "logits_scaling": 2.0,
    "attention_multiplier": 0.125,
}
#: Each kind's transformers class prefix and config changes, and the class and changes that
#: compute the same weights without the part under test (None: no such part).
KINDS: dict[str, tuple[str, dict[str, object], tuple[str, dict[str, object]] | None]] = {
    "llama": ("Llama", {}, None),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True}, None),
    "qwen3": ("Qwen3", {}, ("Qwen3", {})),  # without: q/k norm weights of one
    "mistral": ("Mistral", {"sliding_window": 6}, ("Mistral", {"sliding_window": None})),
    "qwen2-window": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        ("Qwen2", {}),
    ),
    "llama3-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}, ("Llama", {})),
    "qwen2-yarn": ("Qwen2", {"rope_parameters": YARN_ROPE}, ("Qwen2", {})),
    "granite": ("Granite", GRANITE, ("Llama", {})),
    "helium": ("Helium", {}, ("Llama", {})),  # without: Llama's half-split RoPE pairs
    # SmolLM3: its second layer without RoPE (without the part: RoPE in both, as Llama)
    "smollm3": ("SmolLM3", {"no_rope_layers": [1, 0], "pad_token_id": 0}, ("Llama", {})),
    # Gemma: 1 + w norms, embeddings scaled by sqrt(hidden), GELU (tanh) MLP, tied head
    "gemma": ("Gemma", {"tie_word_embeddings": True}, ("Llama", {"tie_word_embeddings": True})),
}


def _hf_model(kind: str) -> torch.nn.Module:
    """``kind``'s tiny checkpoint (seeded)."""
    torch.manual_seed(0)
    name, changes, _ = KINDS[kind]
    config = getattr(transformers, f"{name}Config")(**{**COMMON, **changes})
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():  # random init is tiny: widen it so logits separate
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif "q_norm" in pname or "k_norm" in pname:  # channels told apart
                p.copy_(torch.rand(p.shape) * 1.5 + 0.25)
    return model.eval()


def _without_part(kind: str, hf: torch.nn.Module) -> torch.nn.Module:
    """``hf``'s weights in a model lacking ``kind``'s part."""
    without = KINDS[kind][2]
    assert without is not None
    name, changes = without
    config = getattr(transformers, f"{name}Config")(**{**COMMON, **changes})
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    state = hf.state_dict()
    if kind == "qwen3":
        state = {k: torch.ones_like(v) if "_norm" in k and "self_attn" in k else v
                 for k, v in state.items()}  # fmt: skip
    model.load_state_dict(state)
    return model.eval()


def _config(hf: torch.nn.Module) -> TtnnDecoderConfig:
    """The decoder config the family's parts give (what a recipe builds)."""
    raw = hf.config.to_dict()
    family = family_for_model_type(raw["model_type"])
    return decoder_config(family.spec(raw, dtype=torch.float32))


@pytest.fixture
def tt() -> Iterator[tuple[FakeTtnn, object]]:
    fake = FakeTtnn()
    mesh = fake.open_mesh_device(fake.MeshShape(1, 1), trace_region_size=1 << 20)
    yield fake, mesh
    fake.close_mesh_device(mesh)
    assert fake.violations == ()


def _int(
    fake: FakeTtnn, mesh: object, values: list[int] | list[list[int]], dtype: object
) -> object:
    return fake.from_torch(torch.tensor(values), dtype=dtype, device=mesh)


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_and_paged_decode_follow_transformers(
    tt: tuple[FakeTtnn, object], kind: str, weight_dtype: str
) -> None:
    fake, mesh = tt
    hf = _hf_model(kind)
    config = _config(hf)
    model = TtnnDecoder(
        tt=fake, mesh=mesh, config=config, weights=hf.state_dict(), weight_dtype=weight_dtype
    )
    shape = (BLOCKS, config.num_kv_heads, BS, config.head_dim)
    kv = [
        tuple(
            fake.from_torch(
                torch.zeros(shape), dtype=fake.bfloat16, layout=fake.TILE_LAYOUT, device=mesh
            )
            for _ in range(2)
        )
        for _ in range(config.num_layers)
    ]
    tables = [[2, 9, 4, 11], [7, 0, 13, 5]]
    tol = TOLERANCE[weight_dtype]

    # transformers' greedy continuations and every position's float32 logits
    sequences, references = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, max_new_tokens=STEPS, do_sample=False)
            sequences.append(out[0].tolist())
            references.append(hf(out).logits[0])

    compared = []

    def check(got: torch.Tensor, ref: torch.Tensor) -> None:
        scale = float(ref.abs().max())
        assert float((got - ref).abs().max()) <= tol * scale
        top2 = ref.topk(2).values
        clear = (top2[..., 0] - top2[..., 1]) > 2 * tol * scale
        assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
        compared.append(int(clear.sum()))

    for row, prompt in enumerate(PROMPTS):
        n = len(prompt)
        # the second prompt in two chunks: its first block, then the rest over the cache
        cuts = [0, BS, n] if n > BS else [0, n]
        for start, end in itertools.pairwise(cuts):
            chunk_table = tables[row][start // BS : -(-end // BS)]
            logits = model.prefill(
                tokens=_int(fake, mesh, prompt[start:end], fake.uint32),
                rope_positions=_int(fake, mesh, list(range(start, end)), fake.uint32),
                page_table=_int(fake, mesh, [tables[row]], fake.int32),
                kv=kv,
                chunk_start=start,
                chunk_page_table=_int(fake, mesh, [chunk_table], fake.int32),
            )
            check(fake.to_torch(logits).float(), references[row][start:end])

    if KINDS[kind][2] is not None:  # the part changes the reference beyond the tolerance
        ablated = _without_part(kind, hf)
        with torch.no_grad():
            for sequence, reference in zip(sequences, references, strict=True):
                other = ablated(torch.tensor([sequence])).logits[0]
                gap = float((other - reference).abs().max())
                assert gap > 2 * tol * float(reference.abs().max()), kind

    for step in range(STEPS - 1):
        positions = [len(p) + step for p in PROMPTS]
        tokens = [seq[pos] for seq, pos in zip(sequences, positions, strict=True)]
        logits = model.decode(
            tokens=_int(fake, mesh, tokens, fake.uint32),
            positions=_int(fake, mesh, positions, fake.int32),
            rope_positions=_int(fake, mesh, positions, fake.uint32),
            page_table=_int(fake, mesh, tables, fake.int32),
            kv=kv,
        )
        got = fake.to_torch(logits).float()
        for row in range(2):
            check(got[row : row + 1], references[row][positions[row] : positions[row] + 1])
    # the token check really ran (bfloat8_b's wider tolerance leaves fewer steps clear)
    assert sum(compared) >= {"bfloat16": 10, "bfloat8_b": 5}[weight_dtype]
    model.close()
    for pair in kv:
        for cache in pair:
            fake.deallocate(cache)


def test_a_decode_step_captured_as_a_trace_replays_like_eager(
    tt: tuple[FakeTtnn, object],
) -> None:
    """The decode step is ttnn ops only: warmed, captured once, replayed on refreshed inputs
    (tokens, positions) it gives the eager step's logits and K/V writes."""
    fake, mesh = tt
    hf = _hf_model("llama")
    config = TtnnDecoderConfig.from_hf(hf.config.to_dict())
    model = TtnnDecoder(tt=fake, mesh=mesh, config=config, weights=hf.state_dict())
    shape = (BLOCKS, config.num_kv_heads, BS, config.head_dim)

    def caches() -> list[tuple[object, object]]:
        return [
            tuple(
                fake.from_torch(
                    torch.randn(shape, generator=torch.Generator().manual_seed(i * 2 + j)),
                    dtype=fake.bfloat16,
                    layout=fake.TILE_LAYOUT,
                    device=mesh,
                )
                for j in range(2)
            )
            for i in range(config.num_layers)
        ]

    traced_kv, eager_kv = caches(), caches()
    table = _int(fake, mesh, [[2, 9, 4, 11], [7, 0, 13, 5]], fake.int32)
    tokens = _int(fake, mesh, [3, 4], fake.uint32)
    positions = _int(fake, mesh, [10, 20], fake.int32)
    rope = _int(fake, mesh, [10, 20], fake.uint32)

    def step(kv: list[tuple[object, object]]) -> object:
        return model.decode(
            tokens=tokens, positions=positions, rope_positions=rope, page_table=table, kv=kv
        )

    step(eager_kv)  # warm: every program enters the cache before the capture
    trace = fake.begin_trace_capture(mesh, cq_id=0)
    out = step(traced_kv)
    fake.end_trace_capture(mesh, trace, cq_id=0)
    for device, value, dtype in (
        (tokens, [77, 5], fake.uint32),
        (positions, [11, 21], fake.int32),
        (rope, [11, 21], fake.uint32),
    ):
        fake.copy_host_to_device_tensor(fake.from_torch(torch.tensor(value), dtype=dtype), device)
    fake.execute_trace(mesh, trace, cq_id=0, blocking=True)

    eager = fake.to_torch(step(eager_kv))
    assert torch.equal(fake.to_torch(out), eager)
    written = ([2, 0], [11, 21 - BS])  # (block, offset) of positions 11 and 21
    for (tk, tv), (ek, ev) in zip(traced_kv, eager_kv, strict=True):
        for traced, eager_cache in ((tk, ek), (tv, ev)):
            got = fake.to_torch(traced)[written[0], :, written[1]]
            assert torch.equal(got, fake.to_torch(eager_cache)[written[0], :, written[1]])
    fake.release_trace(mesh, trace)
    model.close()


def test_tensor_parallel_weights_are_cached_per_split_and_shard_the_heads(
    tmp_path: Path,
) -> None:
    """On a 1x2 mesh every matmul weight is one chip's half (q/k/v/gate/up/LM head by
    columns, o/down by rows), kept in cache files named for the split (a 1x1 build's files
    are not loaded by it) and loaded by the next 1x2 build."""
    hf = _hf_model("llama")
    config = TtnnDecoderConfig.from_hf(hf.config.to_dict())
    weights = hf.state_dict()
    for shape, loads in (((1, 1), 0), ((1, 2), 0), ((1, 2), 15)):
        fake = FakeTtnn(system_mesh_shape=shape)
        if shape != (1, 1):
            fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
        mesh = fake.open_mesh_device(fake.MeshShape(*shape))
        model = TtnnDecoder(tt=fake, mesh=mesh, config=config, weights=weights, cache_dir=tmp_path)
        assert fake.cache_loads == loads
        chips = shape[1]
        layer = model.layers[0]
        q_width = config.num_heads * config.head_dim
        assert tuple(layer["wq"].shape) == (config.hidden_size, q_width // chips)
        assert tuple(layer["wo"].shape) == (q_width // chips, config.hidden_size)
        assert tuple(layer["w2"].shape) == (config.intermediate_size // chips, config.hidden_size)
        assert tuple(model.lm_head.shape) == (config.hidden_size, config.vocab_size // chips)
        assert (model.heads, model.kv_heads) == (
            config.num_heads // chips,
            config.num_kv_heads // chips,
        )
        model.close()
    names = sorted(p.name for p in tmp_path.glob("*.tensorbin"))
    assert len(names) == 2 * 15  # 2 layers x 7 + the LM head, once per split
    assert sum("_tp2_dim-1" in n for n in names) == 2 * 5 + 1  # q, k, v, gate, up; LM head
    assert sum("_tp2_dim-2" in n for n in names) == 2 * 2  # o, down


def test_heads_that_do_not_split_over_the_mesh_are_refused() -> None:
    fake = FakeTtnn(system_mesh_shape=(1, 8))
    fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
    mesh = fake.open_mesh_device(fake.MeshShape(1, 8))
    hf = _hf_model("llama")  # four query heads, two KV heads
    config = TtnnDecoderConfig.from_hf(hf.config.to_dict())
    with pytest.raises(ConfigError, match=r"num_attention_heads: .*divisible by 8"):
        TtnnDecoder(tt=fake, mesh=mesh, config=config, weights=hf.state_dict())
    for kv, chips in ((3, 8), (12, 8), (2, 3)):
        refusal = tensor_parallel_refusal(attrs.evolve(config, num_kv_heads=kv), chips)
        assert refusal == ("num_key_value_heads", kv)
    for kv, chips in ((2, 8), (1, 8), (8, 8), (16, 8)):
        wider = attrs.evolve(config, num_kv_heads=kv, num_heads=16)
        assert tensor_parallel_refusal(wider, chips) is None


def test_fewer_kv_heads_than_chips_put_each_chip_the_kv_head_its_query_heads_read() -> None:
    """Two KV heads on a 1x4 mesh: chip ``d`` computes query heads ``d`` (of four) and holds
    KV head ``d // 2`` (grouped-query attention's group of query head ``d``), its k/v
    projection columns and bias that head's rows."""
    fake = FakeTtnn(system_mesh_shape=(1, 4))
    fake.set_fabric_config(fake.FabricConfig.FABRIC_1D)
    mesh = fake.open_mesh_device(fake.MeshShape(1, 4))
    hf = _hf_model("qwen2")  # four query heads, two KV heads, q/k/v biases
    config = TtnnDecoderConfig.from_hf(hf.config.to_dict())
    weights = hf.state_dict()
    model = TtnnDecoder(
        tt=fake, mesh=mesh, config=config, weights=weights, weight_dtype="bfloat16"
    )
    assert (model.heads, model.kv_heads) == (1, 1)
    d = config.head_dim
    composer = fake.ConcatMeshToTensor(mesh, dim=-1)
    v_weight = weights["model.layers.0.self_attn.v_proj.weight"]
    v_bias = weights["model.layers.0.self_attn.v_proj.bias"]
    wv = fake.to_torch(model.layers[0]["wv"], mesh_composer=composer)
    bv = fake.to_torch(model.layers[0]["bv"], mesh_composer=composer)
    assert tuple(wv.shape) == (config.hidden_size, 4 * d)
    for chip in range(4):
        head = chip // 2
        expected = v_weight[head * d : (head + 1) * d].T.to(torch.bfloat16).float()
        assert torch.equal(wv[:, chip * d : (chip + 1) * d].float(), expected)
        expected_bias = v_bias[head * d : (head + 1) * d].to(torch.bfloat16).float()
        assert torch.equal(bv[0, chip * d : (chip + 1) * d].float(), expected_bias)
    model.close()
    fake.close_mesh_device(mesh)


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2-yarn"])
def test_from_hf_reads_rope_scaling_as_the_families_do(kind: str) -> None:
    """A scaled RoPE in ``config.json`` is read, not refused: the same parameters the
    family's parts carry (and so the same cos/sin tables)."""
    hf = _hf_model(kind)
    assert TtnnDecoderConfig.from_hf(hf.config.to_dict()).rope == _config(hf).rope
    assert _config(hf).rope.kind == KINDS[kind][1]["rope_parameters"]["rope_type"]  # type: ignore[index]
