"""Channel permutation: outputs unchanged (incl. BatchNorm stats of producers), kept magnitude up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.sparsity import SparsityConfig as Config, sparsify
from overdrive.sparsity.masks import m4n2_1d
from overdrive.sparsity.permutation import apply_permutation, find_groups, group_score, permute_for_sparsity, search_permutation


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.c2 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.c3 = nn.Conv2d(32, 32, 1)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.c1(x)))
        y = nn.functional.max_pool2d(y, 1)  # not a module: stops c1's group (unknown op)
        z = self.bn2(self.c2(y)).relu()
        z = self.c3(z) + y  # residual add: c3's output order must stay
        h = z.mean(dim=(2, 3))
        return self.fc2(nn.functional.gelu(self.fc1(h)))


def _trained_bn(model: nn.Module) -> None:
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 16, 6, 6))
    model.eval()


def test_groups_found_and_blocked() -> None:
    groups, _ = find_groups(Net())
    prods = {g["producer"]: g for g in groups}
    assert set(prods) == {"c2", "fc1"}  # c1 feeds an unknown function, c3 a residual add
    assert prods["c2"]["consumers"] == ["c3"] and prods["c2"]["channelwise"] == ["bn2"]
    assert prods["fc1"]["consumers"] == ["fc2"]


@pytest.mark.parametrize("train_mode", [False, True])
def test_permutation_alone_leaves_outputs_unchanged(train_mode: bool) -> None:
    model = Net()
    _trained_bn(model)
    x = torch.randn(4, 16, 6, 6)
    model.train(train_mode)
    with torch.no_grad():
        ref = model(x)
    groups, _ = find_groups(model)
    for g in groups:
        c = model.get_submodule(g["consumers"][0]).weight.shape[1]
        apply_permutation(model, g, torch.randperm(c))
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_search_raises_kept_magnitude_and_never_lowers_it() -> None:
    torch.manual_seed(1)
    # Structured so that a good permutation exists: columns of equal scale sit together.
    w = torch.randn(32, 32) * torch.tensor([10.0, 10.0, 10.0, 10.0, 0.1, 0.1, 0.1, 0.1] * 4)
    perm = search_permutation(w, budget_s=5.0)
    assert sorted(perm.tolist()) == list(range(32))

    def kept(m: torch.Tensor) -> float:
        return float((m.abs() * m4n2_1d(m)).sum())

    # The optimum puts 2 large columns in every group (keeps all of them): ~4/3 of the identity's.
    big = float(w[:, [i for i in range(32) if i % 8 < 4]].abs().sum())
    assert kept(w[:, perm]) > kept(w) * 1.25
    assert kept(w[:, perm]) >= big
    r = torch.randn(16, 16)
    assert kept(r[:, search_permutation(r, 1.0)]) >= kept(r) - 1e-4
    assert float(group_score(torch.ones(3, 4))) == 6.0


def test_sparsify_with_permutation_reports_gain_and_keeps_dense_function() -> None:
    torch.manual_seed(0)
    model = Net()
    _trained_bn(model)
    x = torch.randn(4, 16, 6, 6)
    plain = Net()
    plain.load_state_dict(model.state_dict())
    hp = sparsify(model, Config(permutation=True, permutation_budget_s=2.0))
    rep = hp.report()
    assert rep.permutation["groups"] >= 1
    assert rep.retained_magnitude_unpermuted is not None
    assert rep.retained_magnitude >= rep.retained_magnitude_unpermuted
    hu = sparsify(plain)
    assert hu.report().retained_magnitude == pytest.approx(rep.retained_magnitude_unpermuted, rel=1e-6)
    assert model(x).shape == (4, 16)


def test_untraceable_model_is_noted_not_fatal() -> None:
    class Dyn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace this
                x = -x
            return self.b(self.a(x))

    h = sparsify(Dyn(), Config(permutation=True))
    assert any("could not trace" in n for n in h.report().permutation["notes"])


class _Tied(nn.Module):
    """b and c share one weight: permuting b's input channels would permute c's too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.c.weight = self.b.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + self.c(x)


def test_tied_weights_are_not_permuted() -> None:
    torch.manual_seed(0)
    model = _Tied()
    x = torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
    groups, notes = find_groups(model)
    assert groups == [] and any("shared" in n for n in notes)
    info = permute_for_sparsity(model, [model.a, model.b, model.c], Config(permutation=True))
    assert info["groups"] == 0
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)  # the permutation alone changes nothing


@pytest.mark.parametrize("norm", ["weight_norm_hook", "weight_norm_parametrization", "spectral_norm_parametrization"])
@pytest.mark.parametrize("where", ["producer", "consumer"])
def test_computed_weights_keep_their_channel_order(norm: str, where: str) -> None:
    """A weight_norm'd producer or consumer recomputes its weight from g and v at every forward: reordering the
    computed tensor did nothing, so the others' channels moved alone and the outputs changed (by ~0.27 here)."""
    import warnings

    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)]
    i = 0 if where == "producer" else 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        layers[i] = {"weight_norm_hook": nn.utils.weight_norm,
                     "weight_norm_parametrization": parametrizations.weight_norm,
                     "spectral_norm_parametrization": parametrizations.spectral_norm}[norm](layers[i])
    model = nn.Sequential(*layers).eval()  # eval: spectral_norm's power iteration stays put
    x = torch.randn(5, 32)
    with torch.no_grad():
        ref = model(x)
    info = permute_for_sparsity(model, [m for m in model if isinstance(m, nn.Linear)], Config(permutation=True))
    assert any("computes its weight" in n for n in info["notes"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)  # the permutation alone changes nothing


class _KeywordInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(input=self.a(x)))


def test_elementwise_call_with_keyword_input_is_followed() -> None:
    """``F.gelu(input=h)`` has no positional argument: the group search raised IndexError inside sparsify."""
    torch.manual_seed(0)
    model = _KeywordInput()
    x = torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
    groups, _ = find_groups(model)
    assert [(g["producer"], g["consumers"]) for g in groups] == [("a", ["b"])]
    permute_for_sparsity(model, [model.a, model.b], Config(permutation=True))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-6, atol=1e-6)
