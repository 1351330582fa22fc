"""The NCCL doctor: multi-node problems are almost always set-up (variables, interfaces,
topology, ports), not code. :func:`diagnose` gathers the facts and the findings; the collective
bandwidth test lives in :mod:`overdrive.distributed.bandwidth`.

Example:
    >>> report = diagnose(master_addr=None)
    >>> sorted(report)[:3]
    ['env', 'findings', 'gpus']
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# What each variable does, and when its value is a risk: (meaning, {value: warning}).
# Values are compared lower-cased; "*" matches any value.
NCCL_VARS: dict[str, tuple[str, dict[str, str]]] = {
    "NCCL_DEBUG": ("log level (WARN, INFO, TRACE)", {"info": "debug logging left on: slows start-up and floods logs",
                                                      "trace": "trace logging left on: very slow"}),
    "NCCL_DEBUG_SUBSYS": ("which subsystems log", {}),
    "NCCL_DEBUG_FILE": ("where the log goes", {}),
    "NCCL_SOCKET_IFNAME": ("interfaces for bootstrap and socket traffic (prefix match, ^ excludes, = exact)", {}),
    "NCCL_IB_DISABLE": ("1 disables InfiniBand/RoCE", {"1": "InfiniBand disabled: inter-node traffic falls back to TCP sockets (10x slower)"}),
    "NCCL_P2P_DISABLE": ("1 disables GPU peer-to-peer (NVLink/PCIe)", {"1": "P2P disabled: intra-node traffic goes through host memory"}),
    "NCCL_SHM_DISABLE": ("1 disables shared-memory transport", {"1": "shared memory disabled: intra-node traffic may go over the network"}),
    "NCCL_P2P_LEVEL": ("max topology distance for P2P (LOC, NVL, PIX, PXB, PHB, SYS)", {"loc": "P2P_LEVEL=LOC disables P2P"}),
    "NCCL_NET_GDR_LEVEL": ("max distance for GPUDirect RDMA", {}),
    "NCCL_IB_HCA": ("which InfiniBand adapters/ports to use", {}),
    "NCCL_IB_GID_INDEX": ("RoCE GID index", {}),
    "NCCL_ALGO": ("force algorithms (Ring, Tree, NVLS, CollNet)", {"*": "algorithm forced: NCCL's tuner is overridden"}),
    "NCCL_PROTO": ("force protocols (LL, LL128, Simple)", {"*": "protocol forced: NCCL's tuner is overridden"}),
    "NCCL_NVLS_ENABLE": ("NVLink SHARP / multicast (NVLS) collectives", {}),
    "NCCL_CUMEM_ENABLE": ("cuMem-based buffers", {}),
    "NCCL_BUFFSIZE": ("per-channel buffer bytes", {}),
    "NCCL_MIN_NCHANNELS": ("minimum channels", {}),
    "NCCL_MAX_NCHANNELS": ("maximum channels", {"1": "one channel: bandwidth capped"}),
    "NCCL_TIMEOUT": ("NCCL-level timeout", {}),
    "NCCL_BLOCKING_WAIT": ("(old name) blocking wait", {"*": "deprecated name: use TORCH_NCCL_BLOCKING_WAIT"}),
    "NCCL_ASYNC_ERROR_HANDLING": ("(old name) async error handling", {"*": "deprecated name: use TORCH_NCCL_ASYNC_ERROR_HANDLING"}),
    "TORCH_NCCL_BLOCKING_WAIT": ("host waits on each collective (debug)", {"1": "blocking wait on: serializes host and GPU"}),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("what a failed/timed-out collective does (3 = tear down, default)", {"0": "errors not handled: a hung rank hangs the job"}),
    "TORCH_NCCL_ENABLE_MONITORING": ("heartbeat watchdog", {"0": "watchdog monitoring off: hangs are not reported"}),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": ("watchdog heartbeat timeout", {}),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": ("flight-recorder entries", {}),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("dump flight recorder on timeout", {}),
    "TORCH_NCCL_DESYNC_DEBUG": ("report which rank is out of step (debug)", {"1": "desync debug on: extra overhead"}),
    "TORCH_NCCL_AVOID_RECORD_STREAMS": ("avoid record_stream for collectives' tensors", {}),
    "TORCH_DISTRIBUTED_DEBUG": ("c10d debug (OFF, INFO, DETAIL)", {"detail": "DETAIL debug on: every collective is checked (slow)",
                                                                   "info": "debug logging left on"}),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": ("1 keeps symmetric memory off NVLink multicast", {}),
    "GLOO_SOCKET_IFNAME": ("interfaces gloo (CPU ranks) uses: comma list of exact names", {}),
}


# Variables NCCL / torch read that the table above does not describe: known names, so that the typo check below does
# not take them for misspellings of a described one (NCCL_IB_TIMEOUT is not a misspelt NCCL_TIMEOUT).
OTHER_KNOWN_VARS = frozenset("""
NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT NCCL_IB_SL NCCL_IB_TC NCCL_IB_QPS_PER_CONNECTION NCCL_IB_PCI_RELAXED_ORDERING
NCCL_IB_ADAPTIVE_ROUTING NCCL_IB_SPLIT_DATA_ON_QPS NCCL_IB_CUDA_SUPPORT NCCL_IB_MERGE_NICS NCCL_IB_ROCE_VERSION_NUM
NCCL_IB_AR_THRESHOLD NCCL_IB_USE_INLINE NCCL_IB_ECE_ENABLE NCCL_IB_FIFO_TC NCCL_IB_RETURN_ASYNC_EVENTS
NCCL_IB_ADDR_FAMILY NCCL_IB_ADDR_RANGE NCCL_IB_PKEY NCCL_IB_MERGE_VFS NCCL_IB_GID_INDEX NCCL_SOCKET_FAMILY
NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_NET NCCL_NET_PLUGIN NCCL_NET_GDR_READ NCCL_NET_GDR_C2C
NCCL_NET_SHARED_BUFFERS NCCL_NET_SHARED_COMMS NCCL_NET_FORCE_FLUSH NCCL_NET_OVERHEAD NCCL_TOPO_FILE
NCCL_TOPO_DUMP_FILE NCCL_GRAPH_FILE NCCL_GRAPH_DUMP_FILE NCCL_P2P_NET_CHUNKSIZE NCCL_P2P_PCI_CHUNKSIZE
NCCL_P2P_NVL_CHUNKSIZE NCCL_P2P_USE_CUDA_MEMCPY NCCL_P2P_READ_ENABLE NCCL_P2P_PXN_LEVEL NCCL_SHM_USE_CUDA_MEMCPY
NCCL_SHM_MEMCPY_MODE NCCL_SHM_LOCALITY NCCL_NTHREADS NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS NCCL_LAUNCH_MODE
NCCL_COLLNET_ENABLE NCCL_COLLNET_NODE_THRESHOLD NCCL_CROSS_NIC NCCL_LL_THRESHOLD NCCL_TREE_THRESHOLD
NCCL_LL128_BUFFSIZE NCCL_LL128_NTHREADS NCCL_NVB_DISABLE NCCL_NVLS_NCHANNELS NCCL_NVLS_CHUNKSIZE NCCL_PXN_DISABLE
NCCL_RUNTIME_CONNECT NCCL_GRAPH_REGISTER NCCL_LOCAL_REGISTER NCCL_SET_STACK_SIZE NCCL_SET_THREAD_NAME
NCCL_COMM_BLOCKING NCCL_CGA_CLUSTER_SIZE NCCL_MAX_CTAS NCCL_MIN_CTAS NCCL_IGNORE_CPU_AFFINITY
NCCL_IGNORE_DISABLED_P2P NCCL_CONF_FILE NCCL_HOSTID NCCL_DMABUF_ENABLE NCCL_MNNVL_ENABLE NCCL_WORK_FIFO_DEPTH
NCCL_TUNER_PLUGIN NCCL_PROFILER_PLUGIN NCCL_COMM_ID NCCL_MAX_P2P_NCHANNELS NCCL_MIN_P2P_NCHANNELS
NCCL_NCHANNELS_PER_NET_PEER NCCL_CUMEM_HOST_ENABLE NCCL_RAS_ENABLE NCCL_OOB_NET_ENABLE NCCL_OOB_NET_IFNAME
NCCL_DEBUG_TIMESTAMP_FORMAT NCCL_WARN_ENABLE_DEBUG_INFO NCCL_NVLS_ENABLE NCCL_NET_GDR_LEVEL
TORCH_NCCL_USE_COMM_NONBLOCKING TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC TORCH_NCCL_DEBUG_INFO_TEMP_FILE
TORCH_NCCL_DEBUG_INFO_PIPE_FILE TORCH_NCCL_ENABLE_TIMING TORCH_NCCL_HIGH_PRIORITY TORCH_NCCL_NAN_CHECK
TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN TORCH_NCCL_COORD_CHECK_MILSEC TORCH_NCCL_ABORT_IN_DESTROY_PG
TORCH_NCCL_RETHROW_CUDA_ERRORS TORCH_NCCL_PROPAGATE_ERROR TORCH_NCCL_CUDA_EVENT_CACHE TORCH_NCCL_TRACE_CPP_STACK
TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK TORCH_NCCL_SHOULD_DUMP_ON_TIMEOUT
""".split())

# NCCL's 0/1 switches: it parses an integer and ignores anything else ("Invalid value yes ... using default"), so
# NCCL_IB_DISABLE=yes left InfiniBand on while the user believed it off.
SWITCHES = ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_PXN_DISABLE", "NCCL_NVB_DISABLE",
            "NCCL_COLLNET_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_DMABUF_ENABLE", "NCCL_NVLS_ENABLE")


def misspelt(name: str) -> str | None:
    """The known variable ``name`` is most likely a misspelling of, or None (a known name, or no close one). NCCL
    ignores a name it does not read, so a typo silently leaves the setting at NCCL's default.

    Example:
        >>> misspelt("NCCL_IB_DISABLED"), misspelt("NCCL_IB_TIMEOUT"), misspelt("NCCL_IB_DISABLE")
        ('NCCL_IB_DISABLE', None, None)
    """
    import difflib

    if name in NCCL_VARS or name in OTHER_KNOWN_VARS:
        return None
    close = difflib.get_close_matches(name, [*NCCL_VARS, *OTHER_KNOWN_VARS], n=1, cutoff=0.9)
    return close[0] if close else None


def _is_int(value: str) -> bool:
    try:
        int(value.strip(), 0)  # as NCCL's strtoll(value, 0): 1, 0x1, 010
    except ValueError:
        return False
    return True


@dataclass
class Finding:
    level: str  # "error" (launch stops), "warning", "info"
    what: str
    detail: str


def _cmd(args: list[str], timeout: float = 10.0) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def versions() -> dict[str, Any]:
    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "driver": None,
                         "gloo": torch.distributed.is_gloo_available() if torch.distributed.is_available() else False}
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL
            v["nccl"] = None
        out = _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        v["driver"] = out.strip().splitlines()[0] if out else None
    return v


def gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                    "compute_capability": f"{p.major}.{p.minor}"})
    return out


def interfaces() -> list[dict[str, Any]]:
    """Network interfaces with operstate and IPv4 address (from /sys/class/net and ioctl)."""
    rows = []
    for _, name in socket.if_nameindex():
        state_file = Path("/sys/class/net") / name / "operstate"
        state = state_file.read_text().strip() if state_file.exists() else "unknown"
        rows.append({"name": name, "state": state, "ipv4": _ipv4(name)})
    return rows


def _ipv4(name: str) -> str | None:
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def check_socket_ifname(value: str, ifaces: list[dict[str, Any]]) -> list[Finding]:
    """NCCL_SOCKET_IFNAME: comma list of prefixes; ``=name`` exact; ``^`` excludes (``^=`` exact names).

    Example:
        >>> check_socket_ifname("^lo", [{"name": "lo", "state": "unknown", "ipv4": "127.0.0.1"}])[0].level
        'error'
    """
    value = value.strip()
    names = {i["name"]: i for i in ifaces}
    out: list[Finding] = []
    if value.startswith("^"):
        exact = value[1:].startswith("=")
        drop = [w.strip() for w in value[1:].lstrip("=").split(",") if w.strip()]
        left = [n for n, i in names.items() if i["state"] in ("up", "unknown")
                and not any((n == w if exact else n.startswith(w)) for w in drop)]
        if names and not left:  # NCCL then fails at init: "Bootstrap : no socket interface found"
            out.append(Finding("error", "NCCL_SOCKET_IFNAME", f"{value!r} excludes every interface that is up here "
                               f"(have: {', '.join(sorted(names))}); NCCL would find no socket interface: exclude "
                               "fewer (e.g. ^docker,lo) or name the one to use (e.g. eth0)"))
        return out
    exact = value.startswith("=")
    for want in filter(None, (w.strip() for w in value.lstrip("=").split(","))):
        hits = [i for n, i in names.items() if (n == want if exact else n.startswith(want))]
        if not hits:
            out.append(Finding("error", "NCCL_SOCKET_IFNAME", f"{want!r} matches no interface here "
                               f"(have: {', '.join(sorted(names))}); set it to an interface that exists or unset it"))
        elif not any(i["state"] in ("up", "unknown") for i in hits):
            out.append(Finding("error", "NCCL_SOCKET_IFNAME", f"{want!r} matches only interfaces that are down: "
                               f"{', '.join(i['name'] for i in hits)}"))
    return out


def check_ib_hca(value: str, hcas: list[str]) -> list[Finding]:
    """NCCL_IB_HCA: comma list of adapter prefixes, each optionally ``:port`` (``mlx5_0:1``); ``=`` exact; ``^``
    excludes. ``hcas``: the adapters here (/sys/class/infiniband). A list that selects none of them leaves NCCL
    without InfiniBand/RoCE: inter-node traffic falls back to TCP sockets, silently.

    Example:
        >>> check_ib_hca("mlx5_9", ["mlx5_0", "mlx5_1"])[0].detail.startswith("'mlx5_9' matches no")
        True
    """
    value = value.strip()
    if not value:
        return []
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    wants = [w.strip().split(":")[0] for w in body.lstrip("=").split(",") if w.strip()]

    def hit(name: str, want: str) -> bool:
        return name == want if exact else name.startswith(want)

    have = ", ".join(hcas) if hcas else "none: no /sys/class/infiniband"
    fix = "set it to adapters listed by ibv_devices (e.g. mlx5_0,mlx5_1) or unset it"
    if exclude:
        if hcas and all(any(hit(h, w) for w in wants) for h in hcas):
            return [Finding("warning", "NCCL_IB_HCA", f"{value!r} excludes every InfiniBand adapter here ({have}): "
                            f"inter-node traffic falls back to TCP sockets; {fix}")]
        return []
    missing = [w for w in wants if not any(hit(h, w) for h in hcas)]
    if missing and len(missing) == len(wants):
        return [Finding("warning", "NCCL_IB_HCA", f"{', '.join(repr(w) for w in missing)} matches no InfiniBand adapter "
                        f"here (have: {have}): NCCL uses no InfiniBand/RoCE and inter-node traffic falls back to TCP "
                        f"sockets; {fix}")]
    if missing:
        return [Finding("warning", "NCCL_IB_HCA", f"{', '.join(repr(w) for w in missing)} matches no InfiniBand adapter "
                        f"here (have: {have}); NCCL uses the others only: {fix}")]
    return []


def ib_adapters() -> list[str]:
    """The InfiniBand / RoCE adapters of this host (/sys/class/infiniband), sorted; [] without any."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def check_gloo_ifname(value: str, ifaces: list[dict[str, Any]]) -> list[Finding]:
    """GLOO_SOCKET_IFNAME: comma list of exact interface names, each of which gloo opens (no prefixes, no ``^``). A
    name that is not here made every gloo rank die at init ("Unable to find address for: eth7") after the launch.

    Example:
        >>> check_gloo_ifname("lo", [{"name": "lo", "state": "unknown", "ipv4": "127.0.0.1"}])
        []
    """
    names = {i["name"]: i for i in ifaces}
    out: list[Finding] = []
    for want in filter(None, (w.strip() for w in value.split(","))):
        iface = names.get(want)
        if iface is None:
            out.append(Finding("error", "GLOO_SOCKET_IFNAME", f"{want!r} is not an interface here (have: "
                               f"{', '.join(sorted(names))}); gloo takes exact names: set it to one of them or unset it"))
        elif iface["state"] == "down":
            out.append(Finding("error", "GLOO_SOCKET_IFNAME", f"{want!r} is down; pick an interface that is up"))
        elif iface["ipv4"] is None:
            out.append(Finding("warning", "GLOO_SOCKET_IFNAME", f"{want!r} has no IPv4 address; gloo needs an address "
                               "on it (IPv6 will do)"))
    return out


def env_findings(env: dict[str, str], ifaces: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[Finding]]:
    rows, findings = [], []
    for k in sorted(env):
        if not (k.startswith("NCCL_") or k.startswith("TORCH_NCCL_") or k in NCCL_VARS):
            continue
        meaning, risks = NCCL_VARS.get(k, ("(not in the doctor's table: check the NCCL docs)", {}))
        rows.append({"name": k, "value": env[k], "meaning": meaning})
        meant = misspelt(k)
        if meant is not None:
            findings.append(Finding("warning", k, f"{k} is not a variable NCCL or torch reads, so it does nothing; did "
                                    f"you mean {meant}? rename it ({meant}={env[k]})"))
            continue
        if k in SWITCHES and not _is_int(env[k]):
            findings.append(Finding("warning", k, f"{k}={env[k]!r} is not a number: NCCL reads an integer and ignores "
                                    f"this value, keeping its default; set {k}=1 (on) or {k}=0 (off)"))
            continue
        warn = risks.get(env[k].strip().lower()) or risks.get("*")
        if warn:
            findings.append(Finding("warning", k, f"{k}={env[k]}: {warn}"))
    if "NCCL_SOCKET_IFNAME" in env:
        findings += check_socket_ifname(env["NCCL_SOCKET_IFNAME"], ifaces)
    if "GLOO_SOCKET_IFNAME" in env:
        findings += check_gloo_ifname(env["GLOO_SOCKET_IFNAME"], ifaces)
    if "NCCL_IB_HCA" in env and env.get("NCCL_IB_DISABLE", "").strip() != "1":
        findings += check_ib_hca(env["NCCL_IB_HCA"], ib_adapters())
    return rows, findings


RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")  # what torchrun sets in each rank


def rank_env_problems(env: dict[str, str]) -> list[tuple[str, str]]:
    """(variable, problem) for each of WORLD_SIZE / RANK / LOCAL_RANK / MASTER_PORT in ``env`` that no process group
    can be built from: not an integer, WORLD_SIZE < 1, RANK outside [0, WORLD_SIZE), LOCAL_RANK < 0, a port outside
    1-65535, WORLD_SIZE > 1 without RANK. A RANK past WORLD_SIZE (or missing) waited out the store's 300 s timeout
    in ``init()``; the others were a bare ``ValueError`` from ``int()`` or from TCPStore.

    Example:
        >>> rank_env_problems({"WORLD_SIZE": "4", "RANK": "5"})
        [('RANK', 'RANK=5 is outside [0, WORLD_SIZE=4): ranks run 0 to 3')]
    """
    fix = "unset it and start the script with `overdrive launch`, which sets it in every rank"
    out: list[tuple[str, str]] = []
    vals: dict[str, int] = {}
    for k in RANK_VARS:
        if k not in env:
            continue
        try:
            vals[k] = int(env[k].strip())
        except ValueError:
            out.append((k, f"{k}={env[k]!r} is not an integer; {fix}"))
    if vals.get("WORLD_SIZE", 1) < 1:
        out.append(("WORLD_SIZE", f"WORLD_SIZE={vals['WORLD_SIZE']} must be >= 1 (the number of ranks); {fix}"))
    elif "RANK" in vals and not 0 <= vals["RANK"] < vals.get("WORLD_SIZE", 1):
        world = vals.get("WORLD_SIZE", 1)
        out.append(("RANK", f"RANK={vals['RANK']} is outside [0, WORLD_SIZE={world}): ranks run 0 to {world - 1}"
                    + ("" if "WORLD_SIZE" in env else " (WORLD_SIZE is unset: 1)")))
    if vals.get("WORLD_SIZE", 1) > 1 and "RANK" not in env:
        # every process would join as rank 0: the second could not be the store's master and the first waited out
        # the store's 300 s timeout for peers that never came
        out.append(("RANK", f"WORLD_SIZE={vals['WORLD_SIZE']} but RANK is unset, so every process would be rank 0; "
                    "set RANK (0 to WORLD_SIZE - 1) in each process, or unset WORLD_SIZE and start the script with "
                    "`overdrive launch`, which sets both"))
    if vals.get("LOCAL_RANK", 0) < 0:
        out.append(("LOCAL_RANK", f"LOCAL_RANK={vals['LOCAL_RANK']} must be >= 0; {fix}"))
    if "MASTER_PORT" in vals and not 0 < vals["MASTER_PORT"] < 65536:
        out.append(("MASTER_PORT", f"MASTER_PORT={vals['MASTER_PORT']} is not a TCP port (1-65535); pick a free "
                    "port, or unset it and start the script with `overdrive launch`"))
    return out


def master_host(addr: str, what: str = "MASTER_ADDR") -> str:
    """The host of a master address as sockets and torch's ``TCPStore`` take it: a name, an IPv4 address, or an IPv6
    one without the brackets of URLs and ``host:port`` (``[fd00::1]``); the store did not read a bracketed one and
    waited out its whole timeout ("cannot be retrieved"). Raises :class:`UsageError` for what no host can be: empty,
    unbalanced brackets, or a ``host:port`` (the port goes in MASTER_PORT).

    Example:
        >>> master_host("[fd00::1]"), master_host("fd00::1"), master_host(" node0 ")
        ('fd00::1', 'fd00::1', 'node0')
    """
    import ipaddress

    from overdrive._utils.errors import UsageError

    host = addr.strip()
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in inner or inner != host:
        try:
            ipaddress.IPv6Address(inner)  # a link-local scope (fe80::1%eth0) included
            return inner
        except ValueError:
            pass
        name, _, port = inner.rpartition(":")
        if inner == host and port.isdigit() and name and ":" not in name:
            raise UsageError(f"{what}={addr!r} holds a port: give the host alone ({what}={name}) and the port as "
                             f"MASTER_PORT={port} (--master-port {port})")
        raise UsageError(f"{what}={addr!r} is not a host name, an IPv4 address or an IPv6 address (bare, or in "
                         "brackets as [fd00::1]); fix the address")
    if not host or any(c in host for c in "[]/ "):
        raise UsageError(f"{what}={addr!r} is not a host name, an IPv4 address or an IPv6 address; give node 0's "
                         "address, e.g. 10.0.0.1 or node0")
    return host


def _resolve(addr: str, port: int) -> tuple[int, Any]:
    """(address family, socket address) of ``addr``: a name, an IPv4 address, or an IPv6 one, bare or bracketed as in
    ``[fd00::1]:29400`` (``socket.gethostbyname`` reads IPv4 only: every IPv6 master was "does not resolve")."""
    try:
        host = master_host(addr)
    except ValueError as exc:  # UsageError: reported as the address finding
        raise OSError(str(exc)) from None
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return family, sockaddr


def _show(addr: str, port: int) -> str:
    """``host:port``, an IPv6 address bracketed: ``[fd00::1]:29500``."""
    return f"[{addr}]:{port}" if ":" in addr and not addr.startswith("[") else f"{addr}:{port}"


def _is_local(family: int, sockaddr: Any) -> bool:
    """Whether the address belongs to this host: a socket can be bound to it (any port)."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            return False
    return True


def check_master(addr: str, port: int, node_rank: int = 0, timeout: float = 3.0, wait_s: float = 0.0,
                 on_wait: Callable[[], None] | None = None) -> list[Finding]:
    """Node 0 must be able to bind the master port (free); other nodes must reach it over TCP.

    ``wait_s``: how long another node keeps trying while nothing listens there yet (connection refused: the host
    answers, node 0's launch has not opened its store), as torchrun's ranks wait for node 0; ``on_wait`` is called
    once before the first retry. An address that does not answer at all (a timeout, no route) is an error at once.

    Example:
        >>> check_master("no-such-host.invalid", 29500)[0].what
        'MASTER_ADDR'
    """
    try:
        family, sockaddr = _resolve(addr, port)
    except (OSError, UnicodeError) as exc:
        return [Finding("error", "MASTER_ADDR", f"{addr!r} does not resolve ({exc}); use an IP or a name in DNS/hosts")]
    where = _show(addr, port)
    if node_rank == 0 and _is_local(family, sockaddr):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # as TCPStore binds: every address of the family, SO_REUSEADDR on. Without it the port of a run that
            # just ended (killed, or Ctrl-C) stayed "in use" for a minute in TIME_WAIT, which the store binds over
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as exc:
                return [Finding("error", "MASTER_PORT", f"{where} cannot be bound on the master node ({exc.strerror}): "
                                "another job holds it; pick another --master-port")]
        return [Finding("info", "MASTER_PORT", f"{where} is free on this (master) node")]
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                conn.connect(sockaddr)
                return [Finding("info", "MASTER_PORT", f"{where} is reachable")]
        except ConnectionRefusedError as exc:
            # the host is there and nothing listens yet: node 0 may simply start later (torchrun's ranks wait for it)
            if time.monotonic() < deadline:
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            after = f", after waiting {wait_s:g} s" if wait_s > 0 else ""
            return [Finding("error", "MASTER_PORT", f"nothing listens on {where} ({exc.strerror or exc}{after}): "
                            "start node 0's launch (it opens the port), or check --master-port")]
        except OSError as exc:
            return [Finding("error", "MASTER_PORT", f"{where} is not reachable from this node ({exc.strerror or exc}): "
                            "start node 0 first, check the address, the port and firewalls")]


def diagnose(master_addr: str | None = None, master_port: int | None = None, node_rank: int = 0,
             env: dict[str, str] | None = None, topology: bool = True, master_wait_s: float = 0.0,
             on_wait: Callable[[], None] | None = None) -> dict[str, Any]:
    """Versions, GPUs (+ ``nvidia-smi topo -m``), NCCL variables with findings, interfaces, master check.

    ``master_addr``/``master_port`` default to MASTER_ADDR / MASTER_PORT from ``env``; ``master_wait_s`` and
    ``on_wait`` are :func:`check_master`'s (a node other than 0 waits that long for node 0 to listen).
    """
    env = dict(os.environ if env is None else env)
    ifaces = interfaces()
    rows, findings = env_findings(env, ifaces)
    bad_env = rank_env_problems(env)
    findings += [Finding("error", k, detail) for k, detail in bad_env]
    addr = master_addr or env.get("MASTER_ADDR")
    port = master_port or (int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit()
                           and not any(k == "MASTER_PORT" for k, _ in bad_env) else None)
    if addr is not None and port is not None:
        findings += check_master(addr, port, node_rank, wait_s=master_wait_s, on_wait=on_wait)
    g = gpus()
    if not g:  # what a user checking an NCCL set-up on a CPU machine needs to know first
        findings.append(Finding("info", "backend", "no CUDA GPU is visible: ranks started here join with gloo over TCP "
                                "(CPU), which reads GLOO_SOCKET_IFNAME, not the NCCL_* variables"))
    topo = _cmd(["nvidia-smi", "topo", "-m"]) if (topology and g) else None
    return {
        "versions": versions(), "gpus": g, "topology": topo, "env": rows, "interfaces": ifaces,
        "master": {"addr": addr, "port": port, "node_rank": node_rank},
        "findings": [asdict(f) for f in findings],
    }


def errors(report: dict[str, Any]) -> list[str]:
    """The findings that should stop a launch."""
    return [f"{f['what']}: {f['detail']}" for f in report["findings"] if f["level"] == "error"]
