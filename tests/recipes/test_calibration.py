"""One calibration file format for every verb (overdrive.recipes.calibration): the same file works for
``build --calib`` and ``quantize --calib-data`` in each of its forms; (input_ids, attention_mask) pairs
calibrate a Hugging Face model (quantize refused them); input_ids alone get the mask from the model's
pad_token_id, with a warning (padding was attended to, silently); bad files are one-line errors naming the
file, what it holds and the format expected."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.recipes.model_spec import load_calibration

MODELS_PY = '''
import torch
from torch import nn


class Tok(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(200, 32), nn.Linear(32, 16)

    def forward(self, input_ids, attention_mask):
        h = self.fc(self.emb(input_ids))  # (B, T, 16)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


def tok():
    torch.manual_seed(0)
    return Tok()


def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=200))


def gpt2():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    return GPT2Model(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=200, n_positions=64))
'''


@pytest.fixture(scope="module")
def models_py(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "calib_models.py"
    path.write_text(MODELS_PY)
    return path


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """(8, 12) ids and mask; every other row padded (id 0, BERT's pad_token_id) from position 8."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 200, (8, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, 8:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _forms(tmp_path: Path) -> dict[str, Path]:
    """The same 8 samples in every multi-input form, batches of 4."""
    ids, mask = _tokens()
    forms = {
        "tuples": [(ids[:4], mask[:4]), (ids[4:], mask[4:])],
        "dict": {"input_ids": ids, "attention_mask": mask},
        "dicts": [{"attention_mask": mask[:4], "input_ids": ids[:4]}, {"input_ids": ids[4:], "attention_mask": mask[4:]}],
    }
    out = {}
    for name, data in forms.items():
        torch.save(data, tmp_path / f"{name}.pt")
        out[name] = tmp_path / f"{name}.pt"
    return out


def _run(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    return code, err.getvalue()


def _load_factory(models_py: Path, name: str) -> torch.nn.Module:
    from overdrive.recipes.model_spec import load_model

    return load_model(f"{models_py}:{name}").eval()


def test_every_form_loads_to_the_same_batches(tmp_path: Path, models_py: Path) -> None:
    ids, mask = _tokens()
    tok = _load_factory(models_py, "tok")
    for name, path in _forms(tmp_path).items():
        cal = load_calibration(str(path), batch_size=4, model=tok)
        assert cal.names == ("input_ids", "attention_mask"), name
        assert len(cal) == 2 and torch.equal(cal.batches[1][0], ids[4:]) and torch.equal(cal.batches[1][1], mask[4:]), name
        if name != "tuples":  # by name: in the engine's input order (a tuple is in that order already)
            engine_order = load_calibration(str(path), batch_size=4, input_names=["attention_mask", "input_ids"])
            assert torch.equal(engine_order.batches[0][0], mask[:4]), name
    single = tmp_path / "single.pt"
    for data in (torch.randn(10, 1, 8, 8), [torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8), torch.randn(2, 1, 8, 8)]):
        torch.save(data, single)
        cal = load_calibration(str(single), batch_size=4)
        assert [b[0].shape[0] for b in cal] == [4, 4, 2]


def test_same_file_for_build_and_quantize(tmp_path: Path, models_py: Path) -> None:
    for name, path in _forms(tmp_path).items():
        code, err = _run(["quantize", "--model", f"{models_py}:tok", "--calib-data", str(path), "--json", str(tmp_path / "q.json")])
        assert code == 0, (name, err)
        code, err = _run(["build", "--model", f"{models_py}:tok", "--shapes", "input_ids:4x12,attention_mask:4x12",
                          "--precision", "int8", "--calib", str(path), "--save-engine", str(tmp_path / f"{name}.engine")])
        assert code == 0, (name, err)


def _amax(result: dict) -> list[float]:
    return [r["input_amax"] for r in result["layers"]]


def test_hf_model_calibrates_on_pairs_by_name(tmp_path: Path, models_py: Path) -> None:
    """Pairs name (input_ids, attention_mask): calibration equals feeding them by keyword (GPT-2's second
    positional parameter is past_key_values), and quantize --export writes a dynamic-sequence Q/DQ model."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("transformers")
    from overdrive import quant
    from overdrive.recipes.quantize import run_quantize

    forms = _forms(tmp_path)
    ids, mask = _tokens()
    for arch in ("bert", "gpt2"):
        out = tmp_path / f"{arch}.onnx"
        res = run_quantize(f"{models_py}:{arch}", str(forms["tuples"]), "int8", "max", 99.99, 8, 4,
                           str(out) if arch == "bert" else None, None)
        ref = quant.quantize(_load_factory(models_py, arch), quant.INT8_DEFAULT,
                             forward_loop=lambda m: [m(input_ids=ids[k:k + 4], attention_mask=mask[k:k + 4]) for k in (0, 4)])
        assert _amax(res) == [r.input_amax for r in quant.summary(ref)["layers"]], arch
    g = onnx.load(str(tmp_path / "bert.onnx")).graph
    assert [i.name for i in g.input] == ["input_ids", "attention_mask"]
    assert [d.dim_param for d in g.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]


def test_input_ids_alone_get_the_mask_from_pad_token_id(tmp_path: Path, models_py: Path) -> None:
    pytest.importorskip("transformers")
    from overdrive.recipes.quantize import run_quantize

    ids, mask = _tokens()
    only_ids = tmp_path / "ids.pt"
    torch.save(ids, only_ids)
    bert = _load_factory(models_py, "bert")
    with pytest.warns(UserWarning, match=r"16 of 96 tokens equal pad_token_id=0.*masked out"):
        cal = load_calibration(str(only_ids), batch_size=4, model=bert)
    assert cal.names == ("input_ids", "attention_mask") and torch.equal(cal.batches[0][1], mask[:4])
    with pytest.warns(UserWarning, match="pad_token_id=0"):
        derived = run_quantize(f"{models_py}:bert", str(only_ids), "int8", "max", 99.99, 8, 4, None, None)
    explicit = run_quantize(f"{models_py}:bert", str(_forms(tmp_path)["dict"]), "int8", "max", 99.99, 8, 4, None, None)
    assert _amax(derived) == _amax(explicit)
    with warnings.catch_warnings():  # GPT-2 names no pad token: its own default, every token attended, no warning
        warnings.simplefilter("error", UserWarning)
        cal = load_calibration(str(only_ids), batch_size=4, model=_load_factory(models_py, "gpt2"))
    assert cal.names == ("input_ids",)


class _Obj:
    pass


BAD = {
    "a string": ("hello", "holds a str"),
    "an empty list": ([], "holds an empty list"),
    "mixed batches": ([torch.zeros(2, 3), {"input_ids": torch.zeros(2, 3)}], "holds a list of 2 (Tensor, dict)"),
    "dict of non-tensors": ({"input_ids": [1, 2, 3]}, "holds a dict with keys ['input_ids'] (values: list)"),
    "no samples": (torch.zeros(0, 12, dtype=torch.long), "no samples along dim 0"),
    "ragged dict": ({"input_ids": torch.zeros(8, 12), "attention_mask": torch.zeros(6, 12)}, "different numbers of samples"),
    "dicts with other keys": ([{"input_ids": torch.zeros(2, 3)}, {"attention_mask": torch.zeros(2, 3)}], "batch 1 has inputs"),
    "labels included": ([(torch.zeros(4, 12, dtype=torch.long),) * 3], "holds 3 tensors but the model's forward takes 2 input(s)"),
    "unknown input name": ({"input_ids": torch.zeros(4, 12, dtype=torch.long), "mask": torch.zeros(4, 12)}, "takes no ['mask']"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_are_one_line_errors_naming_file_found_and_format(case: str, tmp_path: Path, models_py: Path) -> None:
    data, found = BAD[case]
    path = tmp_path / "bad.pt"
    torch.save(data, path)
    with pytest.raises(UsageError) as info:
        load_calibration(str(path), "--calib-data", model=_load_factory(models_py, "tok"))
    msg = str(info.value)
    assert str(path) in msg and found in msg, msg
    assert "\n" not in msg
    if case in ("a string", "an empty list", "mixed batches", "dict of non-tensors", "no samples", "labels included"):
        assert "a dict of name -> tensor" in msg, msg  # the expected format, spelled out
    for verb in (["quantize", "--model", f"{models_py}:tok", "--calib-data", str(path)],
                 ["build", "--model", f"{models_py}:tok", "--shapes", "input_ids:4x12,attention_mask:4x12",
                  "--precision", "int8", "--calib", str(path), "--save-engine", str(tmp_path / "e.engine")]):
        code, err = _run(verb)
        assert code == 2 and str(path) in err and len(err.strip().splitlines()) == 1, (verb[0], err)


def test_one_named_input_for_a_two_input_model_is_refused(tmp_path: Path, models_py: Path) -> None:
    path = tmp_path / "one.pt"
    torch.save({"ids": torch.zeros(4, 12, dtype=torch.long)}, path)  # Tok takes input_ids and attention_mask
    with pytest.raises(UsageError, match=r"one.pt' holds one input \['ids'\] but Tok.forward takes 2 .*input_ids"):
        load_calibration(str(path), "--calib-data", model=_load_factory(models_py, "tok"))
    code, err = _run(["quantize", "--model", f"{models_py}:tok", "--calib-data", str(path)])
    assert code == 2 and "holds one input ['ids']" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("case, data, found", [
    ("shape", [(torch.zeros(4, 12, 3, dtype=torch.long), torch.ones(4, 12))], "input_ids (4, 12, 3) int64"),
    ("dtype", [(torch.zeros(4, 12), torch.ones(4, 12))], "input_ids (4, 12) float32"),
])
def test_batches_the_model_cannot_run_name_file_batch_and_shapes(case: str, data: list, found: str, tmp_path: Path,
                                                                 models_py: Path) -> None:
    path = tmp_path / f"{case}.pt"
    torch.save(data, path)
    code, err = _run(["quantize", "--model", f"{models_py}:tok", "--calib-data", str(path)])
    assert code == 2 and len(err.strip().splitlines()) == 1, err  # a usage error, not a traceback or exit 1
    assert f"Tok fails on calibration batch 0 of '{path}'" in err and found in err, err


@pytest.mark.parametrize("kind, found", [
    ("state_dict", "holds the weights of a model (a state_dict: fc.weight, fc.bias)"),
    ("checkpoint", "holds a training checkpoint (keys ['model', 'optimizer', 'epoch'])"),
])
def test_weights_given_as_calibration_data_are_named_as_weights(kind: str, found: str, tmp_path: Path,
                                                                models_py: Path) -> None:
    """The --checkpoint file given as --calib-data / --calib: a state_dict was read as inputs named 'fc.weight',
    refused for their "different numbers of samples"; a Trainer-style checkpoint as an odd dict."""
    sd = {"fc.weight": torch.zeros(16, 32), "fc.bias": torch.zeros(16)}
    path = tmp_path / f"{kind}.pt"
    torch.save(sd if kind == "state_dict" else {"model": sd, "optimizer": {"state": {}}, "epoch": 3}, path)
    with pytest.raises(UsageError) as info:
        load_calibration(str(path), "--calib-data", model=_load_factory(models_py, "tok"))
    msg = str(info.value)
    assert found in msg and "weights go to --checkpoint" in msg and "a dict of name -> tensor" in msg, msg
    for verb in (["quantize", "--model", f"{models_py}:tok", "--calib-data", str(path)],
                 ["build", "--model", f"{models_py}:tok", "--shapes", "input_ids:4x12,attention_mask:4x12",
                  "--precision", "int8", "--calib", str(path), "--save-engine", str(tmp_path / "e.engine")]):
        code, err = _run(verb)
        assert code == 2 and found in err and len(err.strip().splitlines()) == 1, (verb[0], err)
    assert not (tmp_path / "e.engine").exists()


def test_input_names_that_are_no_weights_still_load(tmp_path: Path) -> None:
    """ONNX input names carry dots too (``input.1``): only keys that end like a layer's parameters are weights."""
    path = tmp_path / "onnx_names.pt"
    torch.save({"input.1": torch.zeros(4, 3), "mask.weight": torch.ones(4, 3), "x": torch.ones(4, 3)}, path)
    cal = load_calibration(str(path), batch_size=2)
    assert cal.names == ("input.1", "mask.weight", "x") and len(cal) == 2


def test_a_model_or_engine_given_as_calibration_data_is_named(tmp_path: Path) -> None:
    """``--calib-data model.onnx`` or ``x.engine`` said "is not a tensor file overdrive can read safely
    (UnpicklingError)": the file is a model, and calibration data is the model's sample inputs."""
    import onnx
    from onnx import TensorProto, helper

    from overdrive.engine.format import MAGIC

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    (tmp_path / "m.engine").write_bytes(MAGIC + b"\0" * 32)
    torch.jit.save(torch.jit.script(torch.nn.ReLU()), str(tmp_path / "ts.pt"))
    for name, what in (("m.onnx", "an ONNX model"), ("m.engine", "an overdrive engine"),
                       ("ts.pt", "a TorchScript module")):
        with pytest.raises(UsageError, match=rf"--calib-data '.*{name}' is {what}.*not calibration data: --calib-data "
                                             r"takes the model's sample inputs; save the model's inputs"):
            load_calibration(str(tmp_path / name), "--calib-data")
