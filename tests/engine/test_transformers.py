"""Transformers through engines with no wrapper and no padding (issue 21): inputs by name, integer inputs made
as integers, dynamic batch and sequence with the dims that inputs share inferred, on both backends, from the
module and from its ONNX export. Small BERT-, GPT-2- and T5-style models built from configs; the reference is
the eager model in eval mode at each shape (fp32 engines: within 1e-4)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile
from overdrive.engine.sources import from_module

transformers = pytest.importorskip("transformers")

NAMES = ["input_ids", "attention_mask"]
PROFILES = tuple(ShapeProfile(n, (1, 1), (2, 16), (4, 48)) for n in NAMES)
SHAPES = [(1, 1), (3, 5), (2, 17), (4, 48)]


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=120, max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=120,
                                                          n_positions=64)).eval()


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=120)
    return transformers.T5EncoderModel(cfg).eval()


def _inputs(b: int, s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 31 * b + s)
    ids = torch.randint(0, 120, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, s // 2 + 1:] = 0  # a padded row: the mask must reach the attention
    return ids, mask


def _check_all_lengths(engine: Engine, model: torch.nn.Module) -> None:
    for b, s in SHAPES:
        ids, mask = _inputs(b, s)
        out = engine(ids, mask)
        out = out[0] if isinstance(out, (tuple, dict)) else out  # an EngineOutput by key: its first
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=f"batch {b}, sequence {s}")


@pytest.mark.parametrize("factory, backend", [(_bert, "inductor"), (_bert, "onnxruntime"), (_gpt2, "onnxruntime"),
                                              (_gpt2, "inductor"), (_t5, "inductor")])
def test_every_sequence_length_from_the_module(factory, backend: str) -> None:
    model = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Builder(BuildConfig(backend=backend, profiles=PROFILES)).build(model)  # no example: made as tokens
    assert [i["dtype"] for i in engine.info["inputs"]] == ["int64", "int64"]
    _check_all_lengths(engine, model)
    if backend == "inductor":  # torch.export found that the two inputs share the sequence length
        assert [["attention_mask", 1], ["input_ids", 1]] in map(sorted, engine.header["backend_meta"]["shared_dims"])
        with pytest.raises(UsageError, match=r"input_ids\[1\]=5, attention_mask\[1\]=6 must be equal"):
            engine(torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 6, dtype=torch.int64))


def test_every_sequence_length_from_onnx_on_inductor() -> None:
    """The ONNX importer kept the traced length where a constant (position ids) is cut at the sequence length."""
    model = _bert()
    onnx = from_module(model, NAMES).as_onnx(_inputs(2, 16), list(PROFILES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Builder(BuildConfig(backend="inductor", profiles=PROFILES)).build(onnx)
    _check_all_lengths(engine, model)


def test_onnx_export_leaves_the_model_in_eval_mode() -> None:
    """The exporter put the by-name wrapper's training mode back on the user's model (dropout on afterwards)."""
    model = _bert()
    ids, mask = _inputs(2, 8)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).last_hidden_state
    from_module(model, NAMES).as_onnx(_inputs(2, 16), list(PROFILES))
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state, before, rtol=0, atol=0)


def test_a_dim_the_model_fixes_is_named() -> None:
    class FixedLength(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(x.shape[0], 16) * 2  # only sequence 16 works

    prof = (ShapeProfile("x", (1, 16), (2, 16), (4, 16)),)
    Builder(BuildConfig(backend="inductor", profiles=prof)).build(FixedLength())  # static sequence: fine
    prof = (ShapeProfile("x", (1, 1), (2, 16), (4, 32)),)
    with pytest.raises(Exception, match=r"x.*(dim 1|size\(\)\[1\])"):
        Builder(BuildConfig(backend="inductor", profiles=prof)).build(FixedLength())


def test_cli_builds_a_token_model_from_a_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny.py").write_text(
        "import torch, transformers\n"
        "def bert():\n"
        "    torch.manual_seed(0)\n"
        "    return transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=2, "
        "num_attention_heads=4, intermediate_size=64, vocab_size=120, max_position_embeddings=64))\n")
    monkeypatch.chdir(tmp_path)
    shapes = ["--minShapes", "input_ids:1x1,attention_mask:1x1", "--optShapes", "input_ids:2x16,attention_mask:2x16",
              "--maxShapes", "input_ids:4x48,attention_mask:4x48"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["build", "--model", "tiny.py:bert", *shapes, "--backend", "onnxruntime", "--save-engine",
                     "b.engine"]) == 0
        assert main(["build", "--model", "tiny.py:bert", "--shapes", "input_ids:2x16,attention_mask:2x16",
                     "--inputIOFormats", "int64:chw,int64:chw", "--backend", "inductor", "--save-engine",
                     "i.engine"]) == 0
        assert main(["exec", "--load-engine", "b.engine", "--shapes", "input_ids:3x33,attention_mask:3x33",
                     "--duration", "0.2", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "built b.engine" in out and "built i.engine" in out and "Throughput" in out
    model = _bert()
    _check_all_lengths(Engine.load(tmp_path / "b.engine"), model)


def test_a_token_model_builds_from_input_ids_alone() -> None:
    """``build(hf_model, (input_ids,))``, the call a user makes when they call ``model(input_ids)``: the engine takes
    one input (the attention_mask is optional in forward), where the build refused with "model takes inputs
    ['input_ids', 'attention_mask'] but 1 example input(s) were given". Reference: the eager model, within 1e-4."""
    model = _bert()
    ids = torch.randint(0, 120, (2, 9))
    eng = Builder(BuildConfig(precision="fp32", device="cpu")).build(model, (ids,))
    assert [b["name"] for b in eng.header["inputs"]] == ["input_ids"]
    with torch.no_grad():
        want = model(ids).last_hidden_state
    got = eng(ids)
    got = got[0] if isinstance(got, (tuple, list, dict)) else got
    assert torch.allclose(got, want, atol=1e-4)


def test_optional_positional_inputs_are_named_when_given() -> None:
    """``forward(x, mask=None)`` built with both: the engine takes both (the build counted only the required one)."""
    class Masked(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return x * 2 if mask is None else x * mask

    x, mask = torch.randn(2, 4), torch.rand(2, 4)
    eng = Builder(BuildConfig(precision="fp32", device="cpu")).build(Masked(), (x, mask))
    assert [b["name"] for b in eng.header["inputs"]] == ["x", "mask"]
    assert torch.allclose(eng(x, mask), x * mask)


def test_a_decoder_with_input_ids_alone_builds_for_every_length_on_onnxruntime(capfd: pytest.CaptureFixture[str]) -> None:
    """GPT-2 from input_ids alone with a dynamic profile: the TorchScript exporter fails on it and the dynamo
    exporter takes over; that fallback refused the profile ("inputs[0] is a tuple, but dynamic_shapes[0] is a
    dict": the by-name wrapper takes its inputs as one tuple), and the failed first attempt printed its whole IR
    graph (hundreds of lines) on stdout. Reference: the eager model at each shape, within 1e-4."""
    model = _gpt2()
    prof = (ShapeProfile("input_ids", (1, 1), (2, 16), (4, 48)),)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Builder(BuildConfig(backend="onnxruntime", profiles=prof, device="cpu")).build(model)
    out = capfd.readouterr()
    assert "Torch IR graph" not in out.out + out.err and len(out.out.splitlines()) < 5
    for b, s in SHAPES:
        ids = _inputs(b, s)[0]
        with torch.no_grad():
            want = model(ids).last_hidden_state
        got = engine(ids)
        got = got[0] if isinstance(got, (tuple, list, dict)) else got
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"batch {b}, sequence {s}")


def test_a_profile_naming_no_forward_parameter_lists_the_names_forward_takes() -> None:
    """--shapes ids:2x16 for a model whose forward takes input_ids: the error lists forward's names and shows the
    profile with the right one (it said 'missing [attention_mask, input_ids]', though attention_mask is optional)."""
    prof = (ShapeProfile("ids", (2, 16), (2, 16), (2, 16)),)
    with pytest.raises(UsageError, match=r"name \['ids'\], which the model's forward does not take; it takes "
                                         r"\['input_ids', .*e\.g\. input_ids:2x16"):
        Builder(BuildConfig(backend="onnxruntime", profiles=prof, device="cpu")).build(_gpt2())
