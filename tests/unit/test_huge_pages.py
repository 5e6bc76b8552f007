"""``device.huge_pages``: a CPU model's weights copied into one mapping advised onto huge pages.

The contract, stated independently of the code: every parameter and buffer keeps its values,
shape, strides, dtype, class and ``requires_grad``; tensors that shared a storage still share
one (a tied weight, a view); the tensor objects themselves are rebound (so a checkpoint that
holds them sees the move); all of them end up in one mapping that carries the kernel's
huge-page advice (``hg`` in its ``VmFlags``); a second call moves nothing; the advice is
refused with a reason when the system disables transparent huge pages. What was copied is given
back as the copy goes (resident memory, read from the kernel: ``VmHWM`` / ``statm``): the
placement never holds all of its sources beside all of the copy, and leaves neither the freed
heap, nor the sources' file pages, nor a view's old base resident.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmrt.device import huge_pages
from llmrt.device.huge_pages import huge_pages_unavailable, place_module_weights
from llmrt.kernels.file_pages import release_file_pages
from llmrt.kernels.formats import StackedWeight
from llmrt.testing.gguf_blocks import random_quantized
from llmrt.weights.mapped_pages import mapping_usage

MIB = 1 << 20

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux THP")


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``address`` (from ``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.proj = torch.nn.Linear(64, 300, bias=True)
        self.proj.weight = self.embed.weight  # tied, one Parameter
        self.proj.bias.requires_grad_(False)
        table = torch.randn(512, 96)
        self.register_buffer("rows", table[:100])  # a view at offset 0
        self.register_buffer("cols", table[:, 32:64])  # a strided view of the same storage
        self.register_buffer("ints", torch.arange(1000, dtype=torch.int64))
        with torch.inference_mode():
            self.register_buffer("frozen", torch.randn(33, 7))  # an inference tensor


def snapshot(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...], bool]]:
    return {
        name: (t.detach().clone(), t.stride(), t.requires_grad)
        for name, t in list(module.named_parameters()) + list(module.named_buffers())
    }


@linux_only
@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_placement_keeps_every_tensor_and_moves_them_into_one_advised_mapping() -> None:
    module = Tied()
    before = snapshot(module)
    objects = dict(list(module.named_parameters()) + list(module.named_buffers()))
    old = {name: t.untyped_storage().data_ptr() for name, t in objects.items()}
    x = torch.randint(0, 300, (5,))
    expected = module.proj(module.embed(x))

    placement = place_module_weights(module)

    after = dict(list(module.named_parameters()) + list(module.named_buffers()))
    for name, (value, stride, grad) in before.items():
        tensor = after[name]
        assert tensor is objects[name], name  # rebound in place, not replaced
        assert torch.equal(tensor, value) and tensor.dtype == value.dtype, name
        assert tensor.stride() == stride and tensor.requires_grad == grad, name
        assert tensor.untyped_storage().data_ptr() != old[name], name
    assert isinstance(module.proj.weight, torch.nn.Parameter)
    assert module.proj.weight is module.embed.weight
    # The two views of one table still alias: a write through one shows through the other.
    with torch.no_grad():
        module.rows[3, 40] = 123.0
    assert module.cols[3, 8].item() == 123.0
    # One mapping holds every storage, and it carries the huge-page advice.
    storages = {t.untyped_storage().data_ptr() for t in after.values()}
    assert len(storages) == 1
    assert "hg" in vm_flags(module.embed.weight.data_ptr())
    # The layout the copy chose: cache-line aligned starts, tensors counted once.
    assert all(t.data_ptr() % 64 == 0 for t in (module.embed.weight, module.ints, module.frozen))
    assert placement.storages == 5  # embed/proj weight, proj bias, the table, ints, frozen
    assert placement.skipped == 0
    assert placement.placed_bytes >= sum(v[0].nbytes for k, v in before.items() if k != "cols")
    assert placement.huge_bytes is not None and 0 <= placement.huge_bytes <= placement.placed_bytes
    assert torch.equal(module.proj(module.embed(x)), expected)
    # Gradients still flow to a trainable placed parameter.
    module.proj(module.embed(x)).sum().backward()
    assert module.embed.weight.grad is not None


@linux_only
@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_a_second_placement_moves_nothing_and_a_freed_one_is_forgotten() -> None:
    first = torch.nn.Linear(256, 256)
    place_module_weights(first)
    address = first.weight.data_ptr()
    second = torch.nn.Sequential(first, torch.nn.Linear(256, 8))
    again = place_module_weights(second)
    assert first.weight.data_ptr() == address  # the shared part stays where it was
    assert again.storages == 2 and again.skipped == 1  # only the new layer's weight and bias
    assert place_module_weights(first).placed_bytes == 0
    storage = first.weight.untyped_storage().data_ptr()
    assert huge_pages._is_placed(storage)
    del first, second
    gc.collect()
    assert not huge_pages._is_placed(storage)


@linux_only
@pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))
def test_followers_of_a_placed_storage_move_with_it_and_others_stay() -> None:
    """A checkpoint's own views of a weight the model holds (other tensor objects, other
    offsets) are rebound with it, so nothing keeps the old storage; a tensor of a storage
    the module does not hold is left where it is."""
    layer = torch.nn.Linear(64, 32, bias=False)
    rows = layer.weight.detach()[8:24]  # a view at an offset, another tensor object
    expected = rows.clone()
    elsewhere = torch.arange(10.0)
    at = elsewhere.data_ptr()
    old = layer.weight.untyped_storage().data_ptr()

    place_module_weights(layer, followers=[rows, elsewhere])

    placed = layer.weight.untyped_storage().data_ptr()
    assert placed != old and rows.untyped_storage().data_ptr() == placed
    assert rows.data_ptr() == layer.weight.data_ptr() + 8 * 64 * 4
    assert torch.equal(rows, expected)
    assert elsewhere.data_ptr() == at


def test_an_empty_module_places_nothing() -> None:
    placement = place_module_weights(torch.nn.ReLU())
    assert (placement.placed_bytes, placement.storages, placement.skipped) == (0, 0, 0)


def test_sparse_and_empty_tensors_stay_where_they_are() -> None:
    module = torch.nn.Module()
    sparse = torch.eye(64).to_sparse()
    empty = torch.empty(0, 5)
    module.register_buffer("sparse", sparse)
    module.register_buffer("empty", empty)
    placement = place_module_weights(module)
    assert placement.storages == 0
    assert module.sparse is sparse and torch.equal(module.sparse.to_dense(), torch.eye(64))
    assert module.empty is empty


@pytest.mark.parametrize(
    ("content", "refused"),
    [
        ("always [madvise] never\n", False),
        ("[always] madvise never\n", False),
        ("always madvise [never]\n", True),
    ],
)
def test_the_system_mode_decides_whether_huge_pages_are_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str, refused: bool
) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    sysfs = tmp_path / "enabled"
    sysfs.write_text(content)
    monkeypatch.setattr(huge_pages, "THP_ENABLED", sysfs)
    why = huge_pages_unavailable()
    if refused:
        assert why is not None and "never" in why
    else:
        assert why is None
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    missing = huge_pages_unavailable()
    assert missing is not None and "missing" in missing


@linux_only
@pytest.mark.parametrize("huge", [True, False])
def test_a_cpu_device_advises_its_large_allocations_when_asked(huge: bool) -> None:
    from llmrt.device.torch import LAZY_ZERO_BYTES, TorchDevice

    device = TorchDevice("cpu", huge_pages=huge)
    lane = device.lanes(2)[1]  # lanes share the setting
    for owner in (device, lane):
        pool = owner.allocate(shape=(4, LAZY_ZERO_BYTES // 4), dtype=torch.float32)
        assert torch.count_nonzero(pool) == 0  # zero-filled, whatever the pages
        pool[3, -1] = 1.0
        flags = vm_flags(pool.data_ptr())
        assert ("hg" in flags) == (huge and huge_pages_unavailable() is None)
        owner.deallocate(pool)
        small = owner.allocate(shape=(8,), dtype=torch.float32)  # below the mapping size
        assert torch.count_nonzero(small) == 0
        owner.deallocate(small)


def resident() -> int:
    """This process's resident bytes now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


#: A fresh interpreter: 96 MiB in six 16 MiB heap buffers (kept by the C library once freed,
#: as ``retain_freed_memory`` sets it on every CPU device; applied here, in a process of its
#: own, since it cannot be undone), the last one also viewed by a follower; placed with a
#: 32 MiB give-back step. Prints the start, the high-water mark (``VmHWM``, reset before the
#: placement) and the end, in bytes, or ``skip`` and why.
HEAP_SCENARIO = """
import gc, sys
from pathlib import Path
import torch
from llmrt.device import huge_pages
from llmrt.device.host_memory import retain_freed_memory, trim_freed_memory
def resident():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
def high_water():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
why = retain_freed_memory()
if why is not None:
    print("skip", why); sys.exit()
huge_pages.GIVE_BACK_BYTES = 32 << 20
module = torch.nn.Module()
for i in range(6):
    module.register_buffer(f"b{i}", torch.full((4 << 20,), float(i)))
follower = module.b5.detach()[1:]
gc.collect(); trim_freed_memory()
before = resident()
try:
    Path("/proc/self/clear_refs").write_text("5")
except OSError as exc:
    print("skip", exc); sys.exit()
placement = huge_pages.place_module_weights(module, followers=[follower])
peak, after = high_water(), resident()
assert placement.storages == 6 and placement.pinned == 0
assert all(bool((getattr(module, f"b{i}") == float(i)).all()) for i in range(6))
assert follower.untyped_storage().data_ptr() == module.b5.untyped_storage().data_ptr()
print(before, peak, after)
"""


@linux_only
def test_the_placement_gives_back_its_heap_sources_as_it_copies() -> None:
    """Resident memory never rises more than one give-back step and one buffer above its
    start, and ends where it started (no source, not even one a follower viewed, outlives
    its copy)."""
    done = subprocess.run(
        [sys.executable, "-c", HEAP_SCENARIO], capture_output=True, text=True, check=True
    )
    words = done.stdout.split()
    if words[0] == "skip":
        pytest.skip(" ".join(words[1:]))
    before, peak, after = (int(w) for w in words)
    assert peak - before <= (32 + 16 + 16) * MIB, f"peak +{(peak - before) / MIB:.0f} MiB"
    assert after - before <= 16 * MIB, f"ended +{(after - before) / MIB:.0f} MiB"


@linux_only
def test_the_placement_gives_back_the_file_pages_it_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight read from a file mapping, copied in several give-back steps: once placed,
    none of its file pages stay resident, and the placed copy reads the file's bytes."""
    monkeypatch.setattr(huge_pages, "GIVE_BACK_BYTES", 4 * MIB)  # six steps
    data = np.random.default_rng(0).integers(0, 256, 24 * MIB, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, mode="c", dtype=np.uint8)  # private, clean: file pages
    module = torch.nn.Module()
    module.register_buffer("w", torch.from_numpy(mapped))
    assert int(module.w[::4096].sum()) >= 0  # fault every page in
    address = mapped.ctypes.data // 4096 * 4096
    usage = mapping_usage(address)
    if usage is None:
        pytest.skip("/proc/self/smaps is unreadable")
    assert usage["Rss"] >= 20 * MIB
    place_module_weights(module, give_back=release_file_pages)
    usage = mapping_usage(address)
    assert usage is not None and usage["Rss"] <= 64 * 1024, usage
    assert np.array_equal(module.w.numpy(), data)


@linux_only
def test_a_placed_view_does_not_keep_its_old_base_resident() -> None:
    """Buffers sliced from one 64 MiB tensor (autograd views of it): after the placement the
    old 64 MiB are freed, though the views' base was never a buffer itself."""
    whole = torch.arange(16 * MIB, dtype=torch.float32)  # 64 MiB: its own mapping
    module = torch.nn.Module()
    module.register_buffer("head", whole[: 4 * MIB])
    module.register_buffer("tail", whole[4 * MIB :])
    del whole
    gc.collect()
    before = resident()
    placement = place_module_weights(module)
    gc.collect()
    assert resident() - before <= 16 * MIB, f"+{(resident() - before) / MIB:.0f} MiB"
    assert int(module.head[-1]) == 4 * MIB - 1 and int(module.tail[0]) == 4 * MIB
    assert module.tail.data_ptr() == module.head.data_ptr() + 16 * MIB
    assert placement.pinned == 0 and "weights_pinning_old_storage" not in placement.log_fields()


def test_a_view_whose_base_is_another_storage_is_reported() -> None:
    """A view rebound onto another storage (as fusing a checkpoint's row slices does) still
    holds its base's storage after the move: counted and logged, not hidden."""
    base = torch.zeros(1000)
    view = base[10:20]
    other = torch.arange(10.0)
    view.set_(other.untyped_storage(), 0, (10,), (1,))
    module = torch.nn.Module()
    module.register_buffer("part", view)
    placement = place_module_weights(module)
    assert placement.pinned == 1
    assert "1 tensors" in str(placement.log_fields()["weights_pinning_old_storage"])
    assert torch.equal(module.part, torch.arange(10.0))


@linux_only
def test_a_fused_weight_packed_before_the_placement_is_not_copied_again_after_it() -> None:
    """The fused decode step packs a stacked weight's parts after the placement moved them
    (``StackedWeight.packed``): it finds them in the placed mapping, no second blob."""
    parts = (random_quantized("q4_k", 64, 256, seed=3), random_quantized("q6_k", 32, 256, seed=4))
    _, code, viewed = StackedWeight(parts=parts).packed()
    expected = viewed.dequantize()
    module = torch.nn.Module()
    for i, part in enumerate(viewed.parts):
        module.register_buffer(f"p{i}", part.blocks)
    place_module_weights(module)
    placed = module.p0.untyped_storage().data_ptr()
    again, code_again, same = viewed.packed()
    assert again.untyped_storage().data_ptr() == placed and huge_pages._is_placed(placed)
    assert code_again == code and same is viewed
    assert torch.equal(viewed.dequantize(), expected)
