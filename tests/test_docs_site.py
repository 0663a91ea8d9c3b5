"""The documentation site, built once with `mkdocs build --strict` and served from a local
http.server thread, looked at in a real headless browser (the dashboard tests' Chromium): the
home page, a guide, an API page, and the search box answering a query a user would type. And
the API reference has an entry, with its signature, for every public name of the API modules."""

from __future__ import annotations

import ast
import functools
import http.server
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_dashboard import browser  # noqa: F401 (the module's headless Chromium fixture)

ROOT = Path(__file__).resolve().parent.parent
# Module -> its API page; every name of the module's __all__ must have an entry there.
API_PAGES = {
    "ddptrain": "ddptrain",
    "ddptrain.collective": "ddptrain",
    "ddptrain.torch": "torch",
    "ddptrain.torch.xla": "torch",
    "ddptrain.data": "data",
    "ddptrain.tune": "tune",
    "ddptrain.tune.schedulers": "tune",
    "ddptrain.tune.search": "tune",
    "ddptrain.tune.stopper": "tune",
    "ddptrain.util.sgd": "util-sgd",
    "ddptrain.lightning": "lightning",
    "ddptrain.huggingface": "huggingface",
    "ddptrain.huggingface.transformers": "huggingface",
    "ddptrain.xgboost": "xgboost",
    "ddptrain.lightgbm": "lightgbm",
    "ddptrain.tensorflow": "tensorflow",
    "ddptrain.jax": "jax",
    "ddptrain.integrations.mlflow": "integrations",
    "ddptrain.integrations.wandb": "integrations",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        reason = 'mkdocs is not installed (pip install -e ".[docs]")'
        if os.environ.get("DDPTRAIN_REQUIRE_BROWSER") == "1" or os.environ.get("DDPTRAIN_REQUIRE_DOCS") == "1":
            pytest.fail(f"the docs site must be checked here, but {reason}")
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(folder)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return folder


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass


def _public_names(module: str) -> list[str]:
    path = ROOT / module.replace(".", "/")
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no __all__")


def test_api_reference_has_every_public_name_with_its_signature(site: Path) -> None:
    missing = []
    for module, page in API_PAGES.items():
        html = (site / "api" / page / "index.html").read_text()
        for name in _public_names(module):
            if f"{module}.{name}" in API_PAGES:
                continue  # a submodule: its own entry lists its names
            if f'id="{module}.{name}"' not in html:
                missing.append(f"{module}.{name} (docs/api/{page}.md)")
    assert not missing, "no API reference entry for: " + ", ".join(missing)
    torch_page = (site / "api" / "torch" / "index.html").read_text()
    assert "train_loop_per_worker" in torch_page  # TorchTrainer's signature is shown


def test_home_guide_api_page_and_search_in_a_browser(served: str, browser) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 20)
    browser.get(served + "/")
    assert browser.find_element(By.CSS_SELECTOR, "article h1").text == "ddptrain"
    nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
    for title in ("Getting started", "Checkpoints, failures and resume", "API reference", "Benchmarks"):
        assert title in nav

    browser.get(served + "/checkpoints-and-failures/")
    assert browser.find_element(By.CSS_SELECTOR, "article h1").text.startswith("Checkpoints, failures and resume")
    code = browser.find_element(By.CSS_SELECTOR, "article pre code").text
    assert "train.get_checkpoint()" in code

    browser.get(served + "/api/torch/")
    entry = browser.find_element(By.ID, "ddptrain.torch.TorchTrainer")
    assert entry.is_displayed()
    assert "TorchTrainer" in entry.text

    browser.get(served + "/")
    browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, .md-search__input").click()
    box = wait.until(expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
    box.send_keys("resume from checkpoint")
    box.send_keys(Keys.SPACE)  # search runs as the user types
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a"))
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")]
    assert any("checkpoints-and-failures" in link for link in links), links
