"""The ``ddptrain`` command: ``run`` runs an unmodified Ray Train script, ``check`` checks
every host before a run, ``stack`` prints a live run's stacks."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shlex
import socket
import subprocess
import sys
import threading
from typing import Any

import ddptrain
from ddptrain import _env
from ddptrain.cli import dashboard
from ddptrain.cli import runs as inspect_runs
from ddptrain.cli.stack import stack_command
from ddptrain.errors import DdpTrainError
from ddptrain.launch.fanout import each_host
from ddptrain.launch.host_scripts import env_frame
from ddptrain.launch.hosts import SLURM, HostSpec, is_local, parse_hosts, with_ssh_config
from ddptrain.launch.slurm import prestart_command, srun_command
from ddptrain.launch.slurm_allocation import allocation_hosts, node_address, route_source
from ddptrain.launch.slurm_submit import SlurmConfig, submit, warning_option
from ddptrain.launch.ssh_connect import connect, run_program
from ddptrain.ray_compat import install as install_ray_compat
from ddptrain.wire.boot import PIN, import_pins, versions

__all__ = ["main", "check_hosts"]

# Runs on each host the way its agent would (same python, working directory and environment, see
# `_probe`): versions, GPUs, disk, and whether the driver's port can be reached. Arguments: the
# driver's address and port, then the agent's pins (``NAME=FOLDER``, see ``ddptrain.wire.boot.PIN``).
_PROBE = (
    r"""
import sys
# `python -c` puts the working directory first on sys.path: off it before anything is imported
# (another user may have planted a `json.py` there), then import as the agent does (PIN).
sys.path[:] = [p for p in sys.path if p]
import json, os, shutil, socket
address, port = sys.argv[1:3]
del sys.argv[1:3]
"""
    + PIN
    + r"""
out = {"python": sys.executable, "python_full": sys.version.split()[0]}
try:  # the table the agent checks against the driver's (ddptrain.wire.boot.versions)
    from ddptrain.wire.boot import versions
    out["versions"] = versions()
except Exception:  # no ddptrain, an older one, or a missing dependency: each one's own
    found = {"python": ".".join(sys.version.split()[0].split(".")[:2])}
    for name in ("ddptrain", "torch", "cloudpickle"):
        try:
            found[name] = getattr(__import__(name), "__version__", "?").split("+")[0]
        except Exception as exc:
            found[name] = "missing: " + type(exc).__name__
    out["versions"] = found
try:
    import torch
    out["gpus"] = torch.cuda.device_count()
except Exception:
    out["gpus"] = None
try:
    out["free_gb"] = round(shutil.disk_usage(os.getcwd()).free / 1e9, 1)
except OSError as exc:
    out["free_gb"] = "error: " + str(exc)
try:
    socket.create_connection((address, int(port)), timeout=3).close()
    out["reaches_driver"] = True
except (OSError, ValueError) as exc:
    out["reaches_driver"] = str(exc) or type(exc).__name__
print("DDPTRAIN_CHECK " + json.dumps(out))
"""
)

_COLUMNS = ("host", "ssh", "python", "ddptrain", "torch", "cloudpickle", "gpus", "free disk", "driver port")


def _probe(host: HostSpec, port: int) -> dict[str, Any]:
    """Run the probe on ``host`` exactly as a run starts its agent there."""
    if is_local(host):  # as `LocalLauncher`: this python, the driver's environment and directory
        args = [sys.executable, "-c", _PROBE, "127.0.0.1", str(port), *import_pins()]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
        return _parse(proc.stdout, proc.stderr, "local")

    if host.srun:  # as `SlurmLauncher`: a job step on the node, the driver's python and directory
        return _probe_node(host.name, port)

    # As `Run.new_launcher` and `SSHLauncher`: the host's python and working directory, through
    # the same shell step, with the forwarded environment.
    python = host.python or sys.executable
    client = connect(host, _env.ssh_connect_timeout_s())
    try:
        address = _env.driver_address() or client.get_transport().sock.getsockname()[0]
        program = [python, "-c", _PROBE, address, str(port)]
        _, out, err = run_program(client, python, host.workdir or os.getcwd(), _env.forwarded_env(), program, 120)
        return _parse(out, err, "ok")
    finally:
        client.close()


def _probe_node(node: str, port: int) -> dict[str, Any]:
    """Run the probe on a node of the SLURM allocation, as a job step started as its agent is."""
    address = _env.driver_address() or route_source(node_address(node))
    program = [sys.executable, "-c", _PROBE, address, str(port)]
    try:
        proc = subprocess.run(
            srun_command(node, prestart_command(sys.executable, program)),
            input=env_frame(_env.forwarded_env()),
            capture_output=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ssh": "srun: FAILED: no answer in 120 s"}
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if proc.returncode != 0 and "DDPTRAIN_CHECK" not in out:
        tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"ssh": f"srun: FAILED: {tail}"}
    return _parse(out, err, "srun ok")


def _parse(stdout: str, stderr: str, ssh: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith("DDPTRAIN_CHECK "):
            result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
            result["ssh"] = ssh
            return result
    tail = (stderr.strip().splitlines() or ["no output"])[-1]
    return {"ssh": ssh, "error": f"the probe did not run: {tail}"}


def check_hosts(hosts: list[HostSpec]) -> tuple[list[list[str]], bool]:
    """Probe every host in parallel; returns the table rows and whether all is well."""
    expected = versions()  # what every agent checks: the same table, the same keys
    listener = socket.create_server(("", 0))
    port = listener.getsockname()[1]
    accepting = threading.Thread(target=_accept_all, args=(listener,), daemon=True)
    accepting.start()

    def run(host: HostSpec) -> dict[str, Any]:
        try:
            return _probe(host, port)
        except DdpTrainError as exc:
            return {"ssh": f"FAILED: {exc}"}
        except Exception as exc:
            return {"ssh": "ok", "error": repr(exc)}

    results = each_host(run, hosts, name="ddptrain-check")
    listener.close()
    rows, healthy = [], True
    for i, host in enumerate(hosts):
        got = results[i]
        if isinstance(got, BaseException):  # run() catches what a probe raises: only an interrupt
            raise got
        row = [host.name, str(got.get("ssh"))]
        if "python" not in got:
            row += [got.get("error", "-")] + ["-"] * (len(_COLUMNS) - 3)
            rows.append(row)
            healthy = False
            continue
        found = got["versions"]
        cells = [f"{got['python']} ({got['python_full']})" + _mark(found["python"], expected["python"])]
        for name in ("ddptrain", "torch", "cloudpickle"):
            cells.append(str(found[name]) + _mark(found[name], expected[name]))
        if found.get("protocol", expected["protocol"]) != expected["protocol"]:
            cells[1] += f" (protocol {found['protocol']} != {expected['protocol']})"
        reaches = got["reaches_driver"]
        cells += [str(got["gpus"]), f"{got['free_gb']} GB", "yes" if reaches is True else f"NO: {reaches}"]
        healthy &= all("!=" not in c for c in cells) and reaches is True
        rows.append(row + cells)
    return rows, healthy


def _accept_all(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.close()


def _mark(value: str, expected: str) -> str:
    return "" if value == expected else f" != {expected} (driver)"


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [list(_COLUMNS), *rows]) for i in range(len(_COLUMNS))]
    for row in [list(_COLUMNS), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _script_problem(script: str, args: list[str]) -> str | None:
    """Why ``script`` cannot be run (``None``: it can), with what to type instead."""
    if os.path.isfile(script):
        return None
    if os.path.basename(script).startswith("python") and args:
        rest = " ".join(shlex.quote(a) for a in args)
        return f"give the script itself, without {script!r}: `ddptrain run {rest}`."
    if os.path.isdir(script):
        return f"{script} is a folder, not a script: give the Python file to run (`ddptrain run {script}/train.py`)."
    return f"no such script: {script}"


def run_script(script: str, args: list[str], hostfile: str | None = None) -> int:
    """Run ``script`` as ``__main__`` with ``import ray...`` resolving to ddptrain.

    Its exit status is the script's: 0 when it returns, the code of a ``SystemExit``, and
    1 (with the traceback printed) when it raises.
    """
    problem = _script_problem(script, args)
    if problem:
        print(f"ddptrain run: {problem}", file=sys.stderr)
        return 2
    if hostfile == SLURM:  # the allocation's nodes (read at fit())
        _env.set_script_hostfile(SLURM)
    elif hostfile is not None:
        if not os.path.isfile(hostfile):
            print(f"ddptrain run: no such host file: {hostfile}", file=sys.stderr)
            return 2
        _env.set_script_hostfile(os.path.abspath(hostfile))  # the script's, not its programs' (see _env)
    install_ray_compat()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


_SUBMIT_USAGE = "usage: ddptrain submit [sbatch options...] -- script.py [args...]"


def submit_command(argv: list[str]) -> int:
    """``ddptrain submit [sbatch options...] -- script.py [args...]``: the job's exit status."""
    if "--" not in argv and argv[:1] and not argv[0].startswith("-"):  # no sbatch option: the script
        argv = ["--", *argv]
    if "--" not in argv:
        if argv[:1] in (["-h"], ["--help"]):  # as argparse's --help
            print(
                f"{_SUBMIT_USAGE}\n\nThe options before `--` are sbatch's. `--signal=USR1@S` sets the warning's lead "
                "time (default 120 s); a `--signal` with another signal turns off the warning and the requeue. "
                "See docs/slurm.md ('From a login node')."
            )
            raise SystemExit(0)
        print(f"{_SUBMIT_USAGE}\nddptrain submit: put `--` between sbatch's options and the script.", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    if not command:
        print(f"{_SUBMIT_USAGE}\nddptrain submit: no script after `--`.", file=sys.stderr)
        return 2
    lead_s, options = warning_option(options)
    if lead_s is not None:  # a USR1 warning: ours, with that lead time, to the batch shell
        print(
            f"ddptrain submit: --signal: SLURM warns the batch shell (B:USR1@{lead_s}), which preempts the run "
            "and requeues the job",
            file=sys.stderr,
        )
    elif any(o.startswith("--signal") for o in options):  # another signal: the user's own, no requeue
        lead_s = 0
    try:
        return submit(command, SlurmConfig(signal_s=120 if lead_s is None else lead_s, extra=options))
    except DdpTrainError as exc:
        print(f"ddptrain submit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C while the job is being cancelled
        print("ddptrain submit: interrupted; check the job with `squeue --me`", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ddptrain`` console script."""
    parser = argparse.ArgumentParser(prog="ddptrain", description="ddptrain tools")
    parser.add_argument("--version", action="version", version=f"ddptrain {ddptrain.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a Ray Train script unmodified: `import ray.train` and friends resolve to ddptrain",
        description="Run SCRIPT as `python SCRIPT ARGS...` would, with `ray`, `ray.train`, `ray.train.torch`, "
        "`ray.data`, `ray.tune`, `ray.util.sgd`... resolving to ddptrain's modules (in its workers and "
        "multiprocessing children too, not in programs it starts).",
    )
    run.add_argument(
        "--hosts",
        metavar="FILE",
        help="host file for the script's trainers, over $DDPTRAIN_HOSTFILE (not for programs the script starts); "
        "`slurm`: the nodes of the SLURM allocation it runs in",
    )
    run.add_argument("script", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    sub.add_parser(
        "submit",
        help="submit a script to SLURM from a login node and follow its output: "
        "ddptrain submit [sbatch options...] -- script.py [args...]",
        description="Write a batch script that runs SCRIPT on the job's nodes (hosts='slurm'), submit it "
        "with sbatch (the options before `--` are sbatch's), print its output as it runs, and exit with "
        "its exit status. Ctrl-C cancels the job. SLURM's warning signal (--signal=B:USR1@120 unless "
        "options say otherwise) stops the run with a final checkpoint and requeues the job, which resumes it.",
        add_help=False,
    )
    check = sub.add_parser("check", help="check SSH, Python, versions, GPUs, disk and the driver port on every host")
    check.add_argument(
        "hostfile", nargs="?", help="host file, or `slurm`: the allocation's nodes (default: $DDPTRAIN_HOSTFILE)"
    )
    stack = sub.add_parser("stack", help="print every rank's Python stack and process state of a live run")
    stack.add_argument("run", help="the run directory, or a run name under $DDPTRAIN_STORAGE_PATH")
    run_help = "a run directory or URI (s3://bucket/prefix/name), or a run name under $DDPTRAIN_STORAGE_PATH"
    runs = sub.add_parser("runs", help="list the runs in a storage folder with their status")
    runs.add_argument(
        "storage",
        nargs="?",
        help="storage folder or URI (s3://bucket/prefix) (default: $DDPTRAIN_STORAGE_PATH or ~/ddptrain_results)",
    )
    runs.add_argument("--json", action="store_true", help="machine-readable output")
    show = sub.add_parser("show", help="a run's config, attempts and their errors, metrics and checkpoints")
    show.add_argument("run", help=run_help)
    show.add_argument("--json", action="store_true", help="machine-readable output")
    logs = sub.add_parser("logs", help="print a rank's log (the latest attempt's by default)")
    logs.add_argument("run", help=run_help)
    logs.add_argument("--rank", type=int, default=0)
    logs.add_argument("--attempt", type=int, default=None)
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing while the run is live")
    export = sub.add_parser("export", help="every report's metrics as CSV or JSON")
    export.add_argument("run", help=run_help)
    export.add_argument("--format", choices=("csv", "json"), default="csv")
    export.add_argument("-o", "--output", help="write to this file instead of stdout")
    plot = sub.add_parser("plot", help="plot metrics of one or more runs (needs matplotlib)")
    plot.add_argument(
        "runs",
        nargs="+",
        metavar="RUN|METRIC",
        help=run_help + "; then metrics to plot, as with -m (a word that is not a run but a metric of the runs)",
    )
    plot.add_argument("--metric", "-m", action="append", default=[], help="a metric to plot (repeatable; default: all)")
    plot.add_argument("--x", choices=("report", "time"), default="report", help="x axis")
    plot.add_argument("-o", "--output", default="ddptrain_plot.png", help="output file (.png, .svg, .pdf)")
    dash = sub.add_parser("dashboard", help="serve a read-only web page of the runs in a storage folder")
    dash.add_argument("storage", nargs="?", help="storage folder (default: $DDPTRAIN_STORAGE_PATH)")
    dash.add_argument("--port", type=int, default=dashboard.DEFAULT_PORT)
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["submit"]:
        return submit_command(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "dashboard":
        storage = args.storage or _env.default_storage_path()
        return dashboard.serve(storage, args.host, args.port, given=args.storage is not None)
    try:
        if args.command == "runs":
            return inspect_runs.main_runs(args.storage, args.json)
        if args.command == "show":
            return inspect_runs.main_show(args.run, args.json)
        if args.command == "logs":
            return inspect_runs.main_logs(args.run, args.rank, args.attempt, args.follow)
        if args.command == "export":
            return inspect_runs.main_export(args.run, args.format, args.output)
        if args.command == "plot":
            return inspect_runs.main_plot(args.runs, args.metric, args.output, args.x)
    except (inspect_runs.RunNotFound, DdpTrainError) as exc:  # DdpTrainError: e.g. a URI's missing extra
        print(f"ddptrain {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "run":
        return run_script(args.script, args.args, args.hosts)
    if args.command == "stack":
        return stack_command(args.run)
    source = args.hostfile or _env.hostfile()
    if not source:
        parser.error("give a host file, or set DDPTRAIN_HOSTFILE")
    try:
        if source == SLURM:
            hosts = allocation_hosts()
        else:
            hosts = [h if is_local(h) else with_ssh_config(h, _env.ssh_config_path()) for h in parse_hosts(source)]
    except DdpTrainError as exc:
        print(f"ddptrain check: {exc}", file=sys.stderr)
        return 2
    rows, healthy = check_hosts(hosts)
    _print_table(rows)
    print("\nall hosts are ready" if healthy else "\nsome hosts are not ready (see above)")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
