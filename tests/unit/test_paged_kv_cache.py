"""PagedKVCacheManager: state machine, late capacity, allocation, transactional bind,
handle validation, vLLM cache-spec checks and (retryable) release."""

from __future__ import annotations

import os
from typing import Any

import attrs
import pytest
import torch
from lane_fixtures import single_torch_thread, tiny_llama  # noqa: F401 (autouse)

from llmrt.device.torch import TorchDevice
from llmrt.errors import ConfigError, KVCacheStateError
from llmrt.families.base import CausalLM
from llmrt.runtime.config import PagedKVCacheConfig
from llmrt.runtime.paged_kv_cache import KVCacheState, PagedKVCacheManager
from llmrt.testing import FaultyDevice, InjectedFault


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_llama()


def _config(**overrides: Any) -> PagedKVCacheConfig:
    fields: dict[str, Any] = {"block_size": 4, "max_num_blocks": 32, "num_blocks": 32}
    fields.update(overrides)
    return PagedKVCacheConfig(**fields)


def _manager(model: CausalLM, device: Any = None, **overrides: Any) -> PagedKVCacheManager:
    return PagedKVCacheManager(
        model=model, device=device or TorchDevice("cpu"), config=_config(**overrides)
    )


class _RejectingModel:
    """Delegates attention metadata but refuses every cache (a failing transactional bind)."""

    def __init__(self, inner: CausalLM) -> None:
        self.inner = inner
        self.bind_calls = 0

    def attention_metadata(self) -> Any:
        return self.inner.attention_metadata()

    def set_kv_cache(self, cache: Any) -> None:
        self.bind_calls += 1
        if cache is not None:
            raise ConfigError("kv_cache.keys[0]", "rejected", "test model refuses every cache")


def _state_error(exc: pytest.ExceptionInfo[KVCacheStateError]) -> tuple[Any, Any]:
    return exc.value.current, exc.value.requested


# -- state machine ---------------------------------------------------------------------


def test_happy_path_moves_unresolved_configured_bound_released(model: CausalLM) -> None:
    kv = _manager(model)
    assert kv.state is KVCacheState.UNRESOLVED
    kv.configure()
    assert kv.state is KVCacheState.CONFIGURED
    context = kv.allocate()
    assert kv.state is KVCacheState.BOUND and kv.is_bound
    assert kv.context is context
    kv.release()
    assert kv.state is KVCacheState.RELEASED and not kv.is_bound


def test_allocate_before_configure_names_both_states(model: CausalLM) -> None:
    kv = _manager(model)
    with pytest.raises(KVCacheStateError, match="unresolved") as exc:
        kv.allocate()
    assert _state_error(exc) == ("unresolved", "bound")
    assert kv.state is KVCacheState.UNRESOLVED


def test_configure_fixes_the_capacity_once_and_again_is_a_no_op(model: CausalLM) -> None:
    kv = _manager(model)
    first = kv.configure()
    assert kv.configure() is first  # a finished phase: a no-op (a retried start-up)
    assert kv.configure(first) is first
    with pytest.raises(KVCacheStateError, match="already configured") as exc:
        kv.configure(_config(num_blocks=16))
    assert _state_error(exc) == ("configured", "configured")
    kv.allocate()
    assert kv.configure() is first
    with pytest.raises(KVCacheStateError, match="already bound"):
        kv.configure(_config(num_blocks=16))
    assert kv.state is KVCacheState.BOUND
    assert kv.config.num_blocks == 32
    kv.release()


def test_allocate_twice_and_after_release_raise(model: CausalLM) -> None:
    kv = _manager(model)
    kv.configure()
    kv.allocate()
    with pytest.raises(KVCacheStateError, match="state is bound") as exc:
        kv.allocate()
    assert _state_error(exc) == ("bound", "bound")
    kv.release()
    with pytest.raises(KVCacheStateError, match="state is released") as exc:
        kv.allocate()
    assert _state_error(exc) == ("released", "bound")
    with pytest.raises(KVCacheStateError, match="from released to configured"):
        kv.configure()
    with pytest.raises(KVCacheStateError, match="not bound"):
        _ = kv.context


def test_release_before_allocation_is_legal_and_terminal(model: CausalLM) -> None:
    device = TorchDevice("cpu")
    kv = _manager(model, device)
    kv.release()
    assert kv.state is KVCacheState.RELEASED
    with pytest.raises(KVCacheStateError, match="from released to configured"):
        kv.configure()
    assert device.stats().allocations == 0


# -- late capacity resolution ----------------------------------------------------------


def test_unresolved_capacity_must_be_resolved_by_a_shrink_only_replacement(
    model: CausalLM,
) -> None:
    kv = _manager(model, num_blocks=None)
    with pytest.raises(ConfigError, match=r"kv_cache.num_blocks: must be resolved"):
        kv.configure()
    assert kv.state is KVCacheState.UNRESOLVED

    grown = PagedKVCacheConfig(block_size=4, max_num_blocks=64, num_blocks=64)
    with pytest.raises(ConfigError, match=r"kv_cache.max_num_blocks: replacement may not grow"):
        kv.configure(grown)
    resized = PagedKVCacheConfig(block_size=8, max_num_blocks=32, num_blocks=16)
    with pytest.raises(ConfigError, match=r"kv_cache.block_size: replacement may not change"):
        kv.configure(resized)
    assert kv.state is KVCacheState.UNRESOLVED
    assert kv.config.num_blocks is None

    resolved = kv.configure(kv.config.with_num_blocks(20))
    assert kv.state is KVCacheState.CONFIGURED
    assert kv.config is resolved and resolved.num_blocks == 20
    context = kv.allocate()
    assert context.num_blocks == 20 and context.keys[0].shape[0] == 20
    kv.release()


def test_resolved_capacity_may_only_shrink(model: CausalLM) -> None:
    kv = _manager(model, num_blocks=16)
    with pytest.raises(ConfigError, match=r"kv_cache.num_blocks: replacement may not grow"):
        kv.configure(_config(num_blocks=17))
    with pytest.raises(ConfigError, match="replacement may only shrink"):
        kv.config.with_num_blocks(17)
    kv.configure(_config(num_blocks=8))
    assert kv.config.num_blocks == 8


# -- allocation ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allocate_derives_shapes_from_attention_metadata(model: CausalLM, dtype: str) -> None:
    device = TorchDevice("cpu")
    kv = _manager(model, device, num_blocks=24, dtype=dtype)
    kv.configure()
    context = kv.allocate()
    meta = model.attention_metadata()
    shape = meta.kv_shape(24, 4)
    assert shape == (24, model.config.num_kv_heads, 4, model.config.head_dim)
    assert context.num_layers == meta.num_layers == model.config.num_layers
    assert len(context.values) == meta.num_layers
    assert meta.kv_dim_order == (0, 2, 1, 3)  # the torch families read pages token-major
    for t in (*context.keys, *context.values):
        assert tuple(t.shape) == shape
        assert t.dtype == getattr(torch, dtype)
        assert t.permute(meta.kv_dim_order).is_contiguous()
    assert (context.block_size, context.num_blocks, context.device_id) == (4, 24, device.id)
    assert len(set(context.tensor_ids())) == 2 * meta.num_layers
    assert device.stats().live_tensors == 2 * meta.num_layers
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        context.block_size = 8  # type: ignore[misc]
    kv.release()
    assert device.stats().live_tensors == 0


def test_allocate_binds_the_model_and_release_unbinds_it(model: CausalLM) -> None:
    kv = _manager(model)
    kv.configure()
    kv.allocate()
    args = {
        "tokens": torch.tensor([[1, 2, 3]]),
        "start_pos": torch.tensor([0], dtype=torch.int32),
        "seq_lens": torch.tensor([3], dtype=torch.int32),
        "page_table": torch.tensor([[5]], dtype=torch.int32),
        "last_token_index": torch.tensor([2]),
    }
    logits = model.prefill_forward(**args)
    assert logits.shape == (1, model.config.vocab_size)
    assert kv.context.keys[0][5, :, :3].abs().sum() > 0  # the model wrote into our tensors
    kv.release()
    with pytest.raises(KVCacheStateError, match="no KV cache is bound"):
        model.prefill_forward(**args)


def test_failed_bind_leaves_nothing_allocated(model: CausalLM) -> None:
    device = TorchDevice("cpu")
    rejecting = _RejectingModel(model)
    kv = PagedKVCacheManager(model=rejecting, device=device, config=_config())
    kv.configure()
    with pytest.raises(ConfigError, match="test model refuses"):
        kv.allocate()
    stats = device.stats()
    assert stats.live_tensors == 0
    assert stats.allocations == stats.deallocations == 2 * model.config.num_layers
    assert kv.state is KVCacheState.CONFIGURED
    assert kv.orphans == ()
    with pytest.raises(KVCacheStateError):
        _ = kv.context
    kv.release()  # nothing bound: the model is not asked to unbind
    assert rejecting.bind_calls == 1
    assert device.stats().live_tensors == 0


def test_failed_allocation_midway_releases_what_was_allocated(model: CausalLM) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={"allocate": 3})
    kv = _manager(model, device)
    kv.configure()
    with pytest.raises(InjectedFault, match="allocate call #3"):
        kv.allocate()
    assert inner.stats().live_tensors == 0
    assert len(device.calls_of("deallocate")) == 2
    # The manager stays configured, so a retry can still succeed.
    kv.allocate()
    assert inner.stats().live_tensors == 2 * model.config.num_layers
    kv.release()
    assert inner.stats().live_tensors == 0


def test_failed_bind_with_failed_cleanup_keeps_the_bind_error_and_release_retries(
    model: CausalLM,
) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={"deallocate": 1})
    kv = PagedKVCacheManager(model=_RejectingModel(model), device=device, config=_config())
    kv.configure()
    with pytest.raises(ConfigError, match="test model refuses"):
        kv.allocate()
    assert len(kv.orphans) == 1
    assert inner.stats().live_tensors == 1
    kv.release()  # retries the orphan left by the failed bind
    assert kv.orphans == ()
    assert inner.stats().live_tensors == 0


# -- handles ---------------------------------------------------------------------------


def test_validate_handle_accepts_only_the_exact_handle(model: CausalLM) -> None:
    kv = _manager(model)
    kv.configure()
    context = kv.allocate()
    assert kv.validate_handle(context) is context

    lookalike = attrs.evolve(context)  # same tensors, another object
    with pytest.raises(KVCacheStateError, match="foreign KV cache handle PagedKVCacheContext"):
        kv.validate_handle(lookalike)
    with pytest.raises(KVCacheStateError, match="foreign KV cache handle dict"):
        kv.validate_handle({"keys": context.keys, "values": context.values})

    other = _manager(tiny_llama(seed=1))
    other.configure()
    foreign = other.allocate()
    with pytest.raises(KVCacheStateError, match="foreign") as exc:
        kv.validate_handle(foreign)
    assert f"{id(context):#x}" in str(exc.value)
    with pytest.raises(KVCacheStateError, match="foreign"):
        other.validate_handle(context)
    other.release()

    # Swapping a tensor inside the (frozen) handle is detected too.
    original = context.keys
    object.__setattr__(context, "keys", (torch.zeros_like(original[0]), *original[1:]))
    with pytest.raises(KVCacheStateError, match="tensors were replaced"):
        kv.validate_handle(context)
    object.__setattr__(context, "keys", original)
    assert kv.validate_handle(context) is context

    kv.release()
    with pytest.raises(KVCacheStateError, match="not bound"):
        kv.validate_handle(context)


def test_validate_vllm_cache_spec_names_the_mismatch(model: CausalLM) -> None:
    kv = _manager(model, num_blocks=None, max_num_blocks=48, dtype="bfloat16")
    kv.validate_vllm_cache_spec(block_size=4, dtype=torch.bfloat16, num_blocks=48)
    kv.validate_vllm_cache_spec(block_size=4, dtype="bfloat16", num_blocks=1)
    kv.validate_vllm_cache_spec(block_size=4, dtype="torch.bfloat16", num_blocks=10)
    with pytest.raises(ConfigError, match=r"kv_cache.block_size: .*got 16") as exc:
        kv.validate_vllm_cache_spec(block_size=16, dtype=torch.bfloat16, num_blocks=8)
    assert exc.value.field == "kv_cache.block_size"
    for bad_dtype in (torch.float16, "float32", "nonsense"):
        with pytest.raises(ConfigError, match=r"kv_cache.dtype: server dtype") as exc:
            kv.validate_vllm_cache_spec(block_size=4, dtype=bad_dtype, num_blocks=8)
        assert exc.value.field == "kv_cache.dtype"
    for bad_count in (0, -1, 49):
        with pytest.raises(ConfigError, match=r"kv_cache.num_blocks: .*\[1, 48\]") as exc:
            kv.validate_vllm_cache_spec(block_size=4, dtype=torch.bfloat16, num_blocks=bad_count)
        assert exc.value.value == bad_count

    kv.configure(kv.config.with_num_blocks(12))
    kv.validate_vllm_cache_spec(block_size=4, dtype=torch.bfloat16, num_blocks=12)
    with pytest.raises(ConfigError, match=r"\[1, 12\]"):
        kv.validate_vllm_cache_spec(block_size=4, dtype=torch.bfloat16, num_blocks=13)


# -- release ---------------------------------------------------------------------------


def test_release_is_idempotent_and_deallocates_each_tensor_once(model: CausalLM) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={})
    kv = _manager(model, device)
    kv.configure()
    context = kv.allocate()
    tensors = [*context.keys, *context.values]
    kv.release()
    kv.release()
    kv.release()
    assert inner.stats().live_tensors == 0
    for t in tensors:
        assert len(device.calls_of("deallocate", subject=t)) == 1
    assert len(device.calls_of("deallocate")) == len(tensors)


def test_failed_deallocation_is_retried_exactly_once_per_tensor(model: CausalLM) -> None:
    inner = TorchDevice("cpu")
    device = FaultyDevice(inner, fail={"deallocate": [2, 4]})
    kv = _manager(model, device)
    kv.configure()
    context = kv.allocate()
    tensors = [*context.keys, *context.values]
    assert len(tensors) == 4

    with pytest.raises(KVCacheStateError, match=r"2 KV tensor.*failed to deallocate") as exc:
        kv.release()
    assert "call release() again" in str(exc.value)
    assert kv.state is KVCacheState.RELEASED
    assert inner.stats().live_tensors == 2
    assert [o.tensor for o in kv.orphans] == [tensors[1], tensors[3]]
    assert all(isinstance(o.error, InjectedFault) for o in kv.orphans)

    kv.release()  # retries only the two orphans
    assert kv.orphans == ()
    assert inner.stats().live_tensors == 0
    kv.release()
    for t in tensors:
        ok = [c for c in device.calls_of("deallocate", subject=t) if not c.injected]
        assert len(ok) == 1, "each KV tensor is deallocated exactly once"
    assert len(device.calls_of("deallocate")) == 6  # 4 first attempts + 2 retries


def test_failed_unbind_still_releases_every_tensor(model: CausalLM) -> None:
    class _UnbindFails(_RejectingModel):
        def set_kv_cache(self, cache: Any) -> None:
            if cache is None:
                raise RuntimeError("unbind failed")
            self.inner.set_kv_cache(cache)

    device = TorchDevice("cpu")
    kv = PagedKVCacheManager(model=_UnbindFails(model), device=device, config=_config())
    kv.configure()
    kv.allocate()
    with pytest.raises(RuntimeError, match="unbind failed"):
        kv.release()
    assert kv.state is KVCacheState.RELEASED
    assert device.stats().live_tensors == 0
    kv.release()
    model.set_kv_cache(None)


# -- memory commit ---------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc RSS")
def test_kv_pool_memory_is_committed_as_blocks_are_written(model: CausalLM) -> None:
    """A pool sized for its ceiling costs no resident memory until blocks are written, reads
    zeros everywhere, and grows by about what was written (one block per layer here)."""
    meta = model.attention_metadata()
    block_size = 4
    layer_block = meta.num_kv_heads * block_size * meta.head_dim * 4  # one K (or V) block
    pool = 256 << 20
    num_blocks = pool // (2 * meta.num_layers * layer_block)
    kv = _manager(model, num_blocks=num_blocks, max_num_blocks=num_blocks)
    kv.configure()
    before = _resident_bytes()
    context = kv.allocate()
    allocated = _resident_bytes()
    assert allocated - before < pool // 16
    for t in (*context.keys, *context.values):
        assert int(torch.count_nonzero(t)) == 0
    assert _resident_bytes() - before < pool // 16  # reading untouched pages commits none
    for t in (*context.keys, *context.values):
        t[num_blocks // 2].fill_(1.0)
    written = 2 * meta.num_layers * layer_block
    grown = _resident_bytes() - allocated
    assert grown < 2 * meta.num_layers * 2 * 4096 + written + (4 << 20)
    assert all(float(t[num_blocks // 2].sum()) == layer_block // 4 for t in context.keys)
    kv.release()
