"""Sampling: distributions, seeding, greedy, penalties, log-probabilities, persistent buffers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from llmrt.errors import RequestError
from llmrt.sampling.sampler import (
    SamplingParams,
    SamplingTensors,
    apply_penalties,
    greedy_argmax,
    gumbel_noise,
    mix_seed,
    sample,
    token_counts,
)
from llmrt.testing.devices import requires_cuda

LOGITS = [2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0]
DRAWS = 20_000
P_CRITICAL = 1e-3


def _tensors(
    params: Sequence[SamplingParams | None],
    *,
    vocab_size: int,
    batch_size: int | None = None,
    **kw: Any,
) -> SamplingTensors:
    return SamplingTensors.from_params(
        params, batch_size=batch_size or len(params), vocab_size=vocab_size, device="cpu", **kw
    )


def _reference(
    logits: Sequence[float],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> list[float]:
    """Target distribution in float64: softmax(logits / T), then top-k, top-p, min-p."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    total = sum(p)
    p = [x / total for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = [True] * len(p)
    if top_k > 0:
        for rank, i in enumerate(order):
            keep[i] = rank < top_k
    if top_p < 1.0:
        mass = sum(p[i] for i in order if keep[i])
        before = 0.0
        for i in order:
            if not keep[i]:
                continue
            assert abs(before - top_p) > 1e-3, "test logits sit on the top-p boundary"
            keep[i] = before < top_p
            before += p[i] / mass
    if min_p > 0.0:
        for i in range(len(p)):
            assert abs(p[i] - min_p * p[order[0]]) > 1e-4, "test logits sit on the min-p boundary"
            keep[i] = keep[i] and p[i] >= min_p * p[order[0]]
    kept = sum(p[i] for i in range(len(p)) if keep[i])
    return [p[i] / kept if keep[i] else 0.0 for i in range(len(p))]


def _chi_square_p_value(counts: torch.Tensor, probs: Sequence[float]) -> float:
    """Upper-tail p-value of Pearson's chi-square over the support of ``probs``."""
    n = int(counts.sum())
    support = [i for i, q in enumerate(probs) if q > 0]
    stat = sum((float(counts[i]) - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    dof = torch.tensor((len(support) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def _draw_counts(params: SamplingParams, *, logits: Sequence[float], seed: int = 0) -> torch.Tensor:
    batch = torch.tensor([logits], dtype=torch.float32).expand(DRAWS, -1).contiguous()
    tensors = _tensors([params] * DRAWS, vocab_size=len(logits))
    gen = torch.Generator().manual_seed(seed)
    tokens = sample(batch, tensors, generator=gen).tokens
    return torch.bincount(tokens, minlength=len(logits))


def test_chi_square_helper_matches_known_critical_values() -> None:
    # chi2.ppf(0.999, df) for df = 1, 4, 9: 10.828, 18.467, 27.877
    for dof, critical in ((1, 10.828), (4, 18.467), (9, 27.877)):
        p = torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64),
            torch.tensor(critical / 2, dtype=torch.float64),
        )
        assert float(p) == pytest.approx(1e-3, rel=1e-3)


FILTER_CASES: list[tuple[dict[str, Any], bool]] = [
    ({}, False),
    ({"temperature": 0.6}, True),
    ({"temperature": 1.7, "top_k": 4}, True),
    ({"top_p": 0.75}, True),
    ({"top_p": 0.75, "top_k": -1}, True),
    ({"min_p": 0.15}, True),
    ({"temperature": 1.3, "top_k": 7, "top_p": 0.9, "min_p": 0.25}, True),  # each filter binds
    ({"top_k": 100}, False),
]


@pytest.mark.parametrize(("kwargs", "filtered"), FILTER_CASES)
def test_empirical_frequencies_match_filtered_distribution(
    kwargs: dict[str, Any], filtered: bool
) -> None:
    target = _reference(LOGITS, **kwargs)
    counts = _draw_counts(SamplingParams(**kwargs), logits=LOGITS)
    assert int(counts.sum()) == DRAWS
    for token, q in enumerate(target):
        if q == 0.0:
            assert counts[token] == 0, f"token {token} has probability 0 but was drawn"
    assert _chi_square_p_value(counts, target) > P_CRITICAL
    if filtered:  # the check has power: the unfiltered softmax is rejected
        assert _chi_square_p_value(counts, _reference(LOGITS)) < 1e-9


def test_tightest_filters_keep_only_the_argmax() -> None:
    logits = LOGITS[::-1]  # the argmax is the last id
    for params in (
        SamplingParams(top_k=1),
        SamplingParams(min_p=1.0),
        SamplingParams(top_p=0.01),
        SamplingParams(top_p=1e-9),  # 1 - top_p rounds to 1 in float32
    ):
        counts = _draw_counts(params, logits=logits)
        assert counts[len(logits) - 1] == DRAWS, params


def test_masked_logits_are_never_drawn() -> None:
    logits = [0.0, -math.inf, 0.5, -math.inf, -1.0]
    counts = _draw_counts(SamplingParams(temperature=50.0), logits=logits)
    assert counts[1] == 0 and counts[3] == 0
    assert (
        _chi_square_p_value(counts, _reference([0.0, -1e9, 0.5, -1e9, -1.0], temperature=50.0))
        > P_CRITICAL
    )


def test_greedy_rows_take_argmax_in_all_greedy_and_mixed_batches() -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 40)
    greedy: list[SamplingParams | None] = [SamplingParams(temperature=0.0), None] * 4
    all_greedy = _tensors(greedy, vocab_size=40, batch_size=12)
    assert all_greedy.all_greedy
    assert torch.equal(sample(logits, all_greedy).tokens, logits.argmax(dim=-1))

    mixed = _tensors(
        [*greedy, SamplingParams(temperature=1.0, top_k=3)], vocab_size=40, batch_size=12
    )
    assert not mixed.all_greedy
    tokens = sample(logits, mixed, generator=torch.Generator().manual_seed(1)).tokens
    rows = [*range(8), 9, 10, 11]  # row 8 samples; rows 9..11 are padding
    assert torch.equal(tokens[rows], logits.argmax(dim=-1)[rows])
    assert tokens[8] in logits[8].topk(3).indices


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [3.0, 0.0, 3.0, 0.0, 0.0]])
    for extra in ([], [SamplingParams()]):
        tensors = _tensors([SamplingParams(temperature=0), None, *extra], vocab_size=5)
        batch = torch.cat([logits, logits[:1]])[: tensors.batch_size]
        tokens = sample(batch, tensors, generator=torch.Generator().manual_seed(0)).tokens
        assert tokens[:2].tolist() == [1, 0]


def _seeded_run(
    rows: Sequence[SamplingParams | None],
    *,
    position: int,
    steps: int,
    gen_seed: int,
    logits_row: torch.Tensor,
) -> list[int]:
    """Tokens of row ``position`` over ``steps`` steps; other rows get random logits."""
    vocab = logits_row.shape[0]
    tensors = _tensors(rows, vocab_size=vocab, batch_size=len(rows) + 1)
    gen = torch.Generator().manual_seed(gen_seed)
    others = torch.Generator().manual_seed(gen_seed + 1)
    out = []
    for step in range(steps):
        logits = torch.randn(tensors.batch_size, vocab, generator=others)
        logits[position] = logits_row
        offsets = torch.randint(0, 50, (tensors.batch_size,), generator=others)
        offsets[position] = step
        out.append(
            int(sample(logits, tensors, step_offsets=offsets, generator=gen).tokens[position])
        )
    return out


def test_seeded_rows_repeat_across_batch_composition_and_position() -> None:
    vocab = 64
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.3
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    alone = _seeded_run([target], position=0, steps=40, gen_seed=0, logits_row=logits_row)
    crowd: list[SamplingParams | None] = [
        SamplingParams(),
        SamplingParams(top_k=5, min_p=0.1),
        None,
        target,
        SamplingParams(seed=1234, temperature=0.5),
        SamplingParams(temperature=0.0, seed=3),
    ]
    in_crowd = _seeded_run(crowd, position=3, steps=40, gen_seed=99, logits_row=logits_row)
    assert alone == in_crowd
    assert _seeded_run([target], position=0, steps=40, gen_seed=7, logits_row=logits_row) == alone
    assert len(set(alone)) > 10, "a seeded row must still vary from step to step"
    other_seed = SamplingParams(seed=1235, temperature=0.9, top_p=0.95)
    assert (
        _seeded_run([other_seed], position=0, steps=40, gen_seed=0, logits_row=logits_row) != alone
    )


def test_seeded_noise_depends_only_on_seed_and_step() -> None:
    a = _tensors([SamplingParams(seed=42), SamplingParams()], vocab_size=16)
    b = _tensors([SamplingParams(), SamplingParams(), SamplingParams(seed=42)], vocab_size=16)
    na = gumbel_noise(a, step_offsets=[7, 0], generator=torch.Generator().manual_seed(1))
    nb = gumbel_noise(b, step_offsets=[3, 3, 7], generator=torch.Generator().manual_seed(2))
    assert torch.equal(na[0], nb[2])
    assert not torch.equal(na[1], nb[1])
    nc = gumbel_noise(a, step_offsets=torch.tensor([8, 0]), generator=None)
    assert not torch.equal(na[0], nc[0])
    assert mix_seed(seed=42, step=7) != mix_seed(seed=42, step=8) != mix_seed(seed=43, step=7)
    assert 0 <= mix_seed(seed=-1, step=0) < 1 << 64


def test_seeded_draws_follow_the_target_distribution() -> None:
    rows = 3000
    params = SamplingParams(seed=2024, top_k=6, temperature=1.2)
    tensors = _tensors([params] * rows, vocab_size=len(LOGITS))
    logits = torch.tensor([LOGITS]).expand(rows, -1).contiguous()
    tokens = sample(logits, tensors, step_offsets=torch.arange(rows)).tokens
    counts = torch.bincount(tokens, minlength=len(LOGITS))
    target = _reference(LOGITS, top_k=6, temperature=1.2)
    assert counts[6:].sum() == 0
    assert _chi_square_p_value(counts, target) > P_CRITICAL


def test_penalties_change_exactly_the_seen_tokens() -> None:
    vocab = 12
    logits = torch.tensor(
        [[1.0, -2.0, 0.5, 3.0, -0.25, 2.0, -1.5, 0.75, 1.25, -3.0, 0.1, -0.1]] * 4
    )
    prompt = torch.tensor([[0, 1, 1, -1], [0, 1, -1, -1], [0, 1, 2, 3], [4, 5, -1, -1]])
    output = torch.tensor([[3, 4, 4, -1], [3, 4, 4, 4], [3, -1, -1, -1], [6, 6, -1, -1]])
    params: list[SamplingParams | None] = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        None,
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0),
    ]
    tensors = _tensors(params, vocab_size=vocab)
    prompt_counts = token_counts(prompt, vocab_size=vocab)
    output_counts = token_counts(output, vocab_size=vocab)
    out = apply_penalties(
        logits, tensors=tensors, prompt_counts=prompt_counts, output_counts=output_counts
    )

    expected = logits.clone()
    # row 0: repetition 1.5 on prompt {0, 1} and output {3, 4}
    for t in (0, 1, 3, 4):
        x = expected[0, t]
        expected[0, t] = x / 1.5 if x > 0 else x * 1.5
    # row 1: output only: token 3 once, token 4 three times
    expected[1, 3] -= 0.25 * 1 + 0.5
    expected[1, 4] -= 0.25 * 3 + 0.5
    # row 3: repetition 0.8 on {4, 5, 6}, then presence/frequency on output {6: 2}
    for t in (4, 5, 6):
        x = expected[3, t]
        expected[3, t] = x / 0.8 if x > 0 else x * 0.8
    expected[3, 6] -= 2.0 * 2 + -1.0
    changed = {(0, 0), (0, 1), (0, 3), (0, 4), (1, 3), (1, 4), (3, 4), (3, 5), (3, 6)}
    mask = torch.zeros_like(logits, dtype=torch.bool)
    for r, t in changed:
        mask[r, t] = True

    assert torch.equal(out[~mask], logits[~mask])  # bit-identical elsewhere
    assert bool((out[mask] != logits[mask]).all())
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_penalties_skip_work_when_unused() -> None:
    logits = torch.randn(3, 8)
    counts = token_counts(torch.tensor([[1, 2]] * 3), vocab_size=8)
    plain = _tensors([SamplingParams(), None, SamplingParams(top_k=2)], vocab_size=8)
    assert not plain.any_penalties
    assert (
        apply_penalties(logits, tensors=plain, prompt_counts=counts, output_counts=counts) is logits
    )
    penal = _tensors([SamplingParams(repetition_penalty=2.0)], vocab_size=8, batch_size=3)
    assert apply_penalties(logits, tensors=penal) is logits
    only_prompt = apply_penalties(logits, tensors=penal, prompt_counts=counts)
    assert torch.equal(only_prompt[1:], logits[1:])
    assert not torch.equal(only_prompt[0, 1:3], logits[0, 1:3])


def test_token_counts_ignore_padding() -> None:
    ids = torch.tensor([[2, 2, 0, -1], [-1, -1, -1, -1], [3, 1, 3, 3]])
    counts = token_counts(ids, vocab_size=4)
    assert counts.tolist() == [[1, 0, 2, 0], [0, 0, 0, 0], [0, 1, 0, 3]]
    assert counts.dtype == torch.int32
    padded = token_counts(torch.tensor([[4, 1]]), vocab_size=4, pad_id=4)
    assert padded.tolist() == [[0, 1, 0, 0]]


def test_logprobs_are_log_softmax_at_chosen_and_top_ids() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 30) * 2
    params: list[SamplingParams | None] = [
        SamplingParams(logprobs=0, temperature=0.7, top_k=10, top_p=0.9),
        SamplingParams(logprobs=5, min_p=0.1),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(),
        None,
    ]
    tensors = _tensors(params, vocab_size=30)
    assert tensors.want_logprobs and tensors.num_top_logprobs == 5
    result = sample(logits, tensors, generator=torch.Generator().manual_seed(0))
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs is not None and result.top_logprobs is not None
    assert torch.equal(result.logprobs, reference.gather(1, result.tokens[:, None]).squeeze(1))
    values, ids = result.top_logprobs
    assert values.shape == ids.shape == (5, 5)
    assert torch.equal(values, reference.gather(1, ids))
    torch.testing.assert_close(values, reference.topk(5, dim=-1).values, rtol=0, atol=0)
    assert bool((values[:, :-1] >= values[:, 1:]).all())

    none = sample(logits, _tensors([SamplingParams()] * 5, vocab_size=30), step_offsets=[0] * 5)
    assert none.logprobs is None and none.top_logprobs is None
    chosen_only = sample(
        logits, _tensors([SamplingParams(temperature=0, logprobs=0)] * 5, vocab_size=30)
    )
    assert chosen_only.logprobs is not None and chosen_only.top_logprobs is None


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _torch_calls(batch_size: int, *, seeded: int) -> int:
    vocab = 32
    rows = [SamplingParams(seed=i) for i in range(seeded)]
    rows += [SamplingParams(top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.2, logprobs=3)] * (
        batch_size - seeded
    )
    logits = torch.randn(batch_size, vocab)
    counts = token_counts(torch.zeros(batch_size, 3, dtype=torch.int64), vocab_size=vocab)
    gen = torch.Generator().manual_seed(0)
    with _CountTorchCalls() as counter:
        tensors = _tensors(rows, vocab_size=vocab)
        penalised = apply_penalties(logits, tensors=tensors, output_counts=counts)
        sample(penalised, tensors, step_offsets=[0] * batch_size, generator=gen)
    return counter.calls


def test_torch_work_does_not_grow_with_unseeded_rows() -> None:
    assert _torch_calls(4, seeded=0) == _torch_calls(256, seeded=0)
    assert _torch_calls(4, seeded=2) == _torch_calls(256, seeded=2)
    assert _torch_calls(8, seeded=4) > _torch_calls(8, seeded=2)


TENSOR_FIELDS = (
    "temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seeds", "seeded",
)  # fmt: skip


class _Recorder:
    """A ``refresh`` callable that only records its (dst, src) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.append((dst, src))


def test_persistent_tensors_refresh_in_place_and_sample_like_fresh_ones() -> None:
    vocab, batch = 24, 6
    host = _tensors([], vocab_size=vocab, batch_size=batch, all_features=True)
    persistent = host.to_device(torch.clone)
    pointers = {name: getattr(persistent, name).data_ptr() for name in TENSOR_FIELDS}
    assert all(pointers[name] != getattr(host, name).data_ptr() for name in TENSOR_FIELDS)
    assert persistent.features() == host.features()
    gen = torch.Generator().manual_seed(0)
    batches: list[list[SamplingParams | None]] = [
        [SamplingParams(top_k=3, seed=9), None, SamplingParams(temperature=0)],
        [SamplingParams(top_p=0.5, min_p=0.2, logprobs=4), SamplingParams(seed=-5)],
        [SamplingParams(repetition_penalty=1.3, seed=9)] * 3,
        [SamplingParams(temperature=0)] * 6,
    ]
    for step, params in enumerate(batches):
        fresh = _tensors(params, vocab_size=vocab, batch_size=batch)
        copies = _Recorder()
        persistent.refresh_from(fresh, copies)
        assert [(id(d), id(s)) for d, s in copies.calls] == [
            (id(getattr(persistent, n)), id(getattr(fresh, n))) for n in TENSOR_FIELDS
        ]
        for dst, src in copies.calls:
            dst.copy_(src)
        assert {n: getattr(persistent, n).data_ptr() for n in TENSOR_FIELDS} == pointers
        for name in TENSOR_FIELDS:
            assert torch.equal(getattr(persistent, name), getattr(fresh, name)), name
        logits = torch.randn(batch, vocab, generator=gen)
        steps = [step] * batch
        noise = gumbel_noise(fresh, step_offsets=steps, generator=gen)
        want = sample(logits, fresh, noise=noise)
        got = sample(logits, persistent, noise=noise)
        assert torch.equal(got.tokens, want.tokens)
        if want.logprobs is not None:
            assert got.logprobs is not None and torch.equal(got.logprobs, want.logprobs)
        # without noise: seeds come from the refreshed tensors, unseeded rows from the generator
        drawn = sample(logits, persistent, step_offsets=steps, generator=_gen(step))
        assert torch.equal(
            drawn.tokens, sample(logits, fresh, step_offsets=steps, generator=_gen(step)).tokens
        )


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_refresh_from_rejects_tensors_that_skip_needed_work() -> None:
    greedy_only = _tensors([None] * 4, vocab_size=8)
    with pytest.raises(RequestError, match="top_k") as info:
        greedy_only.refresh_from(
            _tensors([SamplingParams(top_k=2, seed=1)], vocab_size=8, batch_size=4)
        )
    assert info.value.field == "sampling_features"
    assert info.value.value == ("random", "seeded", "top_k")
    with pytest.raises(RequestError, match="batch_size"):
        greedy_only.refresh_from(_tensors([None], vocab_size=8, batch_size=2))
    with pytest.raises(RequestError, match="vocab_size"):
        greedy_only.refresh_from(_tensors([None], vocab_size=9, batch_size=4))
    few = _tensors([SamplingParams(logprobs=2)], vocab_size=8)
    with pytest.raises(RequestError, match="top5"):
        few.refresh_from(_tensors([SamplingParams(logprobs=5)], vocab_size=8))
    few.refresh_from(_tensors([SamplingParams(logprobs=1)], vocab_size=8))  # fewer columns fit


def test_features_name_the_work_in_a_fixed_order() -> None:
    assert _tensors([None], vocab_size=8).features() == ()
    assert _tensors([SamplingParams(temperature=0, logprobs=0)], vocab_size=8).features() == (
        "logprobs",
    )
    mixed = _tensors(
        [SamplingParams(min_p=0.1, seed=3), SamplingParams(presence_penalty=1.0, logprobs=3)],
        vocab_size=8,
    )
    assert mixed.features() == ("random", "seeded", "min_p", "penalties", "logprobs", "top3")
    full = _tensors([], vocab_size=8, batch_size=2, all_features=True).features()
    assert full == (
        "random", "seeded", "top_k", "top_p", "min_p", "penalties", "logprobs", "top8",
    )  # fmt: skip


def test_from_params_flags_and_padding() -> None:
    t = _tensors(
        [SamplingParams(top_k=100), SamplingParams(temperature=0, top_p=0.5, seed=1), None],
        vocab_size=50,
        batch_size=5,
    )
    assert (t.all_greedy, t.any_top_k, t.any_top_p, t.any_min_p, t.any_penalties) == (
        False,
        False,
        False,
        False,
        False,
    )
    assert not t.any_seeded and not bool(t.seeded.any())
    assert t.greedy.tolist() == [False, True, True, True, True]
    assert t.top_k.tolist() == [50] * 5
    assert t.temperature.tolist() == [1.0] * 5
    s = _tensors([SamplingParams(top_k=5, min_p=0.1, seed=-3, presence_penalty=0.1)], vocab_size=50)
    assert (s.any_top_k, s.any_min_p, s.any_penalties, s.any_seeded) == (True, True, True, True)
    assert s.seeded.tolist() == [True] and s.seeds.tolist() == [-3]
    huge = _tensors(
        [SamplingParams(seed=(1 << 64) + 7), SamplingParams(seed=(1 << 63) + 1)], vocab_size=4
    )
    assert huge.seeds.tolist() == [7, -(1 << 63) + 1]  # modulo 2**64, two's complement


def test_bad_inputs_raise_request_errors_naming_them() -> None:
    tensors = _tensors([SamplingParams(seed=1)], vocab_size=8, batch_size=2)
    with pytest.raises(RequestError, match="logits"):
        sample(torch.zeros(2, 9), tensors, step_offsets=[0, 0])
    with pytest.raises(RequestError, match="logits"):
        sample(torch.zeros(2, 8, dtype=torch.float64), tensors, step_offsets=[0, 0])
    with pytest.raises(RequestError, match="step_offsets"):
        sample(torch.zeros(2, 8), tensors)
    with pytest.raises(RequestError, match="row 0: step_offsets"):
        sample(torch.zeros(2, 8), tensors, step_offsets=[-1, 0])
    with pytest.raises(RequestError, match="step_offsets"):
        sample(torch.zeros(2, 8), tensors, step_offsets=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RequestError, match="noise"):
        sample(torch.zeros(2, 8), tensors, noise=torch.zeros(2, 7))
    with pytest.raises(RequestError, match="sampling_params"):
        _tensors([None, None, None], vocab_size=8, batch_size=2)
    with pytest.raises(RequestError, match="row 1: sampling_params"):
        _tensors([None, {"top_k": 3}], vocab_size=8)  # type: ignore[list-item]
    with pytest.raises(RequestError, match="output_counts"):
        penal = _tensors([SamplingParams(frequency_penalty=1.0)], vocab_size=8)
        apply_penalties(torch.zeros(1, 8), tensors=penal, output_counts=torch.zeros(1, 7))
    # counts built on the host for logits on a device: named, not a torch device-mismatch error
    with pytest.raises(RequestError, match="prompt_counts: must be on the logits' device cpu"):
        penal = _tensors([SamplingParams(repetition_penalty=2.0)], vocab_size=8)
        apply_penalties(
            torch.zeros(1, 8), tensors=penal, prompt_counts=torch.zeros(1, 8, device="meta")
        )


@requires_cuda
def test_seeded_rows_match_between_host_and_cuda() -> None:
    vocab = 256
    params = [
        SamplingParams(seed=s, temperature=0.8, top_k=50, top_p=0.9, logprobs=2) for s in range(16)
    ]
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(0)) * 3
    steps = list(range(16))
    host = sample(logits, _tensors(params, vocab_size=vocab), step_offsets=steps)
    cuda_tensors = SamplingTensors.from_params(
        params, batch_size=16, vocab_size=vocab, device="cuda"
    )
    device = sample(logits.cuda(), cuda_tensors, step_offsets=torch.tensor(steps).cuda())
    assert torch.equal(device.tokens.cpu(), host.tokens)
    assert device.logprobs is not None and host.logprobs is not None
    torch.testing.assert_close(device.logprobs.cpu(), host.logprobs)


@requires_cuda
def test_cuda_graph_replay_with_persistent_buffers_matches_eager() -> None:
    vocab, batch = 128, 8
    persistent = SamplingTensors.from_params(
        [], batch_size=batch, vocab_size=vocab, device="cuda", all_features=True
    )
    static_logits = torch.zeros(batch, vocab, device="cuda")
    static_noise = torch.zeros(batch, vocab, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sample(static_logits, persistent, noise=static_noise)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample(static_logits, persistent, noise=static_noise)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for params in (
        [SamplingParams(top_k=3, seed=9), None, SamplingParams(temperature=0)],
        [SamplingParams(top_p=0.5, min_p=0.2, logprobs=4)] * batch,
    ):
        fresh = SamplingTensors.from_params(
            params, batch_size=batch, vocab_size=vocab, device="cuda"
        )
        logits = torch.randn(batch, vocab, device="cuda", generator=gen)
        noise = gumbel_noise(fresh, step_offsets=[2] * batch, generator=gen)
        persistent.refresh_from(fresh)
        static_logits.copy_(logits)
        static_noise.copy_(noise)
        graph.replay()
        assert torch.equal(captured.tokens, sample(logits, fresh, noise=noise).tokens)


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([[0.0, 2.0, 2.0, 1.0]], [1]),  # ties go to the lowest index
        ([[1.0, float("nan"), 3.0, float("nan")]], [1]),  # NaN is the largest, first one wins
        ([[float("-inf")] * 3, [float("inf"), float("inf"), 0.0]], [0, 0]),
        ([[-3.0, -1.0, -2.0], [5.0, 6.0, 7.0]], [1, 2]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_argmax_takes_the_first_largest(
    rows: list[list[float]], expected: list[int], dtype: torch.dtype
) -> None:
    tokens = greedy_argmax(torch.tensor(rows, dtype=dtype))
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == expected


def test_greedy_argmax_agrees_with_torch_on_any_layout() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-4, 4, (9, 300), generator=g).float()  # many ties
    for x in (logits, logits.t(), logits[::2, 1::3], logits[0], logits.view(3, 3, 300)):
        got = greedy_argmax(x)
        assert got.shape == x.argmax(dim=-1).shape
        assert torch.equal(got, x.argmax(dim=-1))
    grad = torch.randn(4, 6, requires_grad=True)
    assert torch.equal(greedy_argmax(grad), grad.argmax(dim=-1))


class _Allow:
    """A constraint allowing a fixed token set (what a grammar's mask would say)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed


def _constrained_batch(vocab: int) -> tuple[list[SamplingParams], list[set[int]]]:
    allowed = [{3, 40, 77}, {vocab - 1}, set(range(vocab))]
    params = [
        SamplingParams(temperature=0.0, constraint=_Allow(allowed[0])),
        SamplingParams(temperature=1.0, seed=4, logprobs=1, constraint=_Allow(allowed[1])),
        SamplingParams(temperature=0.7, top_k=5, seed=11),  # unconstrained
    ]
    return params, allowed


def test_constrained_rows_only_take_allowed_tokens_and_others_are_untouched() -> None:
    vocab = 100
    params, allowed = _constrained_batch(vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 5
    for step in range(20):
        result = sample(logits, _tensors(params, vocab_size=vocab), step_offsets=[step] * 3)
        tokens = result.tokens.tolist()
        assert tokens[0] in allowed[0] and tokens[1] in allowed[1]
        # Greedy under the mask is the argmax over the allowed tokens.
        assert tokens[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
        # The unconstrained row is what it would be without the others' masks.
        alone = sample(
            logits[2:], _tensors(params[2:], vocab_size=vocab), step_offsets=[step]
        ).tokens
        assert tokens[2] == int(alone[0])
        # Log-probabilities are the unmasked distribution's (vLLM's raw_logprobs).
        assert result.logprobs is not None
        expected = torch.log_softmax(logits[1], dim=-1)[tokens[1]]
        assert float(result.logprobs[1]) == pytest.approx(float(expected))


def test_structured_params_without_a_bound_constraint_are_refused() -> None:
    from llmrt.sampling.structured import StructuredOutput

    p = SamplingParams(structured_output=StructuredOutput.json_object())
    with pytest.raises(RequestError, match="structured_output"):
        _tensors([p], vocab_size=8)


@requires_cuda
def test_constrained_rows_match_between_host_and_cuda() -> None:
    vocab = 1000
    params, _ = _constrained_batch(vocab)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 3
    host = sample(logits, _tensors(params, vocab_size=vocab), step_offsets=[1, 2, 3])
    cuda_tensors = SamplingTensors.from_params(
        params, batch_size=3, vocab_size=vocab, device="cuda"
    )
    device = sample(logits.cuda(), cuda_tensors, step_offsets=torch.tensor([1, 2, 3]).cuda())
    assert torch.equal(device.tokens.cpu(), host.tokens)
