"""The README's "Layout" picture (read from the README itself), checked against the imports (read with
``ast``, lazy imports included): every module sits on one floor, and imports only from a floor below it, or from its own
package on its own floor. The ground floor (``vocab/``) imports nothing of llama-guard's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor" / "llama_guard"

README = PACKAGE.parent.parent / "README.md"


def readme_floors() -> list[tuple[str, ...]]:
    """The floors of the README's Layout picture, bottom first (it draws them top first): each line of
    its code block indented by exactly two spaces is a floor, whose first column (up to two spaces)
    names packages (``core/``) and modules (``core/procs.py``, ``core/{types,inputs}.py``)."""
    layout = README.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = layout.split("```", 2)[1]
    floors: list[tuple[str, ...]] = []
    for line in block.splitlines():
        if not line.startswith("  ") or line.startswith("   "):
            continue  # the package's own line, the repository's other folders, a description's next line
        column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names: list[str] = []
        for word in column.split():
            braces = re.fullmatch(r"(.*)\{(.+)\}(.*)", word)
            for part in ([braces[1] + inner + braces[3] for inner in braces[2].split(",")] if braces else [word]):
                names.append("llama_guard." + part.removesuffix("/").removesuffix(".py").replace("/", "."))
        floors.append(tuple(names))
    floors.reverse()
    # The package's own __init__ (its version, nothing imported) stands under the ground floor.
    return [("llama_guard",), *floors]


FLOORS = readme_floors()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> tuple[int, str]:
    """The floor of ``module`` and the prefix that puts it there."""
    best: tuple[int, str] | None = None
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            covers = module == prefix or (prefix != "llama_guard" and module.startswith(prefix + "."))
            if covers and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    assert best is not None, f"{module} is on no floor: draw it in the README's Layout"
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


def test_the_readme_picture_names_only_what_exists() -> None:
    assert len(FLOORS) > 10, FLOORS  # the picture was read, not an empty block
    for prefixes in FLOORS:
        for prefix in prefixes:
            path = PACKAGE.parent / prefix.replace(".", "/")
            exists = path.is_dir() or path.with_suffix(".py").is_file()
            assert exists, f"the README's Layout draws {prefix}: no such module"


def test_a_module_drawn_on_no_floor_fails() -> None:
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("llama_guard.not_drawn_anywhere")
    assert floor_of("llama_guard.core.policy.stop")[1] == "llama_guard.core.policy"
    assert floor_of("llama_guard.core.daemon")[1] == "llama_guard.core"


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
