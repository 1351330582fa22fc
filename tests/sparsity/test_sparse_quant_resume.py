"""A sparse-quantized checkpoint (masks and amax) resumed in a fresh process: ``load_pruned`` into a model quantized with
the same config (no calibration) gives bit-identical outputs and a handle that holds the masks through more QAT; into
a float model it refuses with the way to do it, instead of torch's list of unexpected amax keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import quant, sparsity
from overdrive._utils.errors import UsageError
from overdrive.recipes.quant import qat
from overdrive.sparsity.api import load_pruned


def _build() -> nn.Module:
    return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 4 * 4, 32))


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, torch.Tensor], torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    x, y = torch.randn(32, 16, 4, 4), torch.randint(0, 32, (32,))
    model = _build().eval()
    handle = sparsity.sparsify(model)
    model = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: m(x))
    train = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    qat(model, train, epochs=1, lr=1e-3, attach=handle.attach)
    handle.verify()
    return {k: v.clone() for k, v in model.state_dict().items()}, x, train


def test_resume_sparse_quantized_checkpoint_and_qat(trained) -> None:
    state, x, train = trained
    fresh = quant.quantize(_build(), quant.INT8_DEFAULT)  # no forward_loop: amax come from the checkpoint
    handle = load_pruned(fresh, state)
    assert [layer.name for layer in handle.layers] == ["0.weight", "3.weight"]
    ref = _build()
    ref.load_state_dict({k: v for k, v in state.items() if "quantizer" not in k and "mask" not in k})
    with torch.no_grad():  # reference: fake-quant by hand, amax from the checkpoint, fp32
        w0 = state["0.weight"]
        s = state["0.weight_quantizer.amax"][:, None, None, None] / 127
        expect = nn.functional.conv2d(_fq(x, state["0.input_quantizer.amax"]), (w0 / s).round().clamp(-127, 127) * s,
                                      state["0.bias"], padding=1)
        torch.testing.assert_close(fresh.eval()[0](x), expect, atol=1e-5, rtol=1e-5)
    before = {layer.name: layer.weight.detach().clone() for layer in handle.layers}
    qat(fresh, train, epochs=1, lr=1e-3, attach=handle.attach)  # resumed QAT keeps the masks
    handle.verify()
    for layer in handle.layers:
        wq = layer.module.weight_quantizer(layer.weight.detach())
        assert bool((wq[~layer.mask] == 0).all()) and sparsity.is_2to4(wq)
        assert not torch.equal(layer.weight.detach(), before[layer.name])


def _fq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    s = amax / 127
    return (x / s).round().clamp(-128, 127) * s


def test_load_into_float_model_names_the_fix(trained) -> None:
    state, _, _ = trained
    fresh = _build()
    with pytest.raises(UsageError, match=r"quantizer state \(0.input_quantizer.amax and more\).*quant.quantize"):
        load_pruned(fresh, state)
    assert not any(n.endswith("_sparse_mask") for n, _ in fresh.named_buffers())  # left as it was
