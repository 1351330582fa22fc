"""``overdrive doctor``: versions, GPUs/topology, NCCL variables, interfaces, master port, bandwidth."""

from __future__ import annotations

import sys

import click

from overdrive.cli.common import check_json_target, console, json_option, progress_option, write_json


@click.command("doctor")
@click.option("--master-addr", default=None, help="Check this master address (default: $MASTER_ADDR).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="Check this master port (default: $MASTER_PORT).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="0: the port must be free here; >0: it must be reachable.")
@click.option("--bandwidth", "nproc", type=click.IntRange(min=0), default=0,
              help="Run the collective bandwidth test on this many local ranks (0: skip).")
@click.option("--min-bytes", type=click.IntRange(min=1), default=8 * 1024, show_default=True)
@click.option("--max-bytes", type=click.IntRange(min=1), default=64 * 2**20, show_default=True)
@click.option("--ops", default="all_reduce,all_gather,reduce_scatter", show_default=True)
@json_option("the report")
@progress_option()
def command(master_addr: str | None, master_port: int | None, node_rank: int, nproc: int, min_bytes: int,
            max_bytes: int, ops: str, json_path: str | None, no_progress: bool) -> None:
    """Diagnose a distributed set-up; exits 1 when a finding is an error.

    \b
    Example:
      overdrive doctor --master-addr 10.0.0.1 --master-port 29500 --node-rank 1
      overdrive doctor --bandwidth 8 --max-bytes 4294967296 --ops all_reduce --json
    """
    check_json_target(json_path)
    from overdrive.distributed import doctor
    from overdrive.distributed.launch import bandwidth

    report = doctor.diagnose(master_addr=master_addr, master_port=master_port, node_rank=node_rank)
    if nproc > 0:
        from overdrive._utils.progress import status

        sizes = f"{min_bytes:,} to {max_bytes:,} bytes"
        where = "GPU ranks" if report["gpus"] else "CPU ranks over gloo (minutes on a few cores)"
        with status(f"bandwidth test: {nproc} {where}, {ops}, {sizes}", enabled=not no_progress and json_path != "-"):
            report["bandwidth"] = bandwidth(nproc, min_bytes, max_bytes, ops)
    errs = doctor.errors(report)
    if json_path is not None:
        write_json(report, json_path)
        if json_path == "-":
            sys.exit(1 if errs else 0)
    from rich.table import Table

    con = console()
    v = report["versions"]
    con.print(f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, driver {v['driver']}, gloo {v['gloo']}")
    for g in report["gpus"]:
        con.print(f"gpu {g['index']}: {g['name']}, sm {g['compute_capability']}, {g['memory_gib']} GiB")
    if report["topology"]:
        con.print(report["topology"])
    t = Table(title="NCCL / torch.distributed variables")
    for c in ("name", "value", "meaning"):
        t.add_column(c)
    for r in report["env"]:
        t.add_row(r["name"], r["value"], r["meaning"])
    con.print(t if report["env"] else "no NCCL_* / TORCH_NCCL_* variable set")
    con.print("interfaces: " + ", ".join(f"{i['name']} ({i['state']}, {i['ipv4'] or '-'})" for i in report["interfaces"]))
    for f in report["findings"]:
        color = {"error": "red", "warning": "yellow"}.get(f["level"], "green")
        # the detail names the variable for most findings; where it does not ("'eth7' matches no interface"), say which
        name = "" if f["detail"].startswith(f["what"]) else f"{f['what']}: "
        con.print(f"[{color}]{f['level']}[/]: {name}{f['detail']}")
    if "bandwidth" in report:
        bw = report["bandwidth"]
        t = Table(title=f"collectives ({bw['backend']}, {bw['world_size']} ranks): median over iterations")
        for c in ("op", "bytes", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            t.add_column(c, justify="right")
        for r in bw["rows"]:
            t.add_row(r["op"], f"{r['bytes']:,}", f"{r['time_us']:.1f}", f"{r['algbw_gbs']:.2f}", f"{r['busbw_gbs']:.2f}")
        con.print(t)
    sys.exit(1 if errs else 0)
