"""The demo as a whole: no stage ends it (a diverged level is a row, a broken stage a 'failed' table), the
summary line and exit code, early refusal of bad flags, the workloads, and the CPU feature detection."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("sklearn")


def test_cpu_features_read_from_cpuinfo() -> None:
    """torch's ISA string says 'AVX512' for CPUs with and without AVX512-BF16/AMX: read the flags."""
    from overdrive._utils.device import cpu_features, cpu_summary

    text = "processor : 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    f = cpu_features(text)
    assert f["amx_bf16"] and f["amx_int8"] and f["avx512_bf16"] and f["avx512_vnni"] and not f["avx_vnni"]
    assert cpu_summary(f) == "bf16: AMX-BF16, AVX512-BF16; int8: AMX-INT8, AVX512-VNNI"
    assert "none native" in cpu_summary(cpu_features("flags : fpu sse2 avx2\n"))
    assert not any(cpu_features("").values())


def test_a_broken_stage_does_not_end_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive import demo
    from overdrive.demo import data_stage, quant_stage, sparsity_stage

    def boom(ctx):  # noqa: ANN001
        raise RuntimeError("simulated breakage")

    def skip(ctx):  # noqa: ANN001
        raise demo.StageSkipped("no GPU for this stage")

    monkeypatch.setattr(quant_stage, "run", boom)
    monkeypatch.setattr(data_stage, "run", skip)
    # a stage after the broken one that runs (a stand-in: its own tests run the real one)
    monkeypatch.setattr(sparsity_stage, "run", lambda ctx: demo.Table("2:4", ["run"], [["dense"]]))
    tables = demo.run_demo(device="cpu", opt_levels=("O0",), epochs=1, stages=["amp", "quant", "sparsity", "data"],
                           progress=False, quick=True)
    status = {t.stage: t.status for t in tables}
    assert status == {"amp": "ok", "quant": "failed", "sparsity": "ok", "data": "skipped"}
    failed = next(t for t in tables if t.stage == "quant")
    assert "RuntimeError: simulated breakage" in failed.rows[0][2]
    line, any_failed = demo.summary(tables)
    assert any_failed and line == "demo: 2 of 4 stage(s) ran; failed: quant; skipped: data"


def test_diverged_level_is_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """O3 without loss scaling may diverge (fp16 on a GPU): its row says so and the stage goes on."""
    from overdrive._utils.errors import OverdriveError
    from overdrive.demo import amp_stage
    from overdrive.demo.context import DemoContext
    from overdrive.recipes.data import load_digits
    from overdrive.train import Trainer

    real_fit = Trainer.fit

    def fit(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        if self.mp.policy.opt_level == "O3":
            self.epoch = 2
            raise OverdriveError("training diverged: mean loss nan in epoch 2; lower the learning rate")
        return real_fit(self, *a, **kw)

    monkeypatch.setattr(Trainer, "fit", fit)
    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), epochs=1,
                      progress=False, opt_levels=("O0", "O3"))
    table = amp_stage.run(ctx)
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    assert rows["O3"]["note"] == "diverged in epoch 2: O3 has no loss scaling" and rows["O3"]["test accuracy"] is None
    assert rows["O0"]["test accuracy"] > 0.15 and ctx.fp32_model is not None  # chance: 0.1
    lo, hi = (float(v.replace(",", "")) for v in rows["O0"]["epochs min-max"].split("-"))  # the spread beside samples/s
    assert 0 < lo <= rows["O0"]["samples/s"] + 0.5 and hi >= lo  # printed as whole samples/s: rounding moves it 0.5
    assert math.isnan(table.curves["O3"][-1]) and len(table.curves["O0"]) == 1


def test_cli_demo_quick_json_and_exit_code(tmp_path) -> None:
    from overdrive.cli.main import cli

    out = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["demo", "--quick", "--device", "cpu", "--stage", "amp", "--opt-level", "O0",
                                   "--epochs", "1", "--no-progress", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "demo: 1 of 1 stage(s) ran" in res.output.strip().splitlines()[-1]
    data = json.loads(out.read_text())
    assert data["workload"] == "quick" and "bf16:" in data["cpu_features"] and data["tables"][0]["stage"] == "amp"


@pytest.mark.parametrize("args,msg", [
    (["--dtype", "fp16", "--device", "cpu"], "--dtype fp16 on the CPU"),
    (["--report", "/nonexistent-dir/sub/rep"], "parent folder does not exist"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["--stage", "nope"], "unknown demo stage"),
])
def test_cli_demo_refuses_bad_flags_before_work(args: list[str], msg: str) -> None:
    from overdrive.cli.main import main

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["demo", "--quick", "--no-progress", *args])
    assert code == 2 and msg in err.getvalue()


def test_workloads() -> None:
    from overdrive.demo.workloads import DeviceBatches, choose_workload

    quick = choose_workload(torch.device("cpu"), quick=True)
    cpu = choose_workload(torch.device("cpu"), quick=False)
    gpu = choose_workload(torch.device("cuda"), quick=False)
    assert (quick.image_size, cpu.image_size, gpu.image_size) == (8, 32, 224)
    assert gpu.make_model()(torch.randn(2, 1, 224, 224)).shape == (2, 10)
    assert cpu.make_model()(torch.randn(2, *cpu.input_shape)).shape == (2, 10)
    b = DeviceBatches(torch.arange(10.0).view(10, 1), torch.arange(10), batch_size=3, seed=0)
    seen = torch.cat([y for _, y in b])
    assert len(b) == 3 and len(seen) == 9 and len(set(seen.tolist())) == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_demo_on_gpu_every_stage(tmp_path) -> None:
    """The --quick demo on one GPU finishes every stage: O3 fp16 may diverge (a row), the int8 and fp8
    engines build on CUDA, the distributed stage runs with one GPU."""
    from overdrive.demo import run_demo, summary

    tables = run_demo(device="cuda", epochs=2, progress=False, quick=True)
    line, failed = summary(tables)
    assert not failed and "skipped" not in line, [(t.stage, t.rows) for t in tables if t.status != "ok"]
    engine = next(t for t in tables if t.stage == "engine")
    built = {r[0]: r[5] for r in engine.rows if r[0].startswith("engine")}
    assert set(built) >= {"engine fp16", "engine int8"} and all(v == "PASSED" for v in built.values()), engine.rows
    if torch.cuda.get_device_capability() >= (8, 9):
        assert "engine fp8" in built


def test_data_stage_keeps_its_training_rows_when_the_loading_comparison_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that times out in the loading comparison (forked DataLoader workers hung for good on the H200)
    marks the stage failed with the error in a row; the PNG training rows above it stay."""
    from overdrive import demo
    from overdrive.demo import data_stage

    def hung(ctx, table):  # noqa: ANN001
        raise RuntimeError("DataLoader timed out after 120 seconds")

    monkeypatch.setattr(data_stage, "speed_rows", hung)
    monkeypatch.setattr(data_stage, "tokenize_table", lambda ctx: data_stage.Table("tokens", ["run"], stage="data"))
    table, _ = demo.run_demo(device="cpu", epochs=1, stages=["data"], progress=False)
    assert table.status == "failed"
    assert table.rows[1][0].startswith("PNG folder via ImageLoader") and 0.0 <= table.rows[1][1] <= 1.0
    assert "not measured (RuntimeError: DataLoader timed out" in table.rows[-1][0]
    assert demo.summary([table]) == ("demo: 0 of 1 stage(s) ran; failed: data", True)


def test_demo_baseline_loader_starts_workers_as_overdrive_does(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The DataLoader the demo times ImageLoader against: forkserver workers once CUDA is initialized (forked
    from the CUDA process they hung the H200 demo), a timeout instead of a hang, and the images it promises."""
    from PIL import Image

    from overdrive.demo.data_stage import baseline_loader

    files = []
    for i in range(4):
        f = tmp_path / str(i % 2) / f"{i}.jpg"
        f.parent.mkdir(exist_ok=True)
        Image.new("RGB", (12, 10), (40 * i, 20, 200)).save(f)
        files.append(f)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    dl = baseline_loader(files, 8, 2, seed=0, workers=2)
    assert dl.multiprocessing_context.get_start_method() == "forkserver" and dl.timeout == 120
    batches = list(dl)
    assert [tuple(x.shape) for x, _ in batches] == [(2, 3, 8, 8)] * 2
    assert sorted(int(v) for _, y in batches for v in y) == [0, 0, 1, 1]


def test_o0_alone_trains_no_hand_written_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--stage engine` trains the fp32 model first (amp at O0 only, its note says); it also trained the hand-written
    autocast loop and an O2 + channels_last run, which O0 alone is not compared with."""
    from overdrive.demo import amp_stage
    from overdrive.demo.context import DemoContext
    from overdrive.demo.workloads import Workload
    from overdrive.recipes.data import load_digits

    trained: list[str] = []

    def fake_train(ctx, level, compile=False, channels_last=False):  # noqa: ANN001, ANN202
        trained.append(level + (" channels_last" if channels_last else ""))
        return _fake_result(ctx)

    def fake_hand(ctx, compile):  # noqa: ANN001, ANN202
        trained.append("hand-written")
        return {"curve": [1.0], "accuracy": 0.5, "final_loss": 1.0, "samples_per_s": 100.0, "epoch_rates": [100.0]}

    monkeypatch.setattr(amp_stage, "train_digits", fake_train)
    monkeypatch.setattr(amp_stage, "handwritten", fake_hand)
    small = Workload("ResNet (width 16)", 32, 64, 128, 1, width=16, depths=(1, 1, 1, 1), stem="small")
    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), epochs=1,
                      progress=False, opt_levels=("O0",), workload=small)
    table = amp_stage.run(ctx)
    assert trained == ["O0"], trained
    assert [r[0] for r in table.rows] == ["O0"]


def _fake_result(ctx):  # noqa: ANN001, ANN202
    from types import SimpleNamespace

    epoch = SimpleNamespace(eval_accuracy=0.5, samples_per_s=100.0, skipped_steps=0)
    result = SimpleNamespace(diverged=None, history=[epoch], final_loss=1.0, samples_per_s=100.0, peak_memory_mib=None,
                             curve=[1.0])
    return torch.nn.Linear(1, 1), None, result
