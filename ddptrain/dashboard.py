"""``ddptrain dashboard``: a read-only web page of the runs in one storage folder.

A standard-library HTTP server (no web framework) on 127.0.0.1 by default. The page polls
small JSON endpoints and draws its charts itself (SVG, no script from elsewhere):

* ``GET /`` the page; ``GET /api/runs`` every run's summary (``ddptrain runs --json``);
* ``GET /api/runs/<name>`` one run: summary, every report, the latest attempt's log tails;
* ``GET /api/runs/<name>/metrics?after=N`` the reports after the N-th (live charts).

Only direct children of the storage folder are served: a name with a ``/``, ``..`` or a
symlink that leads elsewhere is a 404. Nothing can be written through it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ddptrain.inspect_runs import export_rows, list_runs, run_summary
from ddptrain.storage import RunLayout

__all__ = ["DEFAULT_PORT", "Dashboard", "serve"]

_logger = logging.getLogger(__name__)

# Not Ray's dashboard (8265) nor TensorBoard (6006).
DEFAULT_PORT = 8278
_TAIL_LINES = 40


def _page() -> bytes:
    """The page (``dashboard.html`` next to this module)."""
    return (Path(__file__).parent / "dashboard.html").read_bytes()


def _log_tails(run_dir: Path) -> dict[str, Any]:
    layout = RunLayout(run_dir)
    attempts = layout.attempts()
    if not attempts:
        return {"attempt": None, "ranks": {}}
    tails = {}
    for rank, path in layout.rank_logs(attempts[-1]).items():
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 64 * 1024))
                lines = f.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            continue
        tails[str(rank)] = lines[-_TAIL_LINES:]
    return {"attempt": attempts[-1], "ranks": tails}


class Dashboard:
    """The dashboard's server for ``storage_path`` (started with :meth:`start`).

    Args:
        storage_path: The folder whose runs are shown.
        host: The address to listen on (127.0.0.1: this machine only).
        port: The port (0: any free one).
    """

    def __init__(self, storage_path: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.root = Path(storage_path).expanduser().resolve()
        dashboard = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                dashboard._get(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                _logger.debug("dashboard: " + format, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://{name}:{port}/"

    def start(self) -> Dashboard:
        self._thread = threading.Thread(target=self.server.serve_forever, name="ddptrain-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ----------------------------------------------------------------- requests
    def _run_dir(self, name: str) -> Path | None:
        """The run folder ``name`` directly under the storage folder, or ``None``."""
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return None
        path = (self.root / name).resolve()
        if path.parent != self.root or not RunLayout(path).run_json.is_file():
            return None
        return path

    def _get(self, request: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(request.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        try:
            if not parts:
                self._send(request, 200, _page(), "text/html; charset=utf-8")
            elif parts == ["favicon.ico"]:
                self._send(request, 204, b"", "image/x-icon")
            elif parts == ["api", "runs"]:
                self._json(request, list_runs(str(self.root)))
            elif len(parts) in (3, 4) and parts[:2] == ["api", "runs"]:
                run_dir = self._run_dir(parts[2])
                if run_dir is None:
                    self._json(request, {"error": "no such run"}, 404)
                elif len(parts) == 3:
                    summary = run_summary(run_dir)
                    summary["rows"] = export_rows(run_dir)
                    summary["logs"] = _log_tails(run_dir)
                    self._json(request, summary)
                elif parts[3] == "metrics":
                    after = int(urllib.parse.parse_qs(url.query).get("after", ["0"])[0])
                    self._json(request, export_rows(run_dir)[after:])
                else:
                    self._json(request, {"error": "not found"}, 404)
            else:
                self._json(request, {"error": "not found"}, 404)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except ValueError:
            self._json(request, {"error": "bad request"}, 400)

    def _json(self, request: BaseHTTPRequestHandler, data: Any, status: int = 200) -> None:
        self._send(request, status, json.dumps(data, default=str).encode(), "application/json")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        # The page's own script and styles only; nothing from elsewhere.
        request.send_header(
            "Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"
        )
        request.end_headers()
        request.wfile.write(body)


def serve(storage_path: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> int:
    """Run the dashboard until Ctrl-C."""
    try:
        dashboard = Dashboard(storage_path, host, port)
    except OSError as exc:
        print(f"ddptrain dashboard: cannot listen on {host}:{port}: {exc} (choose another --port)")
        return 2
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"ddptrain dashboard: listening on {host}: anyone who can reach it can read these runs' metrics and logs")
    print(f"ddptrain dashboard: {dashboard.url} (runs in {dashboard.root}); Ctrl-C stops it", flush=True)
    try:
        dashboard.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.server.server_close()
    return 0
