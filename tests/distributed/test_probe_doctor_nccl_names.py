"""``overdrive doctor`` on misspelt NCCL variables and switches given words: NCCL ignores a name it does not read
(NCCL_IB_DISABLED=1 left InfiniBand on) and a switch that is not an integer (NCCL_IB_DISABLE=yes kept the default),
and the doctor listed both without a word. Real names close to a described one are not taken for typos."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from overdrive.distributed import doctor


def _warnings(env: dict[str, str]) -> dict[str, str]:
    _, findings = doctor.env_findings(env, doctor.interfaces())
    return {f.what: f.detail for f in findings if f.level == "warning"}


def test_a_misspelt_variable_is_named_with_the_one_meant() -> None:
    got = _warnings({"NCCL_IB_DISABLED": "1", "NCCL_SOCKET_IFNAM": "eth0", "TORCH_NCCL_BLOCKING_WAITS": "1"})
    assert "did you mean NCCL_IB_DISABLE? rename it (NCCL_IB_DISABLE=1)" in got["NCCL_IB_DISABLED"]
    assert "did you mean NCCL_SOCKET_IFNAME?" in got["NCCL_SOCKET_IFNAM"]
    assert "did you mean TORCH_NCCL_BLOCKING_WAIT?" in got["TORCH_NCCL_BLOCKING_WAITS"]


def test_real_variables_are_not_taken_for_typos() -> None:
    env = {"NCCL_IB_TIMEOUT": "22", "NCCL_MAX_P2P_NCHANNELS": "8", "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "0",
           "NCCL_SHM_DISABLE": "0x1", "NCCL_SOME_FUTURE_KNOB": "3"}
    got = _warnings(env)
    assert not any("did you mean" in d or "not a number" in d for d in got.values()), got


def test_a_switch_given_a_word_is_flagged_and_the_cli_prints_it() -> None:
    got = _warnings({"NCCL_IB_DISABLE": "yes", "NCCL_P2P_DISABLE": "true"})
    assert "NCCL_IB_DISABLE='yes' is not a number" in got["NCCL_IB_DISABLE"]
    assert "set NCCL_P2P_DISABLE=1 (on) or NCCL_P2P_DISABLE=0 (off)" in got["NCCL_P2P_DISABLE"]
    from overdrive.cli.main import cli

    res = CliRunner().invoke(cli, ["doctor"], env={"NCCL_IB_DISABLED": "1", "COLUMNS": "300"})
    assert res.exit_code == 0, res.output  # a warning, not an error: the doctor exits 0
    assert "did you mean NCCL_IB_DISABLE?" in res.output


def test_launch_says_a_misspelt_nccl_variable_before_the_ranks_start() -> None:
    # the doctor's warning reached `overdrive doctor` only: a launch with NCCL_IB_DISABLED=1 started silently
    from overdrive.distributed.config import LaunchConfig
    from overdrive.distributed.launch import preflight

    with pytest.warns(RuntimeWarning, match=r"overdrive launch: NCCL_IB_DISABLED: .*did you mean NCCL_IB_DISABLE"):
        preflight(LaunchConfig(nproc_per_node=1), env={"NCCL_IB_DISABLED": "1"})
