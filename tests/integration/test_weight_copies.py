"""A build holds each weight's bytes once: the copies it makes of a GGUF's blocks (fused
q/k/v and gate/up, the interleaved layout, the huge-page placement) replace what they were
made from, in the lane's model and in the checkpoint every lane is built from.

Why it matters: the checkpoint's fused q/k/v and gate/up parts used to keep the file-order
fused buffer alive after the model interleaved it (342 MiB beside a 1B Q4_0's weights). The
contract is stated without timing or RSS: every buffer the checkpoint still holds outside
the file's mapping is one a lane's model reads, and a second lane built from the same
checkpoint reads the same weights (equal tokens; each entry dequantizes to the file's).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Runtime

from llmrt.kernels.formats import QuantizedWeight
from llmrt.kernels.native import kernels_available
from llmrt.weights import load_checkpoint
from llmrt.weights.mapped_pages import mapping_address

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="needs the CPU kernels")


def _storages(module: torch.nn.Module) -> set[int]:
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.mark.parametrize("huge_pages", [False, True])
def test_two_lanes_from_one_checkpoint_hold_each_weight_once(
    build: Callable[..., Runtime],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    huge_pages: bool,
) -> None:
    pytest.importorskip("transformers")
    from model_files import tiny_llama, train_bpe, write_llama_gguf

    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "cache"))
    bpe = train_bpe()
    path = write_llama_gguf(
        tmp_path / "q8.gguf", tiny_llama(bpe.get_vocab_size()), bpe, quantized=("attn_", "ffn_")
    )
    runtime = build(
        "gguf",
        {
            "checkpoint.path": str(path),
            "device.weight_layout": "interleaved",
            "device.huge_pages": huge_pages,
            "lanes": 2,
            "device.gemm_dtype": "float32",
            "kv_cache.dtype": "float32",
            "kv_cache.num_blocks": 16,
            "decode.lane_capacity": 1,
            "warmup.prefill_batch_sizes": [1],
        },
    ).ready()
    checkpoint = runtime.container.model.weights()
    (mapping,) = checkpoint.mappings
    begin = mapping_address(mapping)
    held = set().union(*(_storages(lane.model()) for lane in runtime.container.lane_containers()))
    for name, tensor in checkpoint.tensors.items():
        view = tensor.blocks if isinstance(tensor, QuantizedWeight) else tensor
        address = view.untyped_storage().data_ptr()
        in_file = begin <= address < begin + len(mapping)
        assert in_file or address in held, f"{name}: a buffer no lane's model reads"
    fused = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(fused, QuantizedWeight) and fused.layout == "interleaved"
    # An unfused weight stays the file's view (its pages went back; the lanes copied it).
    single = checkpoint.tensors["model.layers.0.self_attn.o_proj.weight"]
    assert isinstance(single, QuantizedWeight) and single.layout == "ggml"
    assert begin <= single.blocks.data_ptr() < begin + len(mapping)
    fresh = load_checkpoint(format="gguf", path=str(path), keep_quantized=True)
    for name, tensor in checkpoint.tensors.items():
        original = fresh.tensors[name]
        if isinstance(tensor, QuantizedWeight):
            assert isinstance(original, QuantizedWeight)
            assert torch.equal(tensor.dequantize(), original.dequantize()), name
        else:
            assert torch.equal(tensor, original), name  # type: ignore[arg-type]

    ids = bpe.encode("What is the capital of France?").ids
    # Slot 0 is lane 0's, slot 1 lane 1's (one slot per lane): the same prompt in each.
    generation = runtime.generate([ids, ids], slots=[0, 1], steps=6)
    assert generation.tokens[0] == generation.tokens[1]
