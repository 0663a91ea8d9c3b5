"""The small Python programs the driver runs on SSH hosts before the agent, and what they read.

Both run with the host's Python, isolated (``-I -S``: nothing from the working directory or
the environment is imported), and are passed as one line (:func:`one_line`).

- :data:`PRESTART` starts every remote program (the agent, the ``ddptrain check`` probe). It
  reads the environment the driver forwards from stdin (:func:`env_frame`), so that no value
  (tokens, API keys) is ever on a command line, which ``ps`` shows to every user of the host;
  prints its pid (:data:`PID_LINE`); and replaces itself with the program, which starts with
  that environment exactly as under ``env K=V ... PROGRAM`` (``PYTHONPATH``,
  ``LD_LIBRARY_PATH``, ``OMP_*`` apply from its first instruction). Unless the user set them,
  it also sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the network interface
  the SSH connection arrived on (the server address in ``SSH_CONNECTION``): gloo otherwise
  binds to what the host name resolves to, and falls back to 127.0.0.1 where it does not
  resolve, which the other hosts cannot reach. Without SSH (a SLURM job step), the interface
  is the one holding this host's address on the route to ``DDPTRAIN_ROUTE_TO`` (the driver's
  address) when the driver names one. A loopback address (a tunnel on the host) or an address
  no interface holds as its primary one leaves both unset. ``DDPTRAIN_UNSET`` (names separated
  by commas, ``NAME*`` for a prefix) removes variables the program would otherwise inherit; both
  of these are read here and never reach the program. A stdout that is a
  terminal (``srun --unbuffered`` gives the step one, see ``ddptrain.launch.slurm``) is put in
  raw mode, so the agent's binary frames pass through it unchanged.
- :data:`STORAGE_PREP` runs before a run starts on a host: it removes the staging folders of
  runs whose agent is gone (their driver was killed before it could remove them), says whether
  the host sees the run directory and, if not, creates this run's staging folder, private
  (0700), recording its owner: the agent's pid and start time on this boot.
"""

from __future__ import annotations

import os
from typing import IO

from ddptrain.errors import ConfigError

__all__ = ["PRESTART", "PID_LINE", "STORAGE_PREP", "STAGING_PREFIX", "env_frame", "one_line"]

PRESTART = r"""
import os, sys
def take(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return data
def interface(address):
    if address.startswith("::ffff:") and "." in address:
        address = address[7:]
    if address.startswith("127.") or address == "::1":
        return None
    import socket
    if ":" in address:
        packed = socket.inet_pton(socket.AF_INET6, address.split("%")[0]).hex()
        with open("/proc/net/if_inet6") as f:
            return next((line.split()[5] for line in f if line.split()[0] == packed), None)
    import fcntl, struct
    packed = socket.inet_aton(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if ifreq[20:24] == packed:
                return name
    return None
def route_source(address):
    import socket
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]
env = dict(os.environb)
server = (os.environb.get(b"SSH_CONNECTION") or b"").split()
size = int.from_bytes(take(4), "big")
for item in take(size).split(b"\0") if size else ():
    key, _, value = item.partition(b"=")
    env[key] = value
for name in env.pop(b"DDPTRAIN_UNSET", b"").split(b","):
    for key in [k for k in env if (k.startswith(name[:-1]) if name.endswith(b"*") else k == name)] if name else ():
        del env[key]
route_to = env.pop(b"DDPTRAIN_ROUTE_TO", b"").decode()
if (len(server) == 4 or route_to) and not (b"GLOO_SOCKET_IFNAME" in env and b"NCCL_SOCKET_IFNAME" in env):
    try:
        name = interface(server[2].decode() if len(server) == 4 else route_source(route_to))
    except Exception:
        name = None
    if name:
        env.setdefault(b"GLOO_SOCKET_IFNAME", name.encode())
        env.setdefault(b"NCCL_SOCKET_IFNAME", name.encode())
if os.isatty(1):
    import tty
    tty.setraw(1)
os.write(1, b"ddptrain-pid %d\n" % os.getpid())
os.execvpe(sys.argv[1], sys.argv[1:], env)
"""
PID_LINE = b"ddptrain-pid "  # then the pid and a newline: the first line a remote program's stdout has


def read_pid_line(stream: IO[bytes]) -> tuple[int | None, str]:
    """The pid a remote program's first stdout line gives (:data:`PID_LINE`), or ``None`` and
    what came instead: a login shell's own words ("This account is currently not available.")
    are the only trace of why it never started."""
    try:
        line = stream.readline()
        if line.startswith(PID_LINE):
            return int(line[len(PID_LINE) :]), ""
    except (OSError, ValueError):
        return None, ""
    return None, line.decode(errors="replace").strip()[:500]


# Each host's staging folder is STAGING_PREFIX + run id.
STAGING_PREFIX = "/tmp/ddptrain-"

# Arguments: run.json, run id, staging folder, agent pid (0: none), a description of the driver.
# Prints {"shared": bool} or {"error": message}.
STORAGE_PREP = r"""
import json, os, shutil, stat, sys
run_json, run_id, cache, pid, driver = sys.argv[1:6]
OWNER = ".ddptrain-owner"
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
def started(pid):
    fields = (read("/proc/%s/stat" % pid) or ")").rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None
boot = (read("/proc/sys/kernel/random/boot_id") or "").strip() or None
def stale(folder):
    try:
        owner = json.loads(read(os.path.join(folder, OWNER)) or "")
    except ValueError:
        return False  # no owner recorded (yet): not ours to judge
    if not isinstance(owner, dict):
        return False
    if not owner.get("pid") or owner.get("start") is None:
        return owner.get("boot") is not None  # recorded without a live agent
    if boot is None:
        return False  # no /proc here: cannot tell
    return owner.get("boot") != boot or started(owner["pid"]) != owner["start"]
uid = os.getuid()
prefix = os.path.basename(cache)[: -len(run_id)]
parent = os.path.dirname(cache)
for name in os.listdir(parent):
    folder = os.path.join(parent, name)
    try:
        info = os.lstat(folder)
    except OSError:
        continue
    if name.startswith(prefix) and stat.S_ISDIR(info.st_mode) and info.st_uid == uid and stale(folder):
        shutil.rmtree(folder, ignore_errors=True)
try:
    shared = json.loads(read(run_json) or "{}").get("run_id") == run_id
except (ValueError, AttributeError):
    shared = False
if not shared:
    try:
        os.mkdir(cache, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(cache)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        print(json.dumps({"error": "%s exists and is not a folder of this user; remove it" % cache}))
        sys.exit()
    os.chmod(cache, 0o700)
    record = {"pid": int(pid) or None, "start": started(pid), "boot": boot, "driver": driver}
    with open(os.path.join(cache, OWNER + ".tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(cache, OWNER + ".tmp"), os.path.join(cache, OWNER))
print(json.dumps({"shared": shared}))
"""


def one_line(code: str) -> str:
    """``code`` as one line for ``python -c``: csh-family login shells reject newlines in quotes."""
    return f"exec({code!r})"


def env_frame(env: dict[str, str]) -> bytes:
    """The environment of a remote program, as :data:`PRESTART` reads it from stdin: a 4-byte
    length, then ``NAME=value`` items separated by NUL.

    Raises:
        ConfigError: A name is empty or holds ``=`` or NUL, or a value holds NUL.
    """
    items = []
    for key, value in sorted(env.items()):
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ConfigError(
                f"environment variable {key!r} cannot be passed to a host: a name must be non-empty without "
                "'=' or NUL, a value without NUL."
            )
        items.append(os.fsencode(key) + b"=" + os.fsencode(value))
    data = b"\0".join(items)
    return len(data).to_bytes(4, "big") + data
