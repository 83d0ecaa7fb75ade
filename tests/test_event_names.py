"""Event names are a type: the catalogue, the journald catalog, the README and mypy agree on them."""

from __future__ import annotations

import re
import textwrap
import typing
from pathlib import Path

from llama_guard.vocab.events import CATALOG, EventName
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parent.parent


def test_the_catalogue_holds_exactly_the_typed_names() -> None:
    names = typing.get_args(EventName)
    assert len(names) == len(set(names))
    assert set(names) == set(CATALOG)
    assert all(spec.name == key for key, spec in CATALOG.items())


def test_the_readme_event_table_names_only_catalogue_events() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Events", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert len(named) > 30
    assert named <= set(CATALOG), sorted(named - set(CATALOG))


_SNIPPET = """\
from llama_guard.core.actions import Emit
from llama_guard.core.watcher import Context
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
