"""The dashboard in a real headless browser (Debian's chromium + chromedriver, via Selenium):
the runs table, a failed run's root cause, a live run's chart gaining points, no console
errors; and the server refusing paths outside the storage folder."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_driver import ForkedDriver
from run_folders import write_run

import ddptrain as train
from ddptrain.cli import dashboard as dashboard_module
from ddptrain.cli import dashboard_server
from ddptrain.cli.dashboard import Dashboard
from ddptrain.torch import TorchTrainer

ROOT = str(Path(__file__).resolve().parent.parent)
SCREENSHOTS = os.environ.get("DDPTRAIN_DASHBOARD_SCREENSHOTS")  # a folder: save a screenshot of each page


def _why_no_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    if not shutil.which("chromedriver") or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    reason = _why_no_browser()
    if reason:
        if os.environ.get("DDPTRAIN_REQUIRE_BROWSER") == "1":
            pytest.fail(f"DDPTRAIN_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The browser outlives single tests: it must not carry the tag that marks a test's leftovers.
    env = {k: v for k, v in os.environ.items() if k != "DDPTRAIN_TEST_TAG"}
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver"), env=env), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def reports(config: dict) -> None:
    for step in range(3):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "w").write_text(str(step))
            checkpoint = train.Checkpoint.from_directory(folder)
            train.report({"loss": 1.0 / (step + 1), "step": step}, checkpoint=checkpoint)
    if config.get("fail"):
        raise ValueError("the shard was empty")


def make_runs(storage: str) -> None:
    for name, fail in (("good", False), ("broken", True)):
        trainer = TorchTrainer(
            reports,
            train_loop_config={"fail": fail},
            scaling_config=train.ScalingConfig(num_workers=2),
            run_config=train.RunConfig(storage_path=storage, name=name),
        )
        if fail:
            with pytest.raises(train.TrainingFailedError):
                trainer.fit()
        else:
            trainer.fit()


def wait_for(condition, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out waiting in the browser")


def console_errors(driver) -> list[str]:  # type: ignore[no-untyped-def]
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def fresh(driver) -> None:  # type: ignore[no-untyped-def]
    """A blank page and no console messages left from an earlier test's page."""
    driver.get("about:blank")
    driver.get_log("browser")


def shot(driver, name: str) -> None:  # type: ignore[no-untyped-def]
    if SCREENSHOTS:
        driver.save_screenshot(os.path.join(SCREENSHOTS, name))


@pytest.mark.timeout(180)
def test_the_runs_table_and_a_failed_runs_root_cause(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    storage = str(tmp_path / "runs")
    make_runs(storage)
    dashboard = Dashboard(storage, port=0).start()
    fresh(browser)
    try:
        browser.get(dashboard.url)
        rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#runs tr.run"))
        table = {r.get_attribute("data-name"): r.text for r in rows}
        assert set(table) == {"good", "broken"}
        assert "FINISHED" in table["good"] and "loss=0.3333 step=2" in table["good"]
        assert "ERRORED" in table["broken"]
        shot(browser, "dashboard-runs.png")
        next(r for r in rows if r.get_attribute("data-name") == "broken").click()
        error = wait_for(lambda: browser.find_elements(By.ID, "error"))[0]
        assert "attempt 0 failed: rank" in error.text and "ValueError: the shard was empty" in error.text
        assert browser.find_element(By.ID, "status").text == "ERRORED"
        charts = {c.get_attribute("data-metric") for c in browser.find_elements(By.CSS_SELECTOR, ".chart")}
        assert charts == {"loss", "step"}
        assert "checkpoint_000003" in browser.page_source
        shot(browser, "dashboard-run.png")
        assert console_errors(browser) == []
        fresh(browser)  # stop polling before the server goes
    finally:
        dashboard.stop()


def unreadable_runs(storage: Path) -> dict[str, str]:
    """A storage folder with good runs and runs someone else wrote badly; returns each bad
    run's name and what its problem must say."""
    write_run(storage / "good", metrics=[{"loss": 0.5, "step": 0}, {"loss": 0.25, "step": 1}])
    write_run(storage / "diverged", metrics=[{"loss": 0.5}, {"loss": math.nan}])  # a NaN loss is a real run's
    write_run(storage / "not-json", b'{"status": "FINISHED", ')
    write_run(storage / "not-utf8", b'{"status": "\xff"}')
    write_run(storage / "a-list", [1, 2])
    write_run(storage / "wrong-types", {"status": 5, "started": "yesterday", "attempt": "x", "hosts": "h"})
    write_run(storage / "foreign-lines", metrics=['{"metrics": 5}', "[1, 2]"])
    write_run(storage / "fifo")
    os.mkfifo(storage / "fifo" / "metrics.jsonl")
    write_run(storage / "bad-index")
    (storage / "bad-index" / "checkpoints.json").write_text("{")
    return {
        "not-json": "run.json is not JSON",
        "not-utf8": "run.json is not JSON",
        "a-list": "run.json holds a JSON list, not an object",
        "wrong-types": "`status` is '5', `started` is 'yesterday', `attempt` is 'x', `hosts` is 'h'",
        "foreign-lines": "metrics.jsonl: 2 line(s) are not reports",
        "fifo": "metrics.jsonl is a FIFO, not a regular file",
        "bad-index": "Cannot read the checkpoint index",
    }


@pytest.mark.timeout(180)
def test_unreadable_runs_are_shown_as_such_beside_the_others(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    storage = tmp_path / "runs"
    bad = unreadable_runs(storage)
    dashboard = Dashboard(str(storage), port=0).start()
    fresh(browser)
    try:
        browser.get(dashboard.url)
        rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#runs tr.run"))
        table = {r.get_attribute("data-name"): r.text for r in rows}
        assert set(table) == {"good", "diverged", *bad}
        assert "FINISHED" in table["good"] and "loss=0.25 step=1" in table["good"]
        assert "FINISHED" in table["diverged"] and "loss=NaN" in table["diverged"]
        for name, problem in bad.items():
            assert "UNREADABLE" in table[name] and problem in table[name], name
        shot(browser, "dashboard-unreadable.png")
        errors = console_errors(browser)
        for name in ("wrong-types", "fifo", "diverged"):
            fresh(browser)
            browser.get(dashboard.url + "#run=" + name)
            status = wait_for(lambda: browser.find_elements(By.ID, "status"))[0]
            assert status.text == ("FINISHED" if name == "diverged" else "UNREADABLE")
            if name != "diverged":
                assert bad[name] in browser.find_element(By.ID, "problem").text
            errors += console_errors(browser)
        assert errors == []
        fresh(browser)  # stop polling before the server goes
    finally:
        dashboard.stop()


LIVE = textwrap.dedent(
    """
    import time
    import ddptrain as train
    from ddptrain.torch import TorchTrainer

    def slow():
        for step in range(24):
            train.report({"step": step, "loss": 1.0 / (step + 1)})
            time.sleep(0.25)

    TorchTrainer(slow, scaling_config=train.ScalingConfig(num_workers=1),
                 run_config=train.RunConfig(storage_path=STORAGE, name="live")).fit()
    """
)


@pytest.mark.timeout(180)
def test_a_running_runs_chart_gains_points(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    storage = tmp_path / "runs"
    script = tmp_path / "live.py"
    script.write_text(LIVE.replace("STORAGE", repr(str(storage))))
    proc = ForkedDriver(script, [], stderr="inherit")  # a driver process of its own, forked
    dashboard = Dashboard(str(storage), port=0).start()
    fresh(browser)
    try:
        metrics = storage / "live" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.stat().st_size, 60)
        browser.get(dashboard.url + "#run=live")

        def points() -> int:  # read in the page: the charts are redrawn as points arrive
            found = "document.querySelector(\".chart[data-metric='step'] svg\")"
            script = f"const s = {found}; return s ? +s.dataset.points : 0"
            return int(browser.execute_script(script))

        first = wait_for(points)
        assert browser.find_element(By.ID, "status").text == "RUNNING"
        wait_for(lambda: points() >= first + 3)
        assert console_errors(browser) == []
        fresh(browser)  # stop polling before the server goes
    finally:
        dashboard.stop()
        proc.communicate(timeout=60)


def api(dashboard: Dashboard, path: str, *, token: str | None = "", host: str | None = None, timeout_s: float = 20):  # type: ignore[no-untyped-def]
    """A raw GET (http.client): ``(status, parsed JSON body)``; the dashboard's token unless
    ``token`` says otherwise (``None``: none), ``Host: 127.0.0.1:PORT`` unless ``host``."""
    port = dashboard.server.server_address[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    headers = {"Host": host or f"127.0.0.1:{port}"}
    if token is not None:
        headers["Authorization"] = f"Token {token or getattr(dashboard, 'token', '')}"
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    is_json = response.getheader("Content-Type") == "application/json"
    return response.status, json.loads(body) if is_json else body


def test_the_server_serves_only_runs_of_its_storage_folder(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    write_run(storage / "real")
    outside = tmp_path / "secret"
    write_run(outside, {"name": "secret"})
    (storage / "link").symlink_to(outside)
    dashboard = Dashboard(str(storage), port=0).start()
    try:
        assert [r["name"] for r in api(dashboard, "/api/runs")[1]] == ["real"]
        assert api(dashboard, "/api/runs/real")[1]["status"] == "FINISHED"
        for path in ("/api/runs/..%2Fsecret", "/api/runs/link", "/api/runs/%2Ftmp", "/api/runs/..", "/etc/passwd"):
            assert api(dashboard, path)[0] == 404, path
        request = urllib.request.Request(
            f"http://127.0.0.1:{dashboard.server.server_address[1]}/api/runs", data=b"x", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request)
        assert info.value.code == 501  # read-only: no method but GET exists
    finally:
        dashboard.stop()


def test_requests_need_this_starts_token_and_a_loopback_host(tmp_path: Path) -> None:
    write_run(tmp_path / "runs" / "mine", metrics=[{"loss": 0.5}])
    dashboard = Dashboard(str(tmp_path / "runs"), port=0).start()
    try:
        for path in ("/", "/api/runs", "/api/runs/mine", "/api/runs/mine/metrics?offset=0"):
            for token in (None, "wrong"):
                status, body = api(dashboard, path, token=token)
                assert status == 403 and "the token that `ddptrain dashboard` printed" in body["error"], (path, token)
        port = dashboard.server.server_address[1]
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.2", f"10.1.2.3:{port}"):
            status, body = api(dashboard, "/api/runs", host=host)  # a DNS-rebinding page's requests
            assert status == 403 and "answers requests to http://127.0.0.1" in body["error"], host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
            status, body = api(dashboard, "/api/runs", host=host)
            assert status == 200 and body[0]["name"] == "mine", host
        assert dashboard.url == f"{dashboard.base_url}?token={dashboard.token}" and len(dashboard.token) >= 32
        status, page = api(dashboard, f"/?token={dashboard.token}", token=None)  # the printed URL
        assert status == 200 and b"ddptrain dashboard" in page
        other = Dashboard(str(tmp_path / "runs"), port=0)  # another start: another token
        other.server.server_close()
        assert other.token != dashboard.token and api(dashboard, "/api/runs", token=other.token)[0] == 403
    finally:
        dashboard.stop()


def _user_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root to add a second Unix user"
    if not (shutil.which("useradd") and shutil.which("userdel")):
        return "needs useradd and userdel"
    return None


@pytest.mark.skipif(_user_tools() is not None, reason=str(_user_tools()))
@pytest.mark.timeout(120)
def test_a_second_unix_user_cannot_read_the_runs_it_serves(tmp_path: Path) -> None:
    """`ddptrain dashboard` as root, on root's private runs; another local user knows the port
    (anyone can list listening sockets) and tries to read them through it."""
    storage = tmp_path / "runs"
    write_run(storage / "private", metrics=[{"secret_metric": 42}])
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "HOME": str(home), "DDPTRAIN_CACHE_DIR": str(cache)}
    user = f"ddpt{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user], check=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddptrain", "dashboard", str(storage), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = urllib.parse.urlsplit(re.search(r"(http://\S+)", line).group(1))  # type: ignore[union-attr]
        port, token = url.port, urllib.parse.parse_qs(url.query).get("token", [""])[0]
        probe = textwrap.dedent(
            f"""
            import http.client, json, sys
            def get(path, headers):
                c = http.client.HTTPConnection("127.0.0.1", {port}, timeout=10)
                c.request("GET", path, headers=headers)
                r = c.getresponse()
                return r.status, r.read().decode()
            out = {{"plain": get("/api/runs", {{}}), "page": get("/", {{}}), "run": get("/api/runs/private", {{}})}}
            for name in ("cmdline", "environ"):
                try:
                    out[name] = open("/proc/{proc.pid}/" + name, "rb").read().decode(errors="replace")
                except OSError as exc:
                    out[name] = type(exc).__name__
            out["token"] = get("/api/runs/private", {{"Authorization": "Token " + sys.argv[1]}})
            print(json.dumps(out))
            """
        )
        found = subprocess.run(
            ["/usr/bin/python3", "-I", "-c", probe, token],
            user=user,
            group=user,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin", "DDPTRAIN_TEST_TAG": os.environ["DDPTRAIN_TEST_TAG"]},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert found.returncode == 0, found.stderr
        out = json.loads(found.stdout)
        for request in ("plain", "page", "run"):
            assert out[request][0] == 403 and "secret_metric" not in out[request][1], out[request]
        assert token not in out["cmdline"] and out["environ"] == "PermissionError"
        # The token is the whole difference: with it (which only root's terminal saw), it reads.
        assert out["token"][0] == 200 and "secret_metric" in out["token"][1]
        assert not cache.exists() and list(home.iterdir()) == []  # it wrote no file at all
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stdout.close()  # type: ignore[union-attr]
        subprocess.run(["userdel", user], check=False)


@pytest.mark.timeout(120)
def test_idle_connections_neither_take_a_thread_each_nor_block_requests(tmp_path: Path) -> None:
    write_run(tmp_path / "runs" / "mine", metrics=[{"loss": 0.5}])
    dashboard = Dashboard(str(tmp_path / "runs"), port=0).start()
    idle: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", dashboard.server.server_address[1]), timeout=10))
        time.sleep(1.0)
        assert threading.active_count() - before <= 10  # a few pool threads, not one per connection
        status, runs = api(dashboard, "/api/runs", timeout_s=10)  # the 301st connection is answered
        assert status == 200 and runs[0]["name"] == "mine"
        assert threading.active_count() - before <= 10
    finally:
        for conn in idle:
            conn.close()
        dashboard.stop()


def _until_closed(conn: socket.socket) -> bytes:
    """What the server sent until it closed ``conn`` (a reset counts as closed)."""
    data = b""
    try:
        while chunk := conn.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_an_idle_stalled_or_oversized_request_is_closed(tmp_path: Path) -> None:
    dashboard = Dashboard(str(tmp_path), port=0, idle_timeout_s=0.5, request_timeout_s=0.5).start()
    try:
        big = b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (dashboard_server.MAX_HEAD_BYTES + 100)
        for opening, answer in (
            (b"", b""),  # nothing: closed without a word
            (b"GET /api/runs HTTP/1.1\r\n", b"HTTP/1.0 408 Request Timeout"),  # a request that stalls
            (big, b"HTTP/1.0 431 Request Header Fields Too Large"),
        ):
            with socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) as conn:
                conn.sendall(opening)
                started = time.monotonic()
                got = _until_closed(conn)  # closed by the server, long before our own 10 s
                assert time.monotonic() - started < 8
                assert got.startswith(answer) and (b"did not arrive within 0.5 s" in got) == (b"408" in answer), got
    finally:
        dashboard.stop()


@pytest.mark.timeout(120)
def test_clients_that_trickle_their_requests_hold_no_thread(tmp_path: Path) -> None:
    """50 connections that send their request a byte every 0.5 s: a normal request is answered
    meanwhile, and each of them is closed (408) once its request takes `request_timeout_s`."""
    write_run(tmp_path / "runs" / "mine", metrics=[{"loss": 0.5}])
    request_timeout_s = 4.0
    dashboard = Dashboard(str(tmp_path / "runs"), port=0, request_timeout_s=request_timeout_s).start()
    headers = f"Host: 127.0.0.1:{dashboard.port}\r\nAuthorization: Token {dashboard.token}\r\n"
    request = f"GET /api/runs HTTP/1.1\r\n{headers}\r\n"
    tricklers = [socket.create_connection(("127.0.0.1", dashboard.port), timeout=10) for _ in range(50)]
    first_byte: dict[socket.socket, float] = {}
    closed: dict[socket.socket, tuple[float, bytes]] = {}  # when, and what it got
    stop = threading.Event()

    def trickle() -> None:
        for byte in request.encode():
            for conn in tricklers:
                if conn not in closed:
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        pass
                    first_byte.setdefault(conn, time.monotonic())
            ends = time.monotonic() + 0.5
            while time.monotonic() < ends and len(closed) < len(tricklers) and not stop.is_set():
                ready, _, _ = select.select([c for c in tricklers if c not in closed], [], [], 0.05)
                for conn in ready:
                    closed[conn] = (time.monotonic(), _until_closed(conn))
            if len(closed) == len(tricklers) or stop.is_set():
                return

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        time.sleep(1.5)  # each has sent 3 bytes: before the fix, the 8 pool threads are theirs
        status, runs = api(dashboard, "/api/runs", timeout_s=15)
        assert status == 200 and runs[0]["name"] == "mine"
        assert not closed  # answered while all 50 were open
        thread.join(timeout=request_timeout_s + 15)
        assert len(closed) == len(tricklers), f"{len(tricklers) - len(closed)} trickling connections still open"
        for conn, (when, got) in closed.items():
            assert request_timeout_s - 0.5 < when - first_byte[conn] < request_timeout_s + 6
            assert got.startswith(b"HTTP/1.0 408 Request Timeout"), got
    finally:
        stop.set()
        thread.join(timeout=10)
        for conn in tricklers:
            conn.close()
        dashboard.stop()


def test_a_request_that_fails_gets_an_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_run(tmp_path / "runs" / "mine")
    dashboard = Dashboard(str(tmp_path / "runs"), port=0).start()
    try:
        status, body = api(dashboard, "/api/runs/" + "%2e" * 3000)  # a name too long for the file system
        assert status == 404 and body == {"error": "no such run"}
        status, body = api(dashboard, "/api/runs/mine/metrics?offset=x")
        assert status == 400 and "bad request" in body["error"]

        def fails(storage_path: str) -> list:
            raise RuntimeError("a bug")

        monkeypatch.setattr(dashboard_module, "list_runs", fails)  # whatever a handler may raise
        status, body = api(dashboard, "/api/runs")
        assert status == 500 and "internal error" in body["error"]
        assert api(dashboard, "/api/runs/mine")[0] == 200  # and it goes on serving
    finally:
        dashboard.stop()


def test_links_out_of_a_run_folder_are_not_followed(tmp_path: Path) -> None:
    """A run folder someone else wrote, whose files link to files of the dashboard's user."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "secret.jsonl").write_text(json.dumps({"time": 1, "attempt": 0, "metrics": {"SECRET": 1}}) + "\n")
    (mine / "secret.log").write_text("SECRET log line\n")
    (mine / "run.json").write_text(json.dumps({"name": "SECRET", "status": "FINISHED"}))
    storage = tmp_path / "runs"
    write_run(storage / "linked")
    (storage / "linked" / "metrics.jsonl").symlink_to(mine / "secret.jsonl")
    (storage / "linked" / "logs" / "attempt_0").mkdir(parents=True)
    (storage / "linked" / "logs" / "attempt_0" / "rank_0.log").symlink_to(mine / "secret.log")
    (storage / "linked-json").mkdir()
    (storage / "linked-json" / "run.json").symlink_to(mine / "run.json")
    dashboard = Dashboard(str(storage), port=0).start()
    try:
        status, runs = api(dashboard, "/api/runs")
        assert status == 200 and [r["name"] for r in runs] == ["linked"]  # a linked run.json: not a run
        assert runs[0]["status"] == "UNREADABLE" and "metrics.jsonl is a symbolic link" in runs[0]["problem"]
        status, run = api(dashboard, "/api/runs/linked")
        assert status == 200 and run["rows"] == [] and "never follows a link" in run["logs"]["ranks"]["0"][0]
        status, more = api(dashboard, "/api/runs/linked/metrics?offset=0")
        assert status == 422 and "metrics.jsonl is a symbolic link" in more["error"]
        assert api(dashboard, "/api/runs/linked-json")[0] == 404
        assert "SECRET" not in json.dumps([runs, run, more])
    finally:
        dashboard.stop()


def test_a_runs_page_reads_its_latest_reports_then_only_new_ones(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(dashboard_module, "_CHART_REPORTS", 5, raising=False)  # the page starts with the latest 5
    write_run(tmp_path / "runs" / "long", metrics=[{"step": i} for i in range(20)])
    metrics = tmp_path / "runs" / "long" / "metrics.jsonl"
    dashboard = Dashboard(str(tmp_path / "runs"), port=0).start()
    try:
        status, run = api(dashboard, "/api/runs/long")
        assert [(r["report"], r["step"]) for r in run["rows"]] == [(n + 1, n) for n in range(15, 20)]
        assert status == 200 and run["reports"] == 20 and run["keep"] == 5
        assert run["next"] == metrics.stat().st_size
        assert api(dashboard, f"/api/runs/long/metrics?offset={run['next']}&after=20")[1] == {
            "rows": [],
            "next": run["next"],
        }
        line = json.dumps({"time": 1e9, "attempt": 1, "metrics": {"step": 20}}) + "\n"
        with open(metrics, "a") as f:
            f.write(line + line[:10])  # one more report, and one being written
        status, more = api(dashboard, f"/api/runs/long/metrics?offset={run['next']}&after=20")
        assert [(r["report"], r["step"], r["attempt"]) for r in more["rows"]] == [(21, 20, 1)]
        assert more["next"] == run["next"] + len(line)
        with open(metrics, "a") as f:
            f.write(line[10:])
        status, more = api(dashboard, f"/api/runs/long/metrics?offset={more['next']}&after=21")
        assert [r["report"] for r in more["rows"]] == [22] and more["next"] == metrics.stat().st_size
        assert api(dashboard, "/api/runs/long/metrics?offset=7")[0] == 400  # not where a line ends
    finally:
        dashboard.stop()


def test_a_storage_folder_that_is_not_there_is_said_as_ddptrain_runs_says_it(tmp_path: Path) -> None:
    # `ddptrain dashboard TYPO` served an empty page of a folder that does not exist, and said
    # only "runs in TYPO; open ...": nothing told the user the folder was not there.
    def dashboard(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ddptrain.cli", "dashboard", *args, "--port", "0"]
        return subprocess.run(command, capture_output=True, text=True, timeout=30)

    missing = tmp_path / "typo"
    out = dashboard(str(missing))
    assert out.returncode == 1, out
    assert f"ddptrain dashboard: {missing}: no such folder (give the storage path" in out.stderr, out
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = dashboard(str(a_file))
    assert out.returncode == 1 and f"{a_file}: not a folder" in out.stderr, out
    write_run(tmp_path / "runs" / "one")  # one run's own folder, not a folder of runs
    out = dashboard(str(tmp_path / "runs" / "one"))
    assert out.returncode == 1, out
    assert f"{tmp_path / 'runs' / 'one'} is a run, not a folder of runs: give {tmp_path / 'runs'}" in out.stderr, out
