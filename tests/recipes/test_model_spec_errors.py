"""--model / --checkpoint errors name the flag, the value and what is wrong: a state_dict that does not fit used to
print only torch's first line ("Error(s) in loading state_dict for Sequential:"), a corrupt file torch's
"unpack requires a buffer of 4 bytes" with no flag or file, and a factory that raises its message without the spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.recipes.model_spec import load_checkpoint, load_model


def test_a_state_dict_that_does_not_fit_names_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save({"bad": torch.zeros(1)}, path)
    with pytest.raises(UsageError, match=r'--checkpoint .*bad.pt does not fit the model: Missing key\(s\).*"0.weight".*'
                                         r'Unexpected key\(s\).*"bad"'):
        load_checkpoint(nn.Sequential(nn.Linear(4, 4)), path)


def test_a_corrupt_file_names_the_flag_and_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(b"junk\n")
    with pytest.raises(UsageError, match=r"--checkpoint '.*junk.pt' cannot be read as weights"):
        load_checkpoint(nn.Linear(4, 4), path)


def test_a_factory_that_raises_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "boomfactory.py").write_text("def boom():\n    raise RuntimeError('factory exploded')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"--model 'boomfactory.py:boom': boom\(\) raised RuntimeError: factory exploded"):
        load_model("boomfactory.py:boom")


MODELS_PY = """
from torch import nn


def make_mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
"""


def test_a_misspelled_factory_is_answered_with_the_close_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``models.py:make_mpl`` said only "has no callable 'make_mpl'"; an unrelated name now lists what the file defines."""
    (tmp_path / "models.py").write_text(MODELS_PY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"'models.py' has no 'make_mpl'; did you mean 'make_mlp'\?$"):
        load_model("models.py:make_mpl")
    with pytest.raises(UsageError, match=r"has no 'resnet'; the callables 'models.py' defines are: make_cnn, make_mlp$"):
        load_model("models.py:resnet")
    with pytest.raises(UsageError, match=r"models.py's 'nn' is a module, not callable"):
        load_model("models.py:nn")
    with pytest.raises(UsageError, match=r"'torch.nn' has no 'Linnear'; did you mean 'Linear'\?"):
        load_model("torch.nn:Linnear(4, 2)")


def test_misspelled_files_and_modules_are_answered_with_the_close_ones(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models.py").write_text(MODELS_PY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"file 'modles.py' does not exist; .*did you mean 'models.py'\?"):
        load_model("modles.py:make_mlp")
    with pytest.raises(UsageError, match=r"cannot import 'model' .*did you mean 'models'\?"):
        load_model("model:make_mlp")
    with pytest.raises(UsageError, match=r"cannot import 'torch.nn.modules.liner' .*did you mean "
                                         r"'torch.nn.modules.linear'\?"):
        load_model("torch.nn.modules.liner:Linear")
    with pytest.raises(UsageError, match=r"did you mean 'torch.nn.modules'\?"):  # the part that failed, the rest kept
        load_model("torch.nnn.modules:Linear")


def test_a_dependency_the_model_file_imports_is_named_as_missing(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A model file importing a package that is not installed was answered "check the module path", which sent the
    user to fix a spec that was right."""
    (tmp_path / "needs_dep.py").write_text("import no_such_package_here\n\ndef make():\n    pass\n")
    (tmp_path / "bad_name.py").write_text("from torch import no_such_name_here\n\ndef make():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    for spec in ("needs_dep.py:make", "needs_dep:make"):
        with pytest.raises(UsageError, match=r"imports 'no_such_package_here', which this Python .* does not have; "
                                             "install the package") as info:
            load_model(spec)
        assert "module path" not in str(info.value)
    with pytest.raises(UsageError, match=r"importing 'bad_name.py' failed \(cannot import name 'no_such_name_here'"):
        load_model("bad_name.py:make")


def test_close_names() -> None:
    from overdrive._utils.errors import close_names, did_you_mean

    assert close_names("make_mpl", ["make_mlp", "make_cnn", "Net"]) == ["make_mlp"]
    assert close_names("fp61", ["fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best"]) == ["fp16"]
    assert close_names("FP16", ["fp16", "fp32"]) == ["fp16"]
    assert close_names("zzz", ["make_mlp"]) == []
    assert did_you_mean("zzz", ["b", "a"], what="choices") == "; the choices are: a, b"
    assert did_you_mean("zzz", ["b", "a"], list_up_to=1) == ""


def test_a_misspelled_alias_gets_the_close_one() -> None:
    """``--model digts`` listed the aliases but did not say which one was meant."""
    with pytest.raises(UsageError, match=r"--model 'digts' must be .*; did you mean 'digits'\?"):
        load_model("digts")


def test_a_model_file_given_as_a_factory_is_named_with_the_flag_that_takes_it(tmp_path: Path) -> None:
    """``--model mlp.onnx`` read as a malformed factory spec ("must be 'package.module:factory' ..."): it is an ONNX
    file, which ``build --onnx`` takes; a TorchScript file goes to --torchscript, an engine to exec."""
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "mlp.onnx"))
    with pytest.raises(UsageError, match=r"--model '.*mlp.onnx' is an ONNX model, not a PyTorch model factory .*"
                                         r"overdrive build --onnx .*mlp.onnx"):
        load_model(str(tmp_path / "mlp.onnx"))
    torch.jit.save(torch.jit.script(nn.ReLU()), str(tmp_path / "relu.pt"))
    with pytest.raises(UsageError, match=r"is a TorchScript module .*overdrive build --torchscript"):
        load_model(str(tmp_path / "relu.pt"))


def test_a_python_file_without_a_factory_names_the_ones_it_defines(tmp_path: Path) -> None:
    """``--model models.py`` (the factory forgotten) said only the spec's syntax; the file's top-level functions and
    classes are read from its syntax tree (nothing run) and offered as specs."""
    (tmp_path / "models.py").write_text("raise SystemExit('imported')\ndef make_mlp():\n    pass\nclass Net:\n    pass\n")
    spec = str(tmp_path / "models.py")
    with pytest.raises(UsageError, match=rf"name the factory in .*models.py: '{spec}:make_mlp', '{spec}:Net'"):
        load_model(spec)
