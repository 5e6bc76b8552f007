"""llama.cpp as a baseline on the same GGUF: where it is, and what it measures.

Three ways to reach it, each optional (nothing here builds or installs llama.cpp):

- ``llama-bench`` (``--llamacpp-bench PATH``, ``$LLMRT_LLAMACPP_BENCH``, or found in
  ``--llamacpp-dir``/``$LLMRT_LLAMACPP_DIR``): prompt processing (``pp512``) and token
  generation (``tg64``, whose reciprocal is the single-stream inter-token latency);
- ``llama-server`` (``--llamacpp-server``/``$LLMRT_LLAMACPP_SERVER``, or in the directory):
  the mixed workload with one slot per concurrent request, driven by a bounded number of
  HTTP clients on 127.0.0.1; single-stream latency and prompt speed from its per-request
  timings when ``llama-bench`` is absent. The server is always killed afterwards;
- the ``llama_cpp`` Python module (``llama-cpp-python``), in process, for single-stream
  latency and prompt speed when neither binary is given;
- ``llama-cli`` (``$LLMRT_LLAMACPP_CLI``, or in the directory): the one-shot baseline of
  ``--workload oneshot`` (one prompt, single turn).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from llmrt.errors import ConfigError, UnsupportedError
from llmrt.recipe.loader import Recipe

DIR_ENV = "LLMRT_LLAMACPP_DIR"
BENCH_ENV = "LLMRT_LLAMACPP_BENCH"
SERVER_ENV = "LLMRT_LLAMACPP_SERVER"
CLI_ENV = "LLMRT_LLAMACPP_CLI"
SERVER_START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
BENCH_TIMEOUT_S = 900.0


@attrs.frozen(kw_only=True)
class LlamaCpp:
    """The llama.cpp entry points found on this machine (each may be missing)."""

    bench: Path | None = None
    server: Path | None = None
    cli: Path | None = None
    python: bool = False

    @property
    def available(self) -> bool:
        return self.bench is not None or self.server is not None or self.python

    def describe(self) -> str:
        found = [
            f"llama-bench {self.bench}" if self.bench else None,
            f"llama-server {self.server}" if self.server else None,
            f"llama-cli {self.cli}" if self.cli else None,
            "llama_cpp (llama-cpp-python)" if self.python else None,
        ]
        return ", ".join(f for f in found if f) or "not available"

    @classmethod
    def locate(
        cls,
        *,
        directory: str | None = None,
        bench: str | None = None,
        server: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> LlamaCpp:
        """Explicit paths first, then their environment variables, then the directory."""
        environ = os.environ if env is None else env
        root = directory or environ.get(DIR_ENV)

        def find(explicit: str | None, env_key: str, name: str) -> Path | None:
            given = explicit or environ.get(env_key)
            if given:
                return _executable(given, field=env_key if not explicit else f"--{name}")
            if root:
                candidate = Path(root) / name
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return candidate
            return None

        return cls(
            bench=find(bench, BENCH_ENV, "llama-bench"),
            server=find(server, SERVER_ENV, "llama-server"),
            cli=find(None, CLI_ENV, "llama-cli"),
            python=_python_module_available(),
        )


def _executable(path: str, *, field: str) -> Path:
    resolved = shutil.which(path) if os.sep not in path else path
    if resolved is None or not os.path.isfile(resolved) or not os.access(resolved, os.X_OK):
        raise ConfigError(field, path, "is not an executable file")
    return Path(resolved)


def _python_module_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def recipe_gguf(recipe: Recipe) -> Path | None:
    """The GGUF file a recipe serves, or None when its checkpoint is not a GGUF."""
    spec = recipe.checkpoint
    if spec.format != "gguf":
        return None
    if spec.path:
        return Path(spec.path)
    from llmrt.weights.package_data import package_file

    return package_file(package=spec.package or "", file=spec.file or "")


# -- llama-bench --------------------------------------------------------------------------


def run_llama_bench(
    binary: Path, *, model: Path, threads: int, prompt: int, generate: int, repeats: int
) -> dict[str, float]:
    """``pp<prompt>`` and ``tg<generate>`` tokens/s (mean over ``repeats``) from llama-bench."""
    argv = [
        str(binary),
        "-m", str(model),
        "-t", str(threads),
        "-p", str(prompt),
        "-n", str(generate),
        "-r", str(repeats),
        "-ngl", "0",
        "-o", "json",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise UnsupportedError(f"llama-bench timed out after {exc.timeout:.0f} s") from None
    if done.returncode != 0:
        raise UnsupportedError(
            f"llama-bench exited {done.returncode}: {done.stderr.strip()[-400:]}"
        )
    try:
        rows = json.loads(done.stdout)
    except ValueError:
        raise UnsupportedError(f"llama-bench printed no JSON: {done.stdout[:200]!r}") from None
    out: dict[str, float] = {}
    for row in rows:
        if row.get("n_prompt") == prompt and not row.get("n_gen"):
            out["pp_tokens_per_s"] = float(row["avg_ts"])
        elif row.get("n_gen") == generate and not row.get("n_prompt"):
            out["tg_tokens_per_s"] = float(row["avg_ts"])
    if set(out) != {"pp_tokens_per_s", "tg_tokens_per_s"}:
        raise UnsupportedError(f"llama-bench reported no pp{prompt}/tg{generate} rows: {rows!r}")
    return out


# -- llama-server -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def llama_server(
    binary: Path, *, model: Path, threads: int, slots: int, context_per_slot: int
) -> Iterator[str]:
    """A llama-server on 127.0.0.1 with ``slots`` slots; yields its URL, kills it on exit."""
    port = _free_port()
    argv = [
        str(binary),
        "-m", str(model),
        "-t", str(threads),
        "-np", str(slots),
        "-c", str(slots * context_per_slot),
        "-ngl", "0",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc=proc, log=log)
            yield url
        finally:
            _stop(proc)


def _wait_healthy(url: str, *, proc: subprocess.Popen[bytes], log: Any) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-600:].decode("utf-8", "replace")
            raise UnsupportedError(f"llama-server exited {proc.returncode} at startup: {tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise UnsupportedError(f"llama-server not healthy after {SERVER_START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def completion(url: str, *, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """One greedy ``/completion`` of ``max_tokens`` tokens (EOS ignored, no prompt cache)."""
    body = json.dumps(
        {
            "prompt": list(prompt),
            "n_predict": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": False,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/completion", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def server_throughput(
    url: str, *, prompts: Sequence[Sequence[int]], max_tokens: int, clients: int
) -> dict[str, float]:
    """All ``prompts`` through ``clients`` concurrent HTTP clients: output tokens/s."""
    lock = threading.Lock()
    produced = [0]

    def one(prompt: Sequence[int]) -> None:
        result = completion(url, prompt=prompt, max_tokens=max_tokens)
        with lock:
            produced[0] += int(result.get("tokens_predicted", 0))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for future in [pool.submit(one, p) for p in prompts]:
            future.result()
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tokens": float(produced[0]),
        "output_tokens_per_s": produced[0] / wall if wall > 0 else float("nan"),
    }


def server_single_stream(
    url: str, *, prompts: Sequence[Sequence[int]], max_tokens: int
) -> dict[str, float]:
    """Median per-token decode and prompt speed from the server's own request timings."""
    itl: list[float] = []
    pp: list[float] = []
    for prompt in prompts:
        timings = completion(url, prompt=prompt, max_tokens=max_tokens).get("timings", {})
        itl.append(float(timings["predicted_per_token_ms"]) / 1000)
        pp.append(float(timings["prompt_per_second"]))
    return {"itl_s": statistics.median(itl), "pp_tokens_per_s": statistics.median(pp)}


# -- llama-cpp-python ---------------------------------------------------------------------


def python_single_stream(
    *, model: Path, threads: int, itl_prompts: Sequence[Sequence[int]], max_tokens: int,
    pp_prompts: Sequence[Sequence[int]],
) -> dict[str, float]:  # fmt: skip
    """Median greedy inter-token latency and prompt tokens/s through ``llama_cpp.Llama``."""
    import llama_cpp

    longest = max(len(p) for p in (*itl_prompts, *pp_prompts)) + max_tokens + 8
    llm = llama_cpp.Llama(
        model_path=str(model), n_threads=threads, n_ctx=longest, n_batch=512, verbose=False
    )
    try:
        pp = []
        for prompt in pp_prompts:
            llm.reset()
            start = time.perf_counter()
            llm.eval(list(prompt))
            pp.append(len(prompt) / (time.perf_counter() - start))
        itl = []
        for prompt in itl_prompts:
            llm.reset()
            llm.eval(list(prompt))
            for _ in range(max_tokens):
                start = time.perf_counter()
                token = llm.sample(temp=0.0)
                llm.eval([token])
                itl.append(time.perf_counter() - start)
    finally:
        llm.close()
    return {"itl_s": statistics.median(itl), "pp_tokens_per_s": statistics.median(pp)}
