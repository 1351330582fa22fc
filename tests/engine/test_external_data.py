"""ONNX external data: an engine's ONNX section never points at files (build embeds the weights), and
loading one that does is refused; before, ONNX Runtime read the named file from the current folder into the
weights (a secret came back in the outputs). Building from a model path reads its external data from the
model's folder, not the current one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import helper, numpy_helper  # noqa: E402

from overdrive._utils.errors import UsageError  # noqa: E402
from overdrive.engine import Builder, Engine  # noqa: E402
from overdrive.engine import format as fmt  # noqa: E402


def _model(weight: np.ndarray) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])
    w = numpy_helper.from_array(weight, "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_engine_with_external_data_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = Builder(precision="fp32", device="cpu", backend="onnxruntime").build(_model(np.zeros((2, 4), np.float32)))
    path = tmp_path / "m.engine"
    eng.save(path)
    ef = fmt.read(path)
    proto = onnx.load_from_string(ef.sections["onnx"])
    t = proto.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value="secret.bin")
    ef.sections["onnx"] = proto.SerializeToString()
    ef.save(path)  # checksums recomputed: what anyone who edits the file can do
    (tmp_path / "secret.bin").write_bytes(np.arange(8, dtype=np.float32).tobytes())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="points at external data"):
        Engine.load(path)


def test_build_from_a_path_reads_external_data_from_the_model_folder(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    weight = np.full((2, 4), 3.0, np.float32)
    onnx.save_model(_model(weight), str(folder / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    eng = Builder(precision="fp32", device="cpu", backend="onnxruntime").build(str(folder / "m.onnx"))
    assert torch.equal(eng(torch.zeros(2, 4)), torch.full((2, 4), 3.0))
    with pytest.raises(UsageError, match="pass the model's path"):
        Builder(precision="fp32", device="cpu").build((folder / "m.onnx").read_bytes())
