"""The dashboard in a real headless browser (Debian's chromium + chromedriver, via Selenium):
the runs table, a failed run's root cause, a live run's chart gaining points, no console
errors; and the server refusing paths outside the storage folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.dashboard import Dashboard
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
    proc = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": ROOT})
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
        proc.wait(timeout=60)


def test_the_server_serves_only_runs_of_its_storage_folder(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    (storage / "real").mkdir(parents=True)
    (storage / "real" / "run.json").write_text(json.dumps({"name": "real", "status": "FINISHED"}))
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "run.json").write_text(json.dumps({"name": "secret"}))
    (storage / "link").symlink_to(outside)
    dashboard = Dashboard(str(storage), port=0).start()
    try:
        assert [r["name"] for r in json.load(urllib.request.urlopen(dashboard.url + "api/runs"))] == ["real"]
        assert json.load(urllib.request.urlopen(dashboard.url + "api/runs/real"))["status"] == "FINISHED"
        for path in ("api/runs/..%2Fsecret", "api/runs/link", "api/runs/%2Ftmp", "api/runs/..", "etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(dashboard.url + path)
            assert info.value.code == 404, path
        request = urllib.request.Request(dashboard.url + "api/runs", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request)
        assert info.value.code == 501  # read-only: no method but GET exists
    finally:
        dashboard.stop()
