"""The README's "Layout" picture, checked against the imports (read with ``ast``, lazy imports
included): every module sits on one floor, and imports only from a floor below it, or from its own
package on its own floor. The ground floor (``vocab/``) imports nothing of llama-guard's own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor" / "llama_guard"

#: The floors, bottom first (as the README draws them, top first). A module is on the floor of the
#: longest prefix that names it.
FLOORS: list[tuple[str, ...]] = [
    ("llama_guard", "llama_guard.vocab", "llama_guard.units", "llama_guard.paths", "llama_guard.limit_values",
     "llama_guard.server_flags"),
    ("llama_guard.cron", "llama_guard.core.procs"),
    ("llama_guard.config",),
    ("llama_guard.argv", "llama_guard.api_key"),
    ("llama_guard.output.eventlog", "llama_guard.output.journal", "llama_guard.output.notify",
     "llama_guard.output.instance", "llama_guard.output.status", "llama_guard.output.status_view"),
    ("llama_guard.core.types", "llama_guard.core.inputs", "llama_guard.core.actions", "llama_guard.core.transition",
     "llama_guard.core.judgement", "llama_guard.core.server_log", "llama_guard.core.params",
     "llama_guard.core.policy", "llama_guard.core.watcher"),
    ("llama_guard.output.snapshot", "llama_guard.output.health"),
    ("llama_guard.core",),
    ("llama_guard.insight", "llama_guard.limits"),
    ("llama_guard.gpu",),
    ("llama_guard.restarts", "llama_guard.front", "llama_guard.slots"),
    ("llama_guard.insight.vram_check", "llama_guard.insight.bench"),
    ("llama_guard.output.metrics", "llama_guard.output.listener", "llama_guard.preflight"),
    ("llama_guard.check_report", "llama_guard.wiring"),
    ("llama_guard.cli",),
    ("llama_guard.__main__",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> tuple[int, str]:
    """The floor of ``module`` and the prefix that puts it there."""
    best: tuple[int, str] | None = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    assert best is not None, f"{module} is on no floor: add it to FLOORS and to the README's Layout"
    return best


def package_of(module: str) -> str:
    """The top package a module belongs to (``llama_guard.core`` for ``llama_guard.core.policy.stop``);
    a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def our_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module.startswith("llama_guard") else []
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("llama_guard"))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_go_down_the_floors(path: Path) -> None:
    module = module_name(path)
    level, _ = floor_of(module)
    own_package = package_of(module)
    wrong = []
    for target in sorted(our_imports(path)):
        target_level, _ = floor_of(target)
        if target_level < level:
            continue
        if target_level == level and package_of(target) == own_package:
            continue  # within its own package, on its own floor
        wrong.append(f"{target} (floor {target_level})")
    assert not wrong, f"{module} (floor {level}) imports upwards or sideways: {', '.join(wrong)}"


def test_the_ground_floor_imports_nothing_of_ours() -> None:
    for path in sorted((PACKAGE / "vocab").glob("*.py")):
        assert our_imports(path) == set(), path


def test_every_floor_is_in_the_readme_picture() -> None:
    layout = (PACKAGE.parent.parent / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for prefixes in FLOORS:
        for prefix in prefixes:
            name = prefix.removeprefix("llama_guard").lstrip(".") or "llama_guard"
            shown = name.replace(".", "/")
            assert shown.rsplit("/", 1)[-1] in layout, f"{shown} is not in the README's Layout"
