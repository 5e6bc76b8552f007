"""vLLM plugin smoke (scripts/tt_check.sh step 5): serve a model through vllm_tt_plugin with
llmrt's adapter, send one completion request, stop the server.

Needs vLLM and vllm_tt_plugin installed and llmrt's entry point enabled (LLMRT_VLLM_RECIPE,
VLLM_PLUGINS including ``llmrt``: tt_check.sh sets them). Exit 0 when the completion comes
back non-empty; the server's log goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--startup-s", type=float, default=600.0)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            "vllm", "serve", args.model, "--host", "127.0.0.1", "--port", str(args.port),
            "--block-size", "32", "--max-num-seqs", "16", "--max-model-len", "4096",
        ],
        stdout=sys.stderr,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + args.startup_s
        while True:
            if server.poll() is not None:
                print(f"vllm serve exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"no /health after {args.startup_s}s", file=sys.stderr)
                    return 1
                time.sleep(2)
        body = json.dumps(
            {"model": args.model, "prompt": "The capital of France is", "max_tokens": 8,
             "temperature": 0}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.load(response)["choices"][0]["text"]
        print(json.dumps({"completion": text}))
        return 0 if text.strip() else 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
