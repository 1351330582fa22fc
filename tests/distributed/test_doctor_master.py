"""The doctor's master-port check (what `overdrive launch` runs before torchrun): IPv6 masters and a port that a run
which just ended leaves in TIME_WAIT."""

from __future__ import annotations

import socket

import pytest

from overdrive.distributed import doctor, launch
from overdrive.distributed.config import LaunchConfig


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")


@needs_ipv6
@pytest.mark.parametrize("addr", ["::1", "[::1]"])
def test_ipv6_master_is_checked_not_refused(addr: str) -> None:
    # torchrun takes --master-addr ::1 and --rdzv-endpoint [::1]:29400; the doctor said "does not resolve" and
    # `overdrive launch` stopped before torchrun
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
        s.listen()
        found = doctor.check_master(addr, port, node_rank=1)
        assert [(f.level, f.what) for f in found] == [("info", "MASTER_PORT")], found
        assert f"[::1]:{port}" in found[0].detail
        busy = doctor.check_master(addr, port, node_rank=0)  # the master node: someone listens there already
        assert busy[0].level == "error" and "another --master-port" in busy[0].detail
    free = doctor.check_master(addr, port, node_rank=0)
    assert [(f.level, f.what) for f in free] == [("info", "MASTER_PORT")], free


@needs_ipv6
def test_launch_preflight_takes_a_bracketed_ipv6_rdzv_endpoint() -> None:
    report = launch.preflight(LaunchConfig(nnodes=2, nproc_per_node=1, rdzv_endpoint="[::1]:29400"), {})
    assert doctor.errors(report) == []
    report = launch.preflight(LaunchConfig(nnodes=2, nproc_per_node=1, master_addr="::1", master_port=29511), {})
    assert doctor.errors(report) == []


def test_port_left_in_time_wait_by_an_ended_run_is_free() -> None:
    # A run killed (or stopped with Ctrl-C) closes its store's connections from the server side, which leaves the
    # master port in TIME_WAIT for a minute; TCPStore binds over it (SO_REUSEADDR), the doctor refused it
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's listening socket
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT on `port`
    srv.close()
    cli.close()
    found = doctor.check_master("127.0.0.1", port, node_rank=0)
    assert [(f.level, f.what) for f in found] == [("info", "MASTER_PORT")], found


IFACES = [{"name": "lo", "state": "unknown", "ipv4": "127.0.0.1"}, {"name": "eth0", "state": "up", "ipv4": "10.0.0.2"},
          {"name": "docker0", "state": "down", "ipv4": None}]


@pytest.mark.parametrize("value", ["^eth,lo", "^=eth0,lo", "^e,l"])
def test_socket_ifname_exclusion_that_leaves_no_interface_is_an_error(value: str) -> None:
    # NCCL then fails at init with "no socket interface found", after the launch; the exclusion form was not checked
    found = doctor.check_socket_ifname(value, IFACES)
    assert [(f.level, f.what) for f in found] == [("error", "NCCL_SOCKET_IFNAME")]
    assert value in found[0].detail and "excludes every interface" in found[0].detail


@pytest.mark.parametrize("value", ["^docker,lo", "^=eth", "^=docker0"])
def test_socket_ifname_exclusion_that_leaves_one_up_is_fine(value: str) -> None:
    assert doctor.check_socket_ifname(value, IFACES) == []


def test_ib_hca_naming_no_adapter_here_is_named() -> None:
    # a node list copied from another cluster: NCCL finds no adapter and sends inter-node traffic over TCP, silently
    found = doctor.check_ib_hca("mlx5_0:1,mlx5_1:1", ["ibp12s0", "ibp75s0"])
    assert [(f.level, f.what) for f in found] == [("warning", "NCCL_IB_HCA")]
    assert "'mlx5_0', 'mlx5_1'" in found[0].detail and "ibp12s0, ibp75s0" in found[0].detail
    assert "TCP" in found[0].detail
    assert doctor.check_ib_hca("mlx5_0,mlx5_7", ["mlx5_0"])[0].detail.startswith("'mlx5_7' matches no")
    assert doctor.check_ib_hca("^mlx5", ["mlx5_0", "mlx5_1"])[0].detail.startswith("'^mlx5' excludes every")
    for ok in ("mlx5", "=mlx5_0:1", "mlx5_0:1,mlx5_1:1", "^mlx5_1", ""):
        assert doctor.check_ib_hca(ok, ["mlx5_0", "mlx5_1"]) == [], ok


def test_env_findings_check_ib_hca_unless_ib_is_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "ib_adapters", lambda: ["mlx5_0"])
    _, found = doctor.env_findings({"NCCL_IB_HCA": "mlx5_4"}, IFACES)
    assert [(f.level, f.what) for f in found] == [("warning", "NCCL_IB_HCA")]
    _, found = doctor.env_findings({"NCCL_IB_HCA": "mlx5_4", "NCCL_IB_DISABLE": "1"}, IFACES)
    assert not any(f.what == "NCCL_IB_HCA" for f in found)
