"""``ddptrain dashboard``: a read-only web page of the runs in one storage folder.

A standard-library HTTP server (no web framework) on 127.0.0.1 by default. The page polls
small JSON endpoints and draws its charts itself (SVG, no script from elsewhere):

* ``GET /`` the page; ``GET /api/runs`` every run's summary (``ddptrain runs --json``);
* ``GET /api/runs/<name>`` one run: summary, its last reports (``rows``, up to ``keep``;
  ``next``: where the metrics file's next line starts), the latest attempt's log tails;
* ``GET /api/runs/<name>/metrics?offset=B&after=N`` the reports from byte ``B`` of the metrics
  file (a ``next`` of an earlier answer), numbered from ``N + 1``; and the new ``next``.

No request's work grows with a run's history (see :mod:`ddptrain.storage.metrics`).

Who can read it: each start makes a new token, part of the URL it prints
(``http://127.0.0.1:8278/?token=...``, as Jupyter does); the page sends it with each request
(``Authorization: Token ...``; ``?token=`` works too). A request without it gets 403, and so
does one whose ``Host`` is not this machine's loopback address and port (a page elsewhere whose
DNS name is rebound to 127.0.0.1 cannot read it). The dashboard writes no file.

Only direct children of the storage folder are served, through :mod:`ddptrain.storage.run_files` (no
link is followed, only regular files are read). Nothing can be written through it.

Requests are served by a few threads; a connection waits in one selector, not in a thread,
until its whole request has arrived, which must be within ``request_timeout_s`` of its first
byte (see :mod:`ddptrain.cli.dashboard_server`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from ddptrain.cli.dashboard_server import PooledHTTPServer, ReadRequestHandler
from ddptrain.cli.runs import list_runs, report_row, run_summary
from ddptrain.storage import run_files
from ddptrain.storage.metrics import MetricsSummary
from ddptrain.storage.read import RunView
from ddptrain.storage.remote import on_remote_storage

__all__ = ["DEFAULT_PORT", "Dashboard", "serve"]

_logger = logging.getLogger(__name__)

# Not Ray's dashboard (8265) nor TensorBoard (6006).
DEFAULT_PORT = 8278
_TAIL_LINES = 40
_CHART_REPORTS = 10_000  # the reports a run's page starts with (its latest)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD = ("", "0.0.0.0", "::")


def _page() -> bytes:
    """The page (``dashboard.html`` next to this module)."""
    return (Path(__file__).parent / "dashboard.html").read_bytes()


def _strict(value: Any) -> Any:
    """``value`` for strict JSON (a browser's): non-finite numbers become text ("NaN")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _log_tails(view: RunView) -> dict[str, Any]:
    """The last lines of each rank's log of the latest attempt (a log that is not read says why)."""
    try:
        attempts = view.attempts()
        ranks = view.log_ranks(attempts[-1]) if attempts else []
    except run_files.RunFileError as exc:
        return {"attempt": None, "ranks": {}, "problem": str(exc)}
    tails = {}
    for rank in ranks:
        try:
            f = view.open_log(attempts[-1], rank)
            if f is None:
                continue
            with f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
                lines = f.read(64 * 1024).decode("utf-8", errors="replace").splitlines()
        except OSError as exc:  # RunFileError among them
            lines = [f"(not read: {exc})"]
        tails[str(rank)] = lines[-_TAIL_LINES:]
    return {"attempt": attempts[-1] if attempts else None, "ranks": tails}


def _allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` headers answered: loopback names, and the address listened on."""
    names = {"127.0.0.1", "localhost", "[::1]"}
    if host in _WILDCARD:
        names |= {socket.gethostname(), socket.getfqdn()}
    elif host not in _LOOPBACK:
        names.add(f"[{host}]" if ":" in host else host)
    allowed = {f"{name}:{port}".lower() for name in names}
    return frozenset(allowed | ({name.lower() for name in names} if port == 80 else set()))


class _Handler(ReadRequestHandler):
    dashboard: Dashboard  # set on the subclass each dashboard makes

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.dashboard._get(self)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        _logger.debug("dashboard: " + format, *args)


class Dashboard:
    """The dashboard's server for ``storage_path`` (started with :meth:`start`).

    Args:
        storage_path: The folder whose runs are shown.
        host: The address to listen on (127.0.0.1: this machine only).
        port: The port (0: any free one).
        workers: The threads that serve requests.
        idle_timeout_s: How long a connection may stay without sending anything, and the bound
            on each write of an answer.
        request_timeout_s: How long a request's line and headers may take to arrive, from its
            first byte (a client that trickles them is closed then).
        max_connections: The most connections open at once.
    """

    def __init__(
        self,
        storage_path: str,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        workers: int = 8,
        idle_timeout_s: float = 10.0,
        request_timeout_s: float = 5.0,
        max_connections: int = 128,
    ) -> None:
        self.root = Path(storage_path.removeprefix("file://")).expanduser().resolve()
        self.token = secrets.token_urlsafe(24)  # this start's, never written anywhere
        handler = type("Handler", (_Handler,), {"dashboard": self, "timeout": idle_timeout_s})
        self.server = PooledHTTPServer(
            (host, port),
            handler,
            workers=workers,
            idle_timeout_s=idle_timeout_s,
            request_timeout_s=request_timeout_s,
            max_connections=max_connections,
        )
        self._hosts = _allowed_hosts(host, self.port)
        self._host = host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def base_url(self) -> str:
        """The server's address, without the token."""
        host = socket.gethostname() if self._host in _WILDCARD else self._host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/"

    @property
    def url(self) -> str:
        """The page's address, with the token (what ``ddptrain dashboard`` prints)."""
        return f"{self.base_url}?token={self.token}"

    def start(self) -> Dashboard:
        self._thread = threading.Thread(target=self.server.serve_forever, name="ddptrain-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ----------------------------------------------------------------- requests
    def _run_view(self, name: str) -> RunView | None:
        """The run folder ``name`` directly under the storage folder, or ``None``."""
        if not name or any(c in name for c in "/\\\0") or name in (".", "..") or len(name.encode()) > 255:
            return None
        path = self.root / name
        return RunView(path, str(path)) if run_files.is_run(path) else None

    def _authorized(self, request: BaseHTTPRequestHandler, query: str) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "token":
            given = urllib.parse.parse_qs(query).get("token", [""])[-1]
        return hmac.compare_digest(given.strip().encode(), self.token.encode())

    def _get(self, request: BaseHTTPRequestHandler) -> None:
        try:
            self._answer(request)
        except OSError:  # the connection is gone (or timed out): no one to answer
            pass
        except Exception:
            _logger.warning("ddptrain dashboard: GET %.200s failed", request.path, exc_info=True)
            try:
                self._json(request, {"error": "internal error (the dashboard's log has the traceback)"}, 500)
            except OSError:
                pass

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        hosts = request.headers.get_all("Host") or []
        if len(hosts) != 1 or hosts[0].strip().lower() not in self._hosts:
            message = f"this dashboard answers requests to {self.base_url} (or localhost) only"
            return self._json(request, {"error": message}, 403)
        url = urllib.parse.urlsplit(request.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if parts == ["favicon.ico"]:
            return self._send(request, 204, b"", "image/x-icon")
        if not self._authorized(request, url.query):
            message = "open the URL with the token that `ddptrain dashboard` printed when it started"
            return self._json(request, {"error": message}, 403)
        if not parts:
            return self._send(request, 200, _page(), "text/html; charset=utf-8")
        if parts == ["api", "runs"]:
            return self._json(request, list_runs(str(self.root)))
        view = self._run_view(parts[2]) if len(parts) in (3, 4) and parts[:2] == ["api", "runs"] else None
        if view is None:
            return self._json(request, {"error": "no such run" if parts[:2] == ["api", "runs"] else "not found"}, 404)
        try:
            if len(parts) == 3:
                return self._json(request, self._run(view))
            if parts[3] == "metrics":
                query = urllib.parse.parse_qs(url.query)
                offset, after = (int(query.get(key, ["0"])[-1]) for key in ("offset", "after"))
                lines, end = view.metrics_after(offset)
                rows = [report_row(after + i, line) for i, line in enumerate(lines, start=1)]
                return self._json(request, {"rows": rows, "next": end})
        except run_files.RunFileError as exc:
            return self._json(request, {"error": str(exc)}, 422)
        except ValueError as exc:
            return self._json(request, {"error": f"bad request: {exc}"}, 400)
        return self._json(request, {"error": "not found"}, 404)

    @staticmethod
    def _run(view: RunView) -> dict[str, Any]:
        """One run's page: its summary, last reports and log tails."""
        summary = run_summary(view)
        try:
            lines, metrics = view.metrics_tail(_CHART_REPORTS)
        except run_files.RunFileError:  # the summary's problem says so
            lines, metrics = [], MetricsSummary()
        first = metrics.reports - len(lines) + 1
        summary["rows"] = [report_row(first + i, line) for i, line in enumerate(lines)]
        summary["next"] = metrics.offset
        summary["keep"] = _CHART_REPORTS  # the page keeps the latest as more arrive
        summary["logs"] = _log_tails(view)
        return summary

    def _json(self, request: BaseHTTPRequestHandler, data: Any, status: int = 200) -> None:
        self._send(request, status, json.dumps(_strict(data), default=str).encode(), "application/json")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.send_header("Referrer-Policy", "no-referrer")
        request.send_header("X-Content-Type-Options", "nosniff")
        # The page's own script and styles only; nothing from elsewhere, and in no one's frame.
        request.send_header(
            "Content-Security-Policy",
            "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; frame-ancestors 'none'",
        )
        request.end_headers()
        request.wfile.write(body)


def folder_problem(storage_path: str, given: bool) -> str | None:
    """Why ``storage_path`` cannot be served (as ``ddptrain runs`` says it), or ``None``.

    A folder the user named (``given``) must exist and be a folder of runs; the default one
    (``DDPTRAIN_STORAGE_PATH`` or ``~/ddptrain_results``) may appear later, with the first run.
    """
    if on_remote_storage(storage_path):
        return "the dashboard serves a folder of this machine, not a URI (`ddptrain runs URI` reads one)"
    folder = Path(storage_path.removeprefix("file://")).expanduser()
    if not folder.exists():
        return "no such folder (give the storage path the runs were saved under)" if given else None
    if not folder.is_dir():
        return "not a folder (give the storage path the runs were saved under)"
    if (folder / "run.json").is_file():
        return f"is a run, not a folder of runs: give {folder.resolve().parent}"
    return None


def serve(storage_path: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, given: bool = True) -> int:
    """Run the dashboard until Ctrl-C; 1 at once when ``storage_path`` cannot be served
    (:func:`folder_problem`; ``given``: the user named it)."""
    problem = folder_problem(storage_path, given)
    if problem is not None:
        joint = " " if problem.startswith("is a run") else ": "
        print(f"ddptrain dashboard: {storage_path}{joint}{problem}", file=sys.stderr)
        return 1
    try:
        dashboard = Dashboard(storage_path, host, port)
    except OSError as exc:
        print(f"ddptrain dashboard: cannot listen on {host}:{port}: {exc} (choose another --port)")
        return 2
    if host not in _LOOPBACK:
        print(
            f"ddptrain dashboard: listening on {host}: anyone who can reach it and has the URL below can read "
            "these runs' metrics and logs"
        )
    if not dashboard.root.exists():
        print(f"ddptrain dashboard: {dashboard.root} does not exist yet; its runs appear once they start")
    print(f"ddptrain dashboard: runs in {dashboard.root}; open {dashboard.url} (Ctrl-C stops it)", flush=True)
    try:
        dashboard.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.server.server_close()
    return 0
