"""Bad torchrun variables (WORLD_SIZE / RANK / LOCAL_RANK / MASTER_PORT) in ``init()`` and the doctor.

Before: ``init()`` with RANK=5 WORLD_SIZE=4 waited out the store's 300 s timeout; WORLD_SIZE=abc and MASTER_PORT=abc
were a bare ``ValueError`` from ``int()``, MASTER_PORT=99999 a ``TypeError`` from TCPStore; the doctor said nothing
about any of them."""

from __future__ import annotations

import pytest

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.distributed import doctor
from overdrive.distributed.config import LaunchConfig
from overdrive.distributed.launch import preflight

CLEAN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@pytest.mark.parametrize(("env", "named"), [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "x1"}, "RANK='x1'"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc'"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
])
def test_init_names_the_bad_variable(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str) -> None:
    for k in CLEAN:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match=named.replace("(", r"\(")):
        odist.init(backend="gloo", device="cpu")


@pytest.mark.parametrize(("env", "what"), [
    ({"WORLD_SIZE": "4", "RANK": "5"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK"),
    ({"RANK": "1"}, "RANK"),  # WORLD_SIZE unset: a world of one
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-3"}, "LOCAL_RANK"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT"),
])
def test_doctor_flags_bad_rank_variables(env: dict[str, str], what: str) -> None:
    report = doctor.diagnose(env=env, topology=False)
    errs = [f for f in report["findings"] if f["level"] == "error"]
    assert [f["what"] for f in errs] == [what], report["findings"]
    assert env[what] in errs[0]["detail"]


def test_good_rank_variables_are_not_flagged() -> None:
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert doctor.rank_env_problems(env) == []
    assert doctor.errors(doctor.diagnose(env=env, topology=False)) == []


def test_launch_ignores_stale_rank_variables() -> None:
    # torchrun sets these in every rank: a stale value in the launching shell must not stop the launch
    preflight(LaunchConfig(nproc_per_node=2), env={"WORLD_SIZE": "abc", "RANK": "7", "MASTER_PORT": "99999"})


def test_init_refuses_world_size_without_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # every process joined as rank 0 and the first waited out the store's 300 s timeout for its peers
    for k in CLEAN:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(odist.free_port()))
    with pytest.raises(UsageError, match=r"WORLD_SIZE=2 but RANK is unset"):
        odist.init(backend="gloo", device="cpu")
    report = doctor.diagnose(env={"WORLD_SIZE": "2"}, topology=False)
    assert [f["what"] for f in report["findings"] if f["level"] == "error"] == ["RANK"], report["findings"]
