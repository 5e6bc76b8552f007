"""One-shot transformers generation from a GGUF, as a new user would run it (a bench baseline).

``python -m llmrt.benchmarks.hf_oneshot MODEL.gguf PROMPT MAX_NEW_TOKENS``: transformers
loads the GGUF (dequantized to float32) with its tokenizer and generates greedily.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    model_path, prompt, new_tokens = Path(argv[0]), argv[1], int(argv[2])
    import torch
    import transformers

    kwargs = {"gguf_file": model_path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), dtype=torch.float32, **kwargs
    ).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    print(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
