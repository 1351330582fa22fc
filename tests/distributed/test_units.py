"""Single-process checks: configs, sampler, doctor findings, bandwidth formulas, CLI and errors."""

from __future__ import annotations

import gc
import json
import socket

import pytest
import torch
from click.testing import CliRunner

from overdrive import UsageError
from overdrive._utils.errors import OverdriveError
from overdrive.amp import Policy
from overdrive.distributed import PRESETS, LaunchConfig, Parallel, ResumableSampler, Strategy, fsdp_mixed_precision
from overdrive.distributed import bandwidth, doctor
from overdrive.distributed.launch import build_command, launch, preflight


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_strategy_presets_json_round_trip(name: str) -> None:
    s = PRESETS[name]
    assert Strategy.from_json(s.to_json()) == s
    assert Strategy.from_name(name) is s


@pytest.mark.parametrize("kwargs", [{"kind": "zero3"}, {"bucket_cap_mb": 0}, {"static_graph": True, "find_unused_parameters": True}])
def test_strategy_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        Strategy(**kwargs)


def test_strategy_unknown_name_and_field() -> None:
    with pytest.raises(UsageError, match="ddp"):
        Strategy.from_name("deepspeed")
    with pytest.raises(UsageError, match="bucket"):
        Strategy.from_dict({"buckets": 3})


def test_launch_config_builds_torchrun_flags() -> None:
    assert "--standalone" in LaunchConfig(nproc_per_node=2).torchrun_args()
    static = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234, nproc_per_node=8).torchrun_args()
    assert static[static.index("--master-addr") + 1] == "10.0.0.1" and static[static.index("--node-rank") + 1] == "1"
    elastic = LaunchConfig(nnodes=2, rdzv_endpoint="h:29400", max_restarts=3).torchrun_args()
    assert elastic[elastic.index("--rdzv-backend") + 1] == "c10d" and elastic[elastic.index("--max-restarts") + 1] == "3"
    cmd = build_command(LaunchConfig(), "train.py", ["--lr", "1"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-3:] == ["train.py", "--lr", "1"]


@pytest.mark.parametrize("kwargs", [{"nnodes": 0}, {"nproc_per_node": 0}, {"nproc_per_node": "many"}, {"node_rank": 2, "nnodes": 2, "master_addr": "a"},
                                    {"master_port": 70000}, {"max_restarts": -1}, {"nnodes": 2}, {"rdzv_endpoint": "nohostport"},
                                    # both ways to meet: torchrun's rendezvous dropped --master-addr, silently
                                    {"nnodes": 2, "rdzv_endpoint": "h:29400", "master_addr": "127.0.0.1"}])
def test_launch_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        LaunchConfig(**kwargs)


def test_sampler_covers_each_epoch_once_and_resumes_on_other_world_size() -> None:
    two = [ResumableSampler(20, batch_size=2, rank=r, world_size=2, seed=3) for r in range(2)]
    seen = sorted(i for s in two for i in s)
    assert len(seen) == 20 and len(set(seen)) == 20  # 20 = 5 global batches of 4
    order = list(torch.randperm(20, generator=torch.Generator().manual_seed(3)))
    two[0].advance(2)  # 8 global samples consumed with 2 ranks ...
    one = ResumableSampler(20, batch_size=4, rank=0, world_size=1, seed=3)
    one.load_state_dict(two[0].state_dict())  # ... resume on 1 rank at the same place
    assert list(one) == [int(i) for i in order[8:]]
    with pytest.raises(UsageError):
        ResumableSampler(20, batch_size=3, world_size=1).load_state_dict(two[0].state_dict())  # 8 % 3 != 0
    with pytest.raises(UsageError):
        ResumableSampler(10, batch_size=2, rank=2, world_size=2)


def test_busbw_factors_match_nccl_tests() -> None:
    assert bandwidth.BUS_FACTOR["all_reduce"](8) == pytest.approx(2 * 7 / 8)
    assert bandwidth.BUS_FACTOR["all_gather"](8) == pytest.approx(7 / 8)
    assert bandwidth.BUS_FACTOR["reduce_scatter"](4) == pytest.approx(3 / 4)
    assert bandwidth.sizes_pow2(8 * 1024, 4 * 2**30)[-1] == 4 * 2**30 and len(bandwidth.sizes_pow2(8 * 1024, 4 * 2**30)) == 20
    with pytest.raises(UsageError):
        bandwidth.sizes_pow2(10, 5)
    with pytest.raises(UsageError, match="process group"):
        bandwidth.measure()


def test_doctor_flags_missing_socket_ifname_and_debug_left_on() -> None:
    ifaces = [{"name": "lo", "state": "unknown", "ipv4": "127.0.0.1"}, {"name": "eth0", "state": "up", "ipv4": None},
              {"name": "ib0", "state": "down", "ipv4": None}]
    _, findings = doctor.env_findings({"NCCL_SOCKET_IFNAME": "eth7", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1",
                                       "NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}, ifaces)
    by = {(f.level, f.what) for f in findings}
    assert ("error", "NCCL_SOCKET_IFNAME") in by
    assert {("warning", "NCCL_DEBUG"), ("warning", "NCCL_IB_DISABLE"), ("warning", "NCCL_P2P_DISABLE")} <= by
    assert not any(f.what == "NCCL_NVLS_ENABLE" for f in findings)  # reported, not judged
    assert doctor.check_socket_ifname("eth", ifaces) == []  # prefix match
    assert doctor.check_socket_ifname("=ib0", ifaces)[0].detail.endswith("ib0")  # down
    assert doctor.check_socket_ifname("^docker", ifaces) == []


def test_doctor_flags_unreachable_and_busy_master_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        # Bound but not listening: nothing accepts, so a worker node cannot reach it ...
        assert doctor.check_master("127.0.0.1", port, node_rank=1, timeout=2)[0].level == "error"
        # ... and the master node cannot bind it.
        assert doctor.check_master("127.0.0.1", port, node_rank=0)[0].level == "error"
        s.listen()
        assert doctor.check_master("127.0.0.1", port, node_rank=1)[0].level == "info"
    assert doctor.check_master("no-such-host.invalid", 1)[0].what == "MASTER_ADDR"


def test_doctor_report_and_cli_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nonexistent0")
    from overdrive.cli.doctor import command

    r = CliRunner().invoke(command, ["--json"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.output)
    assert rep["versions"]["torch"] == torch.__version__
    assert any(e["name"] == "NCCL_SOCKET_IFNAME" for e in rep["env"])
    assert doctor.errors(rep) and "nonexistent0" in doctor.errors(rep)[0]
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert CliRunner().invoke(command, ["--json"]).exit_code == 0


def test_launch_preflight_stops_on_fault(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import overdrive.distributed.launch as lmod

    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(lmod, "_gpus_for_ranks", lambda env: 1)  # GPU ranks: they read NCCL_SOCKET_IFNAME
    with pytest.raises(OverdriveError, match="NCCL_SOCKET_IFNAME"):
        launch(LaunchConfig(nproc_per_node=1), str(script), env={"NCCL_SOCKET_IFNAME": "nope9", "PATH": "/usr/bin"})
    monkeypatch.undo()
    with pytest.raises(OverdriveError, match="nothing listens"):
        preflight(LaunchConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=_closed_port()), env={},
                  master_wait_s=0)
    with pytest.raises(UsageError, match="does not exist"):
        launch(LaunchConfig(), str(tmp_path / "missing.py"))


def test_a_wrong_nccl_interface_does_not_stop_cpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks without a GPU join with gloo, which does not read NCCL_SOCKET_IFNAME: a wrong value there (set for the
    GPU cluster, say) warns and lets a CPU launch go on; it used to stop it. GLOO_SOCKET_IFNAME still stops it."""
    import overdrive.distributed.launch as lmod

    monkeypatch.setattr(lmod, "_gpus_for_ranks", lambda env: 0)
    with pytest.warns(RuntimeWarning, match="NCCL_SOCKET_IFNAME: 'nope9' matches no interface.*join with gloo"):
        report = preflight(LaunchConfig(nproc_per_node=2), env={"NCCL_SOCKET_IFNAME": "nope9"})
    assert [(f["level"], f["what"]) for f in report["findings"] if f["what"] == "NCCL_SOCKET_IFNAME"] == \
        [("warning", "NCCL_SOCKET_IFNAME")]
    with pytest.raises(OverdriveError, match="GLOO_SOCKET_IFNAME"):
        preflight(LaunchConfig(nproc_per_node=2), env={"GLOO_SOCKET_IFNAME": "nope9"})


def test_launch_timeout_kills_every_rank(tmp_path) -> None:
    """A job past timeout_s is killed with its ranks (a hung gloo shutdown once held the test suite)."""
    import os

    script = tmp_path / "hang.py"
    pidfile = tmp_path / "pid"
    script.write_text(f"import os, threading\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                      "threading.Event().wait()\n")
    with pytest.raises(OverdriveError, match="ran past timeout_s=8 s"):
        launch(LaunchConfig(nproc_per_node=1), str(script), check=False, timeout_s=8)
    if pidfile.exists():  # the rank had started: it must be gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(pidfile.read_text()), 0)
    from overdrive.cli.main import main

    # the CLI: one line, exit 1 (whether or not the rank started by then: the kill is checked above)
    assert main(["launch", "--no-check", "--timeout", "2", str(script)]) == 1
    with pytest.raises(UsageError, match="timeout_s=0"):
        launch(LaunchConfig(nproc_per_node=1), str(script), timeout_s=0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_policy_mapping() -> None:
    cpu = torch.device("cpu")
    mpp, rest = fsdp_mixed_precision(Policy(opt_level="O2", dtype=torch.bfloat16), cpu)
    assert (mpp.param_dtype, mpp.reduce_dtype, rest.opt_level) == (torch.bfloat16, torch.float32, "O0")
    mpp, rest = fsdp_mixed_precision(Policy(opt_level="O3", dtype=torch.bfloat16), cpu)
    assert mpp.reduce_dtype == torch.bfloat16
    mpp, rest = fsdp_mixed_precision(Policy(opt_level="O1", dtype=torch.bfloat16), cpu)
    assert mpp.param_dtype is None and rest.opt_level == "O1"
    with pytest.raises(UsageError, match="bfloat16"):
        fsdp_mixed_precision(Policy(opt_level="O2", dtype=torch.float16), cpu)


def test_strategy_without_process_group_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="init"):
        Parallel("ddp", torch.device("cpu"))


def test_strategy_none_is_the_plain_loop() -> None:
    from overdrive.train import Trainer

    def run(strategy: str | None) -> torch.Tensor:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), progress=False, strategy=strategy)
        t.train_step((torch.ones(8, 4), torch.zeros(8, dtype=torch.long)))
        return m.weight.detach().clone()

    assert torch.equal(run("none"), run(None))


def test_group_of_one_refuses_unsupported_combinations() -> None:
    import torch.distributed as dist

    from overdrive import distributed as odist
    from overdrive.train import Trainer

    odist.init(backend="gloo", device="cpu")
    try:
        fp16_o1 = Policy(opt_level="O1", dtype=torch.float16, loss_scale="dynamic")  # fp16 is a CUDA matter
        with pytest.raises(UsageError, match="accumulate"):
            Parallel("ddp", torch.device("cuda", 0), accumulate=2).after_amp(torch.nn.Linear(4, 3), fp16_o1)
        m = torch.nn.Linear(4, 3)
        with pytest.raises(UsageError, match="bfloat16"):
            Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), policy=Policy(opt_level="O2", dtype=torch.float16),
                    strategy="fsdp", progress=False)
        with pytest.raises(UsageError, match="matched no module"):
            seq = torch.nn.Sequential(torch.nn.Linear(4, 3))
            Trainer(seq, torch.optim.SGD(seq.parameters(), lr=0.1),
                    strategy=Strategy(kind="fsdp", fsdp_blocks=("Nope",)), progress=False)
    finally:
        gc.collect()  # what the refused Trainers made goes before the process group
        dist.destroy_process_group()


def test_fsdp_keeps_the_lr_scheduler_on_the_sharded_optimizer() -> None:
    """FSDP2 re-creates the parameters as shards: the optimizer is re-pointed at them in place, so the scheduler
    built on it still drives it (a re-created optimizer left the scheduler on the old one: the lr never changed)."""
    import torch.distributed as dist

    from overdrive import distributed as odist
    from overdrive.train import Trainer

    odist.init(backend="gloo", device="cpu")
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        t = Trainer(m, opt, strategy="fsdp", scheduler=sched, progress=False)
        assert t.optimizer is opt and all(hasattr(q, "full_tensor") for q in opt.param_groups[0]["params"])
        lrs = []
        for _ in range(5):
            t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
            lrs.append(t.optimizer.param_groups[0]["lr"])
        assert lrs == pytest.approx([g for g in _one_cycle(1e-2, 10)[1:6]])
        del t  # the sharded model goes before its process group
    finally:
        gc.collect()
        dist.destroy_process_group()


def _one_cycle(max_lr: float, steps: int) -> list[float]:
    """The lr OneCycleLR gives at each step, from a plain optimizer (the reference)."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=max_lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_preflight_counts_the_gpus_the_ranks_see(monkeypatch) -> None:
    """CPU ranks on a 1-GPU machine (CUDA_VISIBLE_DEVICES="" for the ranks) are not refused; GPU ranks
    beyond the visible GPUs still are (the demo's distributed stage on one GPU stopped here)."""
    import torch

    from overdrive.distributed.launch import _gpus_for_ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _gpus_for_ranks({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert _gpus_for_ranks({"CUDA_VISIBLE_DEVICES": "0,1"}) == 1
    assert _gpus_for_ranks({}) == 1
    with pytest.raises(OverdriveError, match="--nproc-per-node 2 but 1 GPU"):
        preflight(LaunchConfig(nproc_per_node=2), env={})
    from overdrive.distributed import doctor

    monkeypatch.setattr(doctor, "diagnose", lambda **kw: {"findings": []})  # its GPU probe needs a real GPU
    assert preflight(LaunchConfig(nproc_per_node=2), env={"CUDA_VISIBLE_DEVICES": ""}) == {"findings": []}


def test_leave_flushes_and_exits_with_the_code_without_teardown(tmp_path: Path) -> None:
    """leave(): output flushed, the exit code kept, and no teardown run (an atexit handler does not fire)."""
    import subprocess
    import sys

    code = ("import atexit, sys\nfrom overdrive.distributed import leave\n"
            "atexit.register(lambda: print('TEARDOWN'))\nprint('written', end='')\nsys.stderr.write('err')\nleave(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (3, "written", "err")


def test_bandwidth_warns_before_oversubscribing_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """``doctor --bandwidth 64`` on 2 cores: one warning naming the counts and the fix, before any rank starts."""
    import warnings

    import overdrive.data.config as data_config
    from overdrive.distributed import launch as launch_mod

    started: list[object] = []
    monkeypatch.setattr(data_config, "usable_cpus", lambda: 2)
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: started.append(a) or 1)
    with pytest.warns(UserWarning, match=r"--bandwidth 64 starts 64 CPU ranks on 2 usable core\(s\).*--bandwidth 2"):
        with pytest.raises(Exception):  # the stubbed launch "fails": only the order matters here
            launch_mod.bandwidth(64, backend="gloo")
    assert len(started) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(Exception):
            launch_mod.bandwidth(2, backend="gloo")  # one rank per core: no warning


def test_doctor_checks_gloo_socket_ifname() -> None:
    """GLOO_SOCKET_IFNAME, what CPU ranks read, was not checked: `overdrive launch` started the ranks and each died
    at init with gloo's "Unable to find address for: eth7" and a traceback."""
    ifaces = [{"name": "lo", "state": "unknown", "ipv4": "127.0.0.1"}, {"name": "eth0", "state": "up", "ipv4": None},
              {"name": "ib0", "state": "down", "ipv4": "10.0.0.2"}]
    rows, findings = doctor.env_findings({"GLOO_SOCKET_IFNAME": "eth7"}, ifaces)
    assert [r["name"] for r in rows] == ["GLOO_SOCKET_IFNAME"]
    assert [(f.level, f.what) for f in findings] == [("error", "GLOO_SOCKET_IFNAME")]
    assert "'eth7' is not an interface here (have: eth0, ib0, lo)" in findings[0].detail
    assert doctor.check_gloo_ifname("lo", ifaces) == []
    assert doctor.check_gloo_ifname("eth", ifaces)[0].level == "error"  # exact names: no prefix match as in NCCL
    assert doctor.check_gloo_ifname("lo,ib0", ifaces)[0].detail == "'ib0' is down; pick an interface that is up"
    assert doctor.check_gloo_ifname("eth0", ifaces)[0].level == "warning"  # no IPv4 address


def test_launch_preflight_stops_on_a_wrong_gloo_interface(tmp_path) -> None:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(OverdriveError, match=r"GLOO_SOCKET_IFNAME: 'nope9' is not an interface here"):
        launch(LaunchConfig(nproc_per_node=1), str(script), env={"GLOO_SOCKET_IFNAME": "nope9", "PATH": "/usr/bin"})
    report = doctor.diagnose(env={}, topology=False)
    if not report["gpus"]:
        assert any(f["what"] == "backend" and "gloo" in f["detail"] for f in report["findings"])


def test_doctor_text_names_the_variable_of_each_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text report printed "error: 'nope9' matches no interface here" without saying which variable."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nope9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nope8")
    from overdrive.cli.doctor import command

    r = CliRunner().invoke(command, [])
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())  # rich wraps long lines
    assert "error: GLOO_SOCKET_IFNAME: 'nope9' is not an interface here" in text
    assert "error: NCCL_SOCKET_IFNAME: 'nope8' matches no interface here" in text
