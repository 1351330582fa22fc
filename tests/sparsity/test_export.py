"""Compressed checkpoint: exact round trip, about half the bytes; export errors on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import compress, compute_mask, decompress, load_compressed, save_compressed, sparsify


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4, 64), nn.ReLU(),
                         nn.Linear(64, 10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 16), (16, 32, 3, 3), (8, 64, 2)])
def test_compress_round_trip_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    w = torch.randn(shape).to(dtype)
    m = compute_mask(w)
    w = w * m
    entry = compress(w, m)
    assert entry["values"].numel() == w.numel() // 2 and entry["meta"].numel() == w.numel() // 8
    assert torch.equal(decompress(entry), w)


def test_checkpoint_round_trip_and_size(tmp_path: Path) -> None:
    model = _model()
    handle = sparsify(model)
    x = torch.randn(2, 16, 4, 4)
    ref = model(x)
    stats = save_compressed(handle, tmp_path / "m.pt")
    assert stats["compressed_weight_bytes"] / stats["dense_weight_bytes"] == pytest.approx(0.5 + 1 / 32)
    fresh = _model()
    h2 = load_compressed(fresh, tmp_path / "m.pt")
    for a, b in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert torch.equal(fresh(x), ref)
    assert [layer.name for layer in h2.layers] == [layer.name for layer in handle.layers]
    # loading into a model that is already sparsified works too
    again = _model()
    sparsify(again)
    load_compressed(again, tmp_path / "m.pt")
    assert torch.equal(again(x), ref)


def test_load_errors(tmp_path: Path) -> None:
    handle = sparsify(_model())
    save_compressed(handle, tmp_path / "m.pt")
    wrong = nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4, 32), nn.ReLU(),
                          nn.Linear(32, 10))
    with pytest.raises(UsageError, match=r"3.weight: the file's weight is \(64, 128\)"):
        load_compressed(wrong, tmp_path / "m.pt")
    torch.save({"x": 1}, tmp_path / "plain.pt")
    with pytest.raises(UsageError, match="not an overdrive 2:4 compressed checkpoint"):
        load_compressed(_model(), tmp_path / "plain.pt")


def test_semi_structured_export_without_sparse_gpu_raises() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the GPU test covers export")
    model = _model().to(torch.float16)
    handle = sparsify(model)
    with pytest.raises(UsageError, match="sparse tensor cores"):
        handle.export()


def test_compress_checks_the_mask() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(UsageError, match=r"mask shape \(8, 32\) does not match weight shape \(8, 16\)"):
        compress(w, compute_mask(torch.randn(8, 32)))
    m = compute_mask(w)
    assert torch.equal(decompress(compress(w * m, m.float())), w * m)  # a 0/1 float mask works too


def test_a_failed_load_leaves_the_model_unpruned(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _model()
    handle = sparsify(model)
    save_compressed(handle, tmp_path / "m.pt")
    wrong = nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4, 64), nn.ReLU(),
                          nn.Linear(64, 16))  # the last layer (16 out) is prunable here, not in the file
    with pytest.raises(UsageError, match=r"m.pt does not fit this model \(size mismatch for 5.weight"):
        load_compressed(wrong, tmp_path / "m.pt")
    assert [n for n, _ in wrong.named_buffers()] == []  # no masks left behind by the failed load
    assert len(sparsify(wrong).layers) == 3  # so it can still be pruned (it was refused as "already pruned")


def test_a_file_saved_from_a_wrapped_model_loads_into_the_plain_one(tmp_path: Path) -> None:
    """A file saved from a DDP-wrapped (``module.``) or compiled (``_orig_mod.``) model named its layers with the
    wrapper's prefix, and loading it into the plain model failed with "no prunable layer"; a missing file raised a raw
    FileNotFoundError. Reference: the wrapped model's pruned weights, exactly."""

    class Wrapper(nn.Module):  # what DDP looks like to named_modules: the model under ``module``
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.module = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    torch.manual_seed(0)
    wrapped = Wrapper(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    handle = sparsify(wrapped)
    save_compressed(handle, tmp_path / "w.pt")
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    load_compressed(plain, tmp_path / "w.pt")
    for a, b in zip(plain.parameters(), wrapped.module.parameters()):
        assert torch.equal(a, b)
    again = Wrapper(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)))
    load_compressed(again, tmp_path / "w.pt")  # a model wrapped the same way keeps the names
    assert torch.equal(again.module[0].weight, wrapped.module[0].weight)
    with pytest.raises(UsageError, match="compressed checkpoint .* does not exist"):
        load_compressed(plain, tmp_path / "missing.pt")
