"""Property: any valid recipe survives recipe -> dict -> YAML -> recipe unchanged."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, get_args

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmrt.families.registry import family_for_model_type
from llmrt.recipe.loader import (
    CheckpointSpec,
    DecodeSpec,
    DeviceSpec,
    InductorSpec,
    PrefillSpec,
    Recipe,
    ServingSpec,
    TokenizerSpec,
    dump_recipe_yaml,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
)
from llmrt.recipe.schema import (
    CheckpointDType,
    DeviceKind,
    DispatchCoreType,
    FabricConfigName,
    TtnnSpec,
)
from llmrt.runtime.config import PREFILL_BATCH_SIZES, PagedKVCacheConfig, TraceConfig, WarmupConfig

# Text that exercises YAML quoting and the ${ENV} escape.
TRICKY = st.sampled_from(
    ["${HOME}", "$${x}", "a$${b}${c:d}", "$$", "null", "123", "yes", "", "a\x85b", "\u2028"])
TEXT = st.one_of(st.text(max_size=20), TRICKY, st.builds(lambda a, b: a + b, st.text(), TRICKY))
NAME = TEXT.filter(lambda s: bool(s.strip()))
KEY = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False), TEXT,
)
JSON = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(KEY, inner, max_size=3)), max_leaves=8)


@st.composite
def random_model(draw: st.DrawFn) -> dict[str, Any]:
    # Extra keys stay out of the families' config vocabulary (they read and validate it).
    extra = draw(st.dictionaries(KEY.map(lambda k: "x_" + k), JSON, max_size=4))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    width = heads * 2 * draw(st.integers(1, 8))  # RoPE rotates channel pairs
    if draw(st.booleans()):
        dims = {"model_type": "gpt2", "n_embd": width, "n_layer": draw(st.integers(1, 4)),
                "n_head": heads, "n_positions": draw(st.integers(1, 4096))}
    else:
        dims = {"model_type": draw(st.sampled_from(["llama", "mistral", "qwen2"])),
                "hidden_size": width, "num_hidden_layers": draw(st.integers(1, 4)),
                "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                "intermediate_size": draw(st.integers(1, 512)),
                "max_position_embeddings": draw(st.integers(1, 4096))}
    return {**extra, **dims, "vocab_size": draw(st.integers(258, 100_000))}


@st.composite
def weights(draw: st.DrawFn) -> tuple[CheckpointSpec, dict[str, Any], TokenizerSpec]:
    dtype: CheckpointDType = draw(st.sampled_from(get_args(CheckpointDType)))
    seed = draw(st.integers(0, 2**31))
    path = draw(NAME)
    tok_path = TokenizerSpec(source="path", path=draw(NAME))
    kind = draw(st.sampled_from(["random", "safetensors", "gguf-file", "gguf-package"]))
    if kind == "random":
        tokenizer = draw(st.sampled_from([TokenizerSpec(source="byte"), tok_path]))
        return (CheckpointSpec(format="random", seed=seed, dtype=dtype), draw(random_model()),
                tokenizer)
    tokenizer = draw(st.sampled_from([TokenizerSpec(), tok_path]))
    if kind == "safetensors":
        checkpoint = CheckpointSpec(format="safetensors", path=path, dtype=dtype, seed=seed)
    elif kind == "gguf-file":
        checkpoint = CheckpointSpec(format="gguf", path=path, dtype=dtype)
    else:
        checkpoint = CheckpointSpec(format="gguf", package=path, file=draw(NAME), dtype=dtype)
    return checkpoint, {}, tokenizer


@st.composite
def placement(draw: st.DrawFn) -> tuple[DeviceSpec, int]:
    threads = draw(st.none() | st.integers(1, 64))
    if draw(st.booleans()):
        rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 8))
        chips = rows * cols
        # a lane is chips of one mesh row (its tensor-parallel layers)
        lanes = draw(
            st.sampled_from([n for n in range(1, chips + 1) if chips % n == 0
                             and (rows == 1 or cols % (chips // n) == 0)])
        )  # fmt: skip
        mesh = draw(st.sampled_from([None, (rows, cols)]))
        if mesh is None:
            lanes = draw(st.integers(1, 8))
        opened = chips if mesh is not None else lanes
        tp = opened // lanes
        fabrics: list[str | None] = [None, *get_args(FabricConfigName)] if opened >= 2 else [None]
        if opened < 2:
            fabrics.append("disabled")
        if tp > 1:
            fabrics.remove("disabled")
        ttnn = TtnnSpec(
            l1_small_size=draw(st.integers(0, 1 << 20)),
            trace_region_size=draw(st.integers(1, 1 << 30)),
            num_command_queues=draw(st.sampled_from([1, 2])),
            dispatch_core_type=draw(st.sampled_from([None, *get_args(DispatchCoreType)])),
            fabric_config=draw(st.sampled_from(fabrics)),
            tensor_parallel=draw(st.sampled_from([None, tp])),
        )
        device = DeviceSpec(backend="ttnn", mesh_shape=mesh, num_threads=threads, ttnn=ttnn)
        return device, lanes
    kind: DeviceKind | None = draw(st.sampled_from([None, *get_args(DeviceKind)]))
    inductor = InductorSpec(
        freezing=draw(st.booleans()), max_autotune=draw(st.booleans()),
        mode=draw(st.sampled_from([None, "default", "reduce-overhead", "max-autotune"])),
        operations=draw(st.sampled_from([("decode",), ("prefill",), ("decode", "prefill")])),
        precompiled=draw(st.booleans()),
    )
    device = DeviceSpec(
        backend="torch", kind=kind, index=draw(st.integers(0, 7)) if kind == "cuda" else 0,
        compile=draw(st.sampled_from(["eager", "inductor"])), inductor=inductor,
        num_threads=threads,
    )
    return device, draw(st.integers(1, 8))


def _family_of(model: dict[str, Any]) -> str:
    return family_for_model_type(str(model.get("model_type", "llama"))).name


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    checkpoint, model, tokenizer = draw(weights())
    device, lanes = draw(placement())
    block = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    max_blocks = draw(st.integers(1, 4096))
    kv_cache = PagedKVCacheConfig(
        block_size=block, max_num_blocks=max_blocks,
        num_blocks=draw(st.none() | st.integers(1, max_blocks)),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
    )
    chunk = block * draw(st.integers(1, 32))
    max_batch = draw(st.sampled_from(PREFILL_BATCH_SIZES))
    prefill = PrefillSpec(
        max_chunk_size=chunk, batched=draw(st.booleans()), max_batch_size=max_batch,
        seq_len_buckets=draw(st.sampled_from(["tile", "fine"])),
        fine_step=8 * draw(st.integers(1, 32)),
    )
    decode = DecodeSpec(lane_capacity=draw(st.integers(1, 64)), device_sampling=draw(st.booleans()))
    lengths = prefill.buckets().lengths()
    seq_lens = sorted(draw(st.sets(st.sampled_from(lengths), min_size=1, max_size=4)))
    batch_sizes = draw(st.lists(st.sampled_from([b for b in PREFILL_BATCH_SIZES if b <= max_batch]),
                                min_size=1, max_size=4))
    warmup = WarmupConfig(prefill_seq_lens=tuple(seq_lens), prefill_batch_sizes=tuple(batch_sizes),
                          include_decode_top_k=draw(st.booleans()))
    serving = ServingSpec(
        prefix_caching=draw(st.booleans()),
        max_num_batched_tokens=draw(st.none() | st.integers(1, 1 << 16)),
        max_model_len=draw(st.integers(1, block * max_blocks)),
        max_num_seqs=draw(st.none() | st.integers(1, lanes * decode.lane_capacity)),
    )
    if device.backend == "ttnn":
        family = "toy_ttnn"  # the only bundled family with the ttnn backend
        if checkpoint.format == "random":
            model = {
                "model_type": "toy_ttnn", "vocab_size": model["vocab_size"], "hidden_size": 8,
                "num_hidden_layers": 2, "max_position_embeddings": 256,
            }  # fmt: skip
    else:
        family = draw(st.sampled_from(["auto", _family_of(model)]))
    return Recipe(
        name=draw(NAME), description=draw(TEXT),
        family=family,
        checkpoint=checkpoint, model=model, tokenizer=tokenizer, device=device, lanes=lanes,
        kv_cache=kv_cache, prefill=prefill, decode=decode,
        trace=TraceConfig(mode=draw(st.sampled_from(["none", "decode_only", "all"]))),
        warmup=warmup, serving=serving,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes())
def test_recipe_dict_yaml_round_trip(recipe: Recipe) -> None:
    data = recipe_to_dict(recipe)
    assert recipe_from_dict(data) == recipe
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(dump_recipe_yaml(recipe), encoding="utf-8")
        assert load_recipe(str(path), env={"HOME": "/h", "c": "C", "x": "X"}) == recipe
