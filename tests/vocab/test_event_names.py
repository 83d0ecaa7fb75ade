"""Event names are a type: the catalogue, the journald catalog, the README and mypy agree on them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

from llama_guard.vocab.events import CATALOG, EVENTS, EventName
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "scripts" / "gen_catalog.py"


def test_the_catalogue_holds_exactly_the_typed_names() -> None:
    names = typing.get_args(EventName)
    assert len(names) == len(set(names))
    assert set(names) == set(CATALOG)
    assert all(spec.name == key for key, spec in CATALOG.items())


def test_each_event_is_declared_once_with_its_catalog_text() -> None:
    names = [spec.name for spec in EVENTS]
    assert len(names) == len(set(names)) == len(CATALOG)
    blank = [spec.name for spec in EVENTS if not spec.subject.strip() or not spec.body.strip()]
    assert not blank, f"give these events a catalog subject and body: {blank}"


def test_the_readme_event_table_lists_every_declared_event_in_order() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Events", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])]
    assert named == [spec.name for spec in EVENTS]


def _gen_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "scripts" / "gen_catalog.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_generated_names_catalog_and_readme_table_are_current() -> None:
    result = _gen_check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_declaration_changed_without_regenerating_is_found_stale(tmp_path: Path) -> None:
    """A copy of the tree whose declarations changed (one subject, one README line) but whose
    generated files did not: --check names the catalog and the README, and writing them cures it."""
    copy = tmp_path / "tree"
    for part in ("scripts", "deploy/journald", "supervisor/llama_guard/vocab"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", copy / "README.md")
    (copy / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "phases.md", copy / "docs" / "phases.md")
    (copy / "supervisor/llama_guard/__init__.py").touch()
    module = copy / "supervisor/llama_guard/vocab/events.py"
    text = module.read_text()
    assert text.count('subject="llama-guard started"') == 1
    module.write_text(text.replace('subject="llama-guard started"', 'subject="llama-guard began"'))
    stale = _gen_check(copy)
    assert stale.returncode == 1
    assert "deploy/journald/llama-guard.catalog is stale" in stale.stderr
    assert "README.md is stale" in stale.stderr
    assert "events.py is stale" not in stale.stderr and "phases.md is stale" not in stale.stderr
    subprocess.run([sys.executable, str(copy / "scripts" / "gen_catalog.py")], check=True, capture_output=True,
                   timeout=120)
    assert _gen_check(copy).returncode == 0
    assert "| `daemon_started` | info | llama-guard began |" in (copy / "README.md").read_text()


_SNIPPET = """\
from llama_guard.model.actions import Emit
from llama_guard.model.watcher import Context
from llama_guard.output.eventlog import Emitter


def report(emitter: Emitter, ctx: Context) -> Emit:
    emitter.emit("{name}", server_pid=1)
    ctx.emit("{name}", server_pid=1)
    return Emit("{name}", {{"server_pid": 1}})
"""


def _mypy(tmp_path: Path, name: str) -> tuple[str, int]:
    snippet = tmp_path / f"snippet_{name}.py"
    snippet.write_text(textwrap.dedent(_SNIPPET.format(name=name)))
    stdout, stderr, status = mypy_api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--follow-imports=silent",
        "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet)])
    return stdout + stderr, status


def test_mypy_rejects_a_misspelt_event_name_at_every_emit(tmp_path: Path) -> None:
    good, status = _mypy(tmp_path, "server_ready")
    assert status == 0, good
    bad, status = _mypy(tmp_path, "server_redy")
    assert status == 1, bad
    lines = sorted({int(m) for m in re.findall(r"snippet_server_redy\.py:(\d+): error", bad)})
    assert lines == [7, 8, 9], bad
    assert "server_ready" in bad or "Literal" in bad
