"""The README's "Layout" picture (read from the README itself), checked against the imports (read with
``ast``, lazy imports included): each package of ``supervisor/llama_guard`` is one floor, drawn on one line;
a module imports only from a package on a floor below its own, or from its own package. The ground floor
(``vocab/``) imports nothing of llama-guard's own; no module lives outside a package but the package's own
``__init__`` and ``__main__``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "supervisor" / "llama_guard"
README = ROOT / "README.md"
TOP_MODULES = {"__init__", "__main__"}  # the package's version; the entry point above every floor


def readme_floors() -> list[str]:
    """The packages of the README's Layout picture, bottom first (it draws them top first): each line of its
    code block indented by exactly two spaces is a floor, whose first column (up to two spaces) names one
    package (``core/``); ``__main__.py``, the entry point, is drawn on the top line."""
    layout = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = layout.split("```", 2)[1]
    floors: list[str] = []
    for line in block.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            continue  # the package's own line, the repository's other folders, a description's next line
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if column == "__main__.py":
            continue
        assert re.fullmatch(r"\w+/", column), f"a floor is one package, drawn as `name/`: {line.strip()!r}"
        floors.append(column.removesuffix("/"))
    floors.reverse()
    return floors


FLOORS = readme_floors()
LEVEL = {package: level for level, package in enumerate(FLOORS)}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> int:
    """The floor of ``module`` (``llama_guard.model.policy.stop``): its package's. The package's own
    ``__init__`` (its version, nothing imported) stands under the ground floor (-1), ``__main__`` above the
    top one."""
    if module == "llama_guard":
        return -1
    if module == "llama_guard.__main__":
        return len(FLOORS)
    package = module.split(".")[1]
    assert package in LEVEL, f"{module} is on no floor: draw its package in the README's Layout"
    return LEVEL[package]


def our_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "llama_guard":
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "llama_guard")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) for p in MODULES])
def test_imports_go_down_the_floors(path: Path) -> None:
    module = module_name(path)
    level = floor_of(module)
    wrong = []
    for target in sorted(our_imports(path)):
        same_package = target.split(".")[:2] == module.split(".")[:2] and target != "llama_guard"
        if same_package or floor_of(target) < level:
            continue
        wrong.append(f"{target} (floor {floor_of(target)})")
    assert not wrong, f"{module} (floor {level}) imports upwards or sideways: {', '.join(wrong)}"


def test_each_package_is_one_floor_and_every_module_is_in_a_package() -> None:
    assert len(FLOORS) > 10, FLOORS  # the picture was read, not an empty block
    assert len(set(FLOORS)) == len(FLOORS), f"a package drawn on two floors: {FLOORS}"
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert sorted(FLOORS) == packages, (sorted(set(packages) - set(FLOORS)), sorted(set(FLOORS) - set(packages)))
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.stem not in TOP_MODULES)
    assert not loose, f"modules outside a package: {loose}"


def test_the_ground_floor_imports_nothing_of_ours() -> None:
    assert FLOORS[0] == "vocab", FLOORS
    for path in sorted((PACKAGE / "vocab").rglob("*.py")):
        assert our_imports(path) == set(), path


def test_a_module_drawn_on_no_floor_fails() -> None:
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("llama_guard.not_drawn_anywhere")
    assert floor_of("llama_guard.model.policy.stop") == LEVEL["model"]
    assert floor_of("llama_guard.core.daemon") == LEVEL["core"] > LEVEL["model"]


def test_a_floor_line_naming_two_packages_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("## Layout\n\n```\nsupervisor/llama_guard/\n  core/ output/     two on one floor\n```\n")
    monkeypatch.setitem(globals(), "README", readme)
    with pytest.raises(AssertionError, match="a floor is one package"):
        readme_floors()


def test_every_blocking_call_goes_through_a_lane() -> None:
    """One policy for blocking calls (core/offload.py's lanes, each with a deadline): no unbounded
    ``asyncio.to_thread``, and no ``preexec_fn`` (unsafe in a parent that already runs threads)."""
    found = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "to_thread":
                found.append(f"{module_name(path)}:{node.lineno} asyncio.to_thread")
            if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                found.append(f"{module_name(path)}:{node.lineno} preexec_fn")
    assert not found, found
