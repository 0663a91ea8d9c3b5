"""Every code block of the documentation is checked: each Python block of README.md and
docs/*.md runs (parsed and evaluated by Sybil, in order, one namespace per page, as a reader
would paste them into one script), and each `ddptrain ...` command of a shell block uses a
subcommand and flags that the real `ddptrain <subcommand> --help` lists.

A Python block that cannot run here (it needs a GPU, SSH hosts, S3 or a framework that is not
installed) is preceded by a Sybil skip directive with its reason, e.g.
``<!-- skip: next "needs SSH hosts: tests/test_ssh.py runs the same" -->`` or
``<!-- skip: next if(not has("tensorflow"), reason="needs TensorFlow") -->``; a skip without a
reason fails this test. The run's summary line counts the executed and the skipped blocks.

All pages run in one test, inside one ``reuse_workers()`` block, so that the fits of every
page share one warm worker group (a page's fits are ~50 ms each then, not ~3 s); set
``DDPTRAIN_DOCS_PAGES=datasets.md,tune.md`` to run only some pages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import time
import traceback
from pathlib import Path
from unittest import SkipTest

import pytest

if importlib.util.find_spec("sybil") is None:
    if os.environ.get("DDPTRAIN_REQUIRE_DOCS") == "1":
        raise ImportError('DDPTRAIN_REQUIRE_DOCS=1 but sybil is not installed (pip install -e ".[docs]")')
    pytest.skip('sybil is not installed (pip install -e ".[docs]")', allow_module_level=True)

from sybil import Document, Sybil  # noqa: E402
from sybil.evaluators.skip import Skipper  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser  # noqa: E402

import ddptrain  # noqa: E402
from ddptrain.cli.main import main as cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGUAGES = ("bash", "sh", "console", "shell")


def _has(module: str) -> bool:
    """For skip conditions: whether ``module`` can be imported here."""
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    """For skip conditions: whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def _python_pages() -> Sybil:
    return Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])


def _name(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


def test_doc_python_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property) -> None:
    only = {p for p in os.environ.get("DDPTRAIN_DOCS_PAGES", "").split(",") if p}
    pages = [p for p in PAGES if not only or p.name in only]
    # A reader's machine: results under ~ go to a fresh home, files land in a fresh folder.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DDPTRAIN_STORAGE_PATH", raising=False)
    monkeypatch.delenv("DDPTRAIN_HOSTFILE", raising=False)
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    parser = _python_pages()
    executed: list[str] = []
    skipped: list[str] = []
    failures: list[str] = []
    seconds: dict[str, float] = {}
    with ddptrain.reuse_workers():
        for page in pages:
            shutil.rmtree(tmp_path / "home" / "ddptrain_results", ignore_errors=True)  # each page: no earlier runs
            document: Document = parser.parse(page)
            document.namespace.update(__name__="__main__", has=_has, cuda=_cuda)
            start = time.monotonic()
            for example in document:
                where = _name(page, example.line)
                if isinstance(example.region.evaluator, Skipper):
                    action, reason = example.parsed
                    if action in ("start", "next") and not reason:
                        failures.append(f"{where}: `skip: {action}` without a reason; say why it cannot run here")
                        break
                try:
                    example.evaluate()
                except SkipTest as exc:
                    skipped.append(f"{where}: {exc}")
                except Exception:  # every block's failure is reported, not only the first
                    failures.append(f"{where}:\n{traceback.format_exc()}")
                    break  # later blocks of the page build on this one
                else:
                    if not isinstance(example.region.evaluator, Skipper):
                        executed.append(where)
            seconds[str(page.relative_to(ROOT))] = round(time.monotonic() - start, 1)
    summary = {"executed": len(executed), "skipped": skipped, "seconds": seconds}
    record_property("doc_blocks", json.dumps(summary))
    print(f"doc blocks: {len(executed)} executed, {len(skipped)} skipped; seconds per page: {seconds}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    assert executed or only, "no documentation block ran"


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main([*argv, "--help"])
    return out.getvalue()


def _commands(source: str) -> list[list[str]]:
    """The `ddptrain ...` and `python -m ddptrain ...` commands of a shell block."""
    found = []
    for line in source.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        words = shlex.split(line.split(" #")[0], comments=False)
        if words[:1] == ["ddptrain"]:
            found.append(words[1:])
        elif words[:3] == ["python", "-m", "ddptrain"]:
            found.append(words[3:])
    return found


def test_doc_shell_blocks_match_the_cli_help(record_property) -> None:
    """Each `ddptrain <subcommand> --flag` shown in a shell block exists in that --help."""
    subcommands = set(re.findall(r"\{([a-z,]+)\}", _help([]))[0].split(","))
    parser = Sybil(parsers=[CodeBlockParser(language=language) for language in SHELL_LANGUAGES])
    checked, problems = 0, []
    for page in PAGES:
        for example in parser.parse(page):
            for words in _commands(example.parsed):
                where = _name(page, example.line)
                if not words or words[0] not in subcommands:
                    problems.append(
                        f"{where}: `ddptrain {' '.join(words)}`: no such subcommand ({sorted(subcommands)})"
                    )
                    continue
                if words[0] == "run":  # what follows the script is the script's own
                    script = next(
                        (i for i in range(1, len(words)) if not words[i].startswith("-") and words[i - 1] != "--hosts"),
                        len(words),
                    )
                    words = words[:script]
                if words[0] == "submit":  # sbatch's options, then the script's own
                    words = words[:1]
                usage = _help([words[0]])
                for word in words[1:]:
                    flag = word.strip("[]").split("=")[0]
                    if flag.startswith("-") and not re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", usage):
                        problems.append(f"{where}: `ddptrain {words[0]} {flag}` is not in `ddptrain {words[0]} --help`")
                checked += 1
    record_property("doc_shell_commands", checked)
    assert not problems, "\n".join(problems)
    assert checked >= 5, f"only {checked} ddptrain commands found in the docs' shell blocks"
