"""exec's summary says what was measured: no H2D/D2H or GPU time on CPU (n/a and CPU wording, not "0 ms"
and "GPU Compute Time"), and --use-cuda-graph is refused where there are no CUDA graphs instead of ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine.benchmark import check_cuda_graph, format_summary


def _summary(device: str, no_data_transfers: bool = False) -> dict:
    st = {"min": 1.0, "max": 2.0, "mean": 1.5, "median": 1.5, "p90": 2.0}
    return {"throughput_qps": 10.0, "throughput_samples_s": 10.0, "batch": 1, "total_host_walltime_s": 1.0,
            "total_gpu_compute_time_s": 0.5, "iterations": 10, "backend": "inductor", "precision": "fp32",
            "device": device, "no_data_transfers": no_data_transfers,
            **{f"{k}_ms": st for k in ("latency", "enqueue", "h2d", "compute", "d2h")}}


def test_cpu_summary_names_nothing_it_did_not_measure() -> None:
    text = format_summary(_summary("cpu"))
    assert "GPU" not in text
    assert "[I] H2D Latency: n/a" in text and "[I] D2H Latency: n/a" in text
    assert "Compute Time (host wall time, CPU): min = 1 ms" in text
    assert "Total Compute Time (CPU): 0.5 s" in text


def test_cuda_summary_keeps_trtexecs_layout() -> None:
    text = format_summary(_summary("cuda:0"))
    assert "[I] H2D Latency: min = 1 ms" in text and "[I] GPU Compute Time: min" in text
    assert "Total GPU Compute Time: 0.5 s" in text
    skipped = format_summary(_summary("cuda:0", no_data_transfers=True))
    assert "[I] H2D Latency: skipped (--no-data-transfers)" in skipped


@pytest.mark.parametrize("device,backend", [("cpu", "inductor"), ("cpu", "onnxruntime"), ("cuda", "onnxruntime")])
def test_use_cuda_graph_is_refused_where_there_are_none(device: str, backend: str) -> None:
    with pytest.raises(UsageError, match="--use-cuda-graph"):
        check_cuda_graph(device, backend)
    check_cuda_graph("cuda", "inductor")  # the one place they exist: accepted


def test_exec_use_cuda_graph_on_a_cpu_engine_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto as T, helper as h

    m = h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
                                  [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                                  [h.make_tensor_value_info("y", T.FLOAT, [2, 3])]),
                     opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    (tmp_path / "m.onnx").write_bytes(m.SerializeToString())
    engine = tmp_path / "m.engine"
    assert main(["build", "--onnx", str(tmp_path / "m.onnx"), "--save-engine", str(engine)]) == 0
    capsys.readouterr()
    assert main(["exec", "--load-engine", str(engine), "--use-cuda-graph", "--duration", "0"]) == 2
    assert "CUDA graphs exist on CUDA devices only" in capsys.readouterr().err
    assert main(["exec", "--load-engine", str(engine), "--duration", "0", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "H2D Latency: n/a" in out and "Total GPU Compute Time" not in out
