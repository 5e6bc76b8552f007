"""Host-side checks against the real ttnn wheel: the API and conversions ``TtnnDevice`` relies on.

ttnn 0.81 ships wheels for CPython 3.10 and 3.12 only; ``scripts/ttnn_host_tests.sh`` builds
such an environment and runs this module. Without a chip, tile-layout and block-float
conversions need a cluster description: the mock single-chip Wormhole N150 one next to this
file is used unless ``TT_METAL_MOCK_CLUSTER_DESC_PATH`` is set or ``/dev/tenstorrent`` exists.
No op runs here (opening a device needs a chip and the sfpi compiler).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_ttnn_errors import LIBRARY_ERRORS, fake_message, says

_HERE = Path(__file__).resolve().parent
# Only where the wheel is installed: a skipped module leaves the session's environment alone.
if importlib.util.find_spec("ttnn") is not None and not Path("/dev/tenstorrent").exists():
    os.environ.setdefault(
        "TT_METAL_MOCK_CLUSTER_DESC_PATH", str(_HERE / "wormhole_n150_cluster_desc.yaml")
    )

_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
ttnn = pytest.importorskip(
    "ttnn",
    reason=(
        f"needs the ttnn wheel, published for CPython 3.10/3.12 only (this is {_VERSION}); "
        f"run scripts/ttnn_host_tests.sh"
        if _VERSION not in ("3.10", "3.12")
        else "needs the ttnn wheel, not installed in this CPython "
        f"{_VERSION}: pip install 'llmrt[tt]', or run scripts/ttnn_host_tests.sh"
    ),
)

from llmrt.device.ttnn import (  # noqa: E402
    BLOCK_FLOATS,
    DISPATCH_CORE_TYPES,
    FABRIC_CONFIGS,
    TTNN_CALLS,
    TTNN_METHODS,
    TTNN_NAMES,
    stage,
    staging_plan,
    unstage,
)
from llmrt.testing.fake_ttnn import TENSOR_OPERATORS, FakeTtnn  # noqa: E402

ODD_SHAPES = [(5,), (3, 5), (1, 33), (2, 3, 40), (7, 64), (2, 1, 1, 1)]


def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Tile padding as ttnn 0.81 does it: rank grows to 2, last two dims round up to 32."""
    dims = [1] * (2 - len(shape)) + list(shape)
    return (*dims[:-2], *(-(-d // 32) * 32 for d in dims[-2:]))


def param_names(obj: Any) -> set[str]:
    """Parameter names of a ttnn callable (python function, FastOperation or nanobind)."""
    fn = obj
    while hasattr(fn, "function"):
        fn = fn.function
    signatures = getattr(fn, "__nb_signature__", None)
    if not signatures:  # a registered operation object: its type's __call__ holds them
        call = type(fn).__dict__.get("__call__")
        signatures = getattr(call, "__nb_signature__", None)
    if not signatures:
        return set(inspect.signature(fn).parameters)
    names: set[str] = set()
    for entry in signatures:
        text = entry[0].replace("\\*", "*")
        end = text.rindex(") ->") if ") ->" in text else text.rindex(")")
        for part in _split_top_level(text[text.index("(") + 1 : end]):
            name = part.strip().lstrip("*").split(":")[0].split("=")[0].strip()
            if name and name not in ("/", "self"):
                names.add(name)
    return names


def positional_count(obj: Any) -> int:
    """How many arguments a nanobind ttnn op takes by position (those before its ``*``)."""
    fn = obj
    while hasattr(fn, "function"):
        fn = fn.function
    call = type(fn).__dict__.get("__call__")
    entries = getattr(fn, "__nb_signature__", None) or getattr(call, "__nb_signature__", ())
    counts = []
    for entry in entries:
        text = entry[0].replace("\\*", "*")
        end = text.rindex(") ->") if ") ->" in text else text.rindex(")")
        parts = [p.strip() for p in _split_top_level(text[text.index("(") + 1 : end])]
        parts = [p for p in parts if p and p not in ("/", "self") and not p.startswith("self:")]
        counts.append(parts.index("*") if "*" in parts else len(parts))
    return max(counts)


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def resolve(dotted: str) -> Any:
    owner, _, name = dotted.rpartition(".")
    return getattr(getattr(ttnn, owner) if owner else ttnn, name)


# the API TtnnDevice calls


@pytest.mark.parametrize("name", sorted(TTNN_CALLS))
def test_every_backend_call_exists_with_its_keywords(name: str) -> None:
    assert set(TTNN_CALLS[name]) <= param_names(resolve(name))


@pytest.mark.parametrize("dotted", sorted(TTNN_METHODS))
def test_every_backend_method_exists_with_its_keywords(dotted: str) -> None:
    assert set(TTNN_METHODS[dotted]) <= param_names(resolve(dotted))


def test_types_enums_and_staged_dtypes_exist() -> None:
    for name in TTNN_NAMES:
        assert hasattr(ttnn, name), name
    assert isinstance(ttnn.MeshDevice.shape, property)
    assert list(ttnn.MeshShape(1, 4)) == [1, 4]
    assert ttnn.MeshShape(1, 4).mesh_size() == 4
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool):
        plan = staging_plan(dtype)
        assert plan.ttnn_dtype(ttnn).name == plan.tt_dtype
        assert plan.ttnn_layout(ttnn).name == plan.layout
    for name in BLOCK_FLOATS:
        assert getattr(ttnn.DataType, name).name == name
    assert ttnn.StorageType.DEVICE != ttnn.StorageType.HOST


@pytest.mark.parametrize(
    "name",
    [
        *sorted(TTNN_CALLS),
        "to_device",
        "from_device",
        "allocate_tensor_on_device",
        "wait_for_event",
        "Tensor.cpu",
        "Tensor.to_torch",
        "Tensor.deallocate",
        "MeshDevice.create_submeshes",
        "MeshDevice.create_submesh",
        "ShardTensorToMesh",
        "ShardTensor2dMesh",
        "ConcatMeshToTensor",
        "ConcatMesh2dToTensor",
    ],
)
def test_fake_accepts_only_parameters_the_real_call_has(name: str) -> None:
    owner, _, attr = name.rpartition(".")
    fake = FakeTtnn()
    fake_fn = getattr(getattr(fake, owner) if owner else fake, attr)
    fake_params = set(inspect.signature(fake_fn).parameters) - {"self"}
    assert fake_params <= param_names(resolve(name)) | {"self"}


# conversions: dtypes, layouts, padding


@pytest.mark.parametrize("layout", ["ROW_MAJOR_LAYOUT", "TILE_LAYOUT"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_float32_and_bfloat16_round_trip_with_tile_padding(
    shape: tuple[int, ...], layout: str
) -> None:
    value = torch.randn(shape)
    for dtype, torch_dtype in ((ttnn.float32, torch.float32), (ttnn.bfloat16, torch.bfloat16)):
        t = ttnn.from_torch(value, dtype=dtype, layout=getattr(ttnn, layout))
        assert tuple(t.shape) == shape
        expected_padding = padded(shape) if layout == "TILE_LAYOUT" else shape
        assert tuple(t.padded_shape) == expected_padding
        back = ttnn.to_torch(t)
        assert back.dtype == torch_dtype
        assert torch.equal(back, value.to(torch_dtype))


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_block_floats_live_in_tile_layout_and_read_back_as_float32(shape: tuple[int, ...]) -> None:
    value = torch.randn(shape)
    with pytest.raises(RuntimeError, match="TILE"):
        ttnn.from_torch(value, dtype=ttnn.bfloat8_b, layout=ttnn.ROW_MAJOR_LAYOUT)
    for dtype, tolerance in ((ttnn.bfloat8_b, 2**-5), (ttnn.bfloat4_b, 2**-1)):
        t = ttnn.from_torch(value, dtype=dtype, layout=ttnn.TILE_LAYOUT)
        assert (tuple(t.shape), tuple(t.padded_shape)) == (shape, padded(shape))
        back = ttnn.to_torch(t)
        assert back.dtype == torch.float32
        assert back.shape == value.shape
        scale = float(value.abs().max())
        assert float((back - value).abs().max()) <= tolerance * scale


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_the_fakes_block_floats_are_the_wheels_bit_for_bit(shape: tuple[int, ...]) -> None:
    """``llmrt.testing.block_float`` (the fake's bfloat8_b/bfloat4_b payloads) is the wheel's
    packing: shared exponents per face row, round to nearest even, zero tile padding."""
    from llmrt.testing.block_float import round_block_float

    value = torch.randn(shape) * torch.exp2(torch.randint(-10, 10, shape).float())
    for dtype, bits in ((ttnn.bfloat8_b, 7), (ttnn.bfloat4_b, 3)):
        back = ttnn.to_torch(ttnn.from_torch(value, dtype=dtype, layout=ttnn.TILE_LAYOUT))
        assert torch.equal(back, round_block_float(value, mantissa_bits=bits))


#: The computing ops the fake runs for a tt_transformers-style decoder.
EMULATED_OPS = (
    "matmul", "linear", "rms_norm", "silu", "gelu", "softmax", "embedding", "typecast", "concat",
    "all_gather", "reduce_scatter", "all_reduce",
)


@pytest.mark.parametrize("name", EMULATED_OPS)
def test_the_fakes_compute_ops_take_only_the_wheels_parameters(name: str) -> None:
    fake_params = set(inspect.signature(getattr(FakeTtnn(), name)).parameters)
    assert fake_params <= param_names(resolve(name))


#: The attention ops the fake computes for a tt_transformers decoder (namespaced).
EMULATED_ATTENTION_OPS = (
    "transformer.scaled_dot_product_attention",
    "transformer.paged_scaled_dot_product_attention_decode",
    "transformer.chunked_scaled_dot_product_attention",
    "experimental.paged_update_cache",
    "experimental.paged_fill_cache",
    "experimental.rotary_embedding_llama",
)


@pytest.mark.parametrize("name", EMULATED_ATTENTION_OPS)
def test_the_fakes_attention_ops_take_the_wheels_keywords(name: str) -> None:
    """Every keyword the fake's op takes (``sliding_window_size`` on the three SDPA ops
    included) is the wheel's, and it takes no more arguments by position than the wheel."""
    owner, _, attr = name.partition(".")
    params = inspect.signature(getattr(getattr(FakeTtnn(), owner), attr)).parameters.values()
    keywords = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    assert keywords <= param_names(resolve(name))
    assert positional <= positional_count(resolve(name))


def test_tile_padding_uses_the_pad_value() -> None:
    t = ttnn.from_torch(
        torch.ones(3, 5), dtype=ttnn.float32, layout=ttnn.TILE_LAYOUT, pad_value=-3.0
    )
    full = t.to_torch_with_padded_shape()
    assert full.shape == (32, 32)
    assert full[:3, :5].eq(1).all()
    assert full[3:, :].eq(-3).all()
    assert full[:3, 5:].eq(-3).all()


def test_page_tables_and_tokens_in_their_staged_row_major_forms() -> None:
    page_table = torch.tensor([[0, 5, -1, -1], [3, -1, -1, -1]], dtype=torch.int32)
    t = ttnn.from_torch(page_table, dtype=ttnn.int32, layout=ttnn.ROW_MAJOR_LAYOUT)
    assert (t.dtype.name, t.layout.name) == ("INT32", "ROW_MAJOR")
    assert torch.equal(ttnn.to_torch(t), page_table)
    wrapped = ttnn.to_torch(ttnn.from_torch(page_table, dtype=ttnn.uint32))
    assert wrapped.dtype == torch.uint32
    assert wrapped.to(torch.int64)[0, 2] == 2**32 - 1  # why page tables are staged as int32

    tokens = torch.tensor([[1, 50_000, 128_255, 151_935]])
    assert ttnn.from_torch(tokens).dtype.name == "UINT32"  # ttnn's own pick for int64
    plan = staging_plan(tokens.dtype)
    t = ttnn.from_torch(
        stage(tokens, plan), dtype=plan.ttnn_dtype(ttnn), layout=ttnn.ROW_MAJOR_LAYOUT
    )
    assert unstage(ttnn.to_torch(t), plan).equal(tokens)
    positions = torch.tensor([0, 17, 4095], dtype=torch.int32)
    t = ttnn.from_torch(positions, dtype=ttnn.uint32, layout=ttnn.ROW_MAJOR_LAYOUT)
    assert ttnn.to_torch(t).to(torch.int64).tolist() == [0, 17, 4095]
    tiled = ttnn.from_torch(page_table, dtype=ttnn.int32, layout=ttnn.TILE_LAYOUT)
    assert tuple(tiled.padded_shape) == (32, 32)
    assert torch.equal(ttnn.to_torch(tiled), page_table)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, torch.randn(3, 5)),
        (torch.bfloat16, torch.randn(3, 5).to(torch.bfloat16)),
        (torch.float16, torch.randn(2, 7).to(torch.float16)),
        (torch.int64, torch.tensor([[1, 50_000, 151_935]])),
        (torch.int32, torch.tensor([[0, 5, -1, -1]], dtype=torch.int32)),
        (torch.int16, torch.tensor([-2, 300], dtype=torch.int16)),
        (torch.int8, torch.tensor([-2, 100], dtype=torch.int8)),
        (torch.uint8, torch.tensor([0, 7, 255], dtype=torch.uint8)),
        (torch.bool, torch.tensor([True, False, True])),
    ],
)
def test_llmrt_staging_round_trips_through_the_real_wheel(
    dtype: torch.dtype, value: torch.Tensor
) -> None:
    plan = staging_plan(dtype)
    staged = stage(value, plan)
    t = ttnn.from_torch(staged, dtype=plan.ttnn_dtype(ttnn), layout=plan.ttnn_layout(ttnn))
    assert (t.dtype.name, t.layout.name) == (plan.tt_dtype, plan.layout)
    assert t.storage_type() == ttnn.StorageType.HOST
    back = unstage(ttnn.to_torch(t), plan)
    assert back.dtype == dtype
    assert torch.equal(back, value)


def test_bfloat8_kv_staging_through_the_real_wheel() -> None:
    plan = staging_plan(torch.bfloat16, float_dtypes={torch.bfloat16: "bfloat8_b"})
    value = torch.randn(2, 3, 40).to(torch.bfloat16)
    t = ttnn.from_torch(
        stage(value, plan), dtype=plan.ttnn_dtype(ttnn), layout=plan.ttnn_layout(ttnn)
    )
    assert (t.dtype.name, tuple(t.padded_shape)) == ("BFLOAT8_B", (2, 32, 64))
    back = unstage(ttnn.to_torch(t), plan)
    assert back.dtype == torch.bfloat16
    assert float((back.float() - value.float()).abs().max()) <= 2**-5 * float(value.abs().max())


@pytest.mark.parametrize(
    ("source", "dtype", "layout"),
    [
        (torch.float32, None, None),
        (torch.bfloat16, None, "TILE_LAYOUT"),
        (torch.float16, None, None),
        (torch.int64, None, None),
        (torch.int32, None, None),
        (torch.int16, None, None),
        (torch.uint8, None, None),
        (torch.bool, None, None),
        (torch.float32, "bfloat16", "TILE_LAYOUT"),
        (torch.float32, "bfloat8_b", "TILE_LAYOUT"),
        (torch.int32, "uint32", "ROW_MAJOR_LAYOUT"),
        (torch.int32, "int32", "TILE_LAYOUT"),
    ],
)
def test_fake_conversions_agree_with_the_real_wheel(
    source: torch.dtype, dtype: str | None, layout: str | None
) -> None:
    fake = FakeTtnn()
    value = (torch.randn(3, 5) * 4).to(source)
    results = []
    for module in (ttnn, fake):
        t = module.from_torch(
            value,
            dtype=None if dtype is None else getattr(module, dtype),
            layout=None if layout is None else getattr(module, layout),
        )
        back = module.to_torch(t)
        results.append((t.dtype.name, t.layout.name, tuple(t.shape), tuple(t.padded_shape), back))
    (real, fake_result) = results
    assert real[:4] == fake_result[:4]
    assert real[4].dtype == fake_result[4].dtype
    if dtype != "bfloat8_b":
        assert torch.equal(real[4].to(torch.float64), fake_result[4].to(torch.float64))


# the fake's strictness, as far as the host can observe the real library


_NAMES = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
    "and", "or", "xor", "lshift", "rshift", "divmod",
)  # fmt: skip
_UNARY_AND_COMPARISONS = ("neg", "pos", "abs", "invert", "lt", "le", "eq", "ne", "gt", "ge")
_CONTAINER_AND_CONVERSIONS = (
    "getitem", "setitem", "delitem", "len", "contains", "iter", "bool", "float", "int", "index",
)  # fmt: skip
#: Every Python operator hook a tensor class could define (binary, reflected, in-place, unary,
#: comparison, container and conversion).
OPERATOR_HOOKS = frozenset(
    {f"__{n}__" for n in _NAMES}
    | {f"__r{n}__" for n in _NAMES}
    | {f"__i{n}__" for n in _NAMES}
    | {f"__{n}__" for n in _UNARY_AND_COMPARISONS + _CONTAINER_AND_CONVERSIONS}
)


def _defined_hooks(cls: type) -> set[str]:
    """The operator hooks ``cls`` or a base other than ``object`` defines."""
    return {n for n in OPERATOR_HOOKS if any(n in vars(k) for k in cls.__mro__[:-1])}


def test_fake_tensor_has_exactly_the_real_tensors_operators() -> None:
    real = _defined_hooks(ttnn.Tensor)
    assert _defined_hooks(FakeTtnn.Tensor) == real
    assert set(TENSOR_OPERATORS) | {"__getitem__"} == real
    assert not hasattr(ttnn.Tensor, "__torch_function__")  # the fake's refuses by default


def test_fake_enums_and_recipe_options_name_real_members() -> None:
    for name in ("FabricConfig", "DispatchCoreType", "DispatchCoreAxis"):
        fake_members = {m.name for m in getattr(FakeTtnn, name)}
        real_members = {m for m in dir(getattr(ttnn, name)) if m.isupper()}
        assert fake_members <= real_members, name
    gelu_variants = {m for m in dir(ttnn.GeluVariant) if not m.startswith("_")}
    assert {m.name for m in FakeTtnn.GeluVariant} <= gelu_variants
    assert {c.upper() for c in FABRIC_CONFIGS} <= {m for m in dir(ttnn.FabricConfig)}
    assert {c.upper() for c in DISPATCH_CORE_TYPES} <= {m for m in dir(ttnn.DispatchCoreType)}
    assert {"type"} <= param_names(ttnn.DispatchCoreConfig)
    assert ttnn.DispatchCoreConfig(type=ttnn.DispatchCoreType.ETH).type == ttnn.DispatchCoreType.ETH


@pytest.mark.parametrize("case", sorted(LIBRARY_ERRORS))
def test_the_fakes_error_messages_are_the_libraries(case: str) -> None:
    """The text the fake raises (checked on every machine by test_ttnn_fake) is in the wheel."""
    text, provoke = LIBRARY_ERRORS[case]
    libraries = sorted((Path(ttnn.__file__).parent / "build" / "lib").glob("*.so*"))
    assert libraries, "the wheel's shared libraries were not found"
    needle = text.encode()
    assert any(needle in path.read_bytes() for path in libraries), text
    assert says(fake_message(provoke), text)
