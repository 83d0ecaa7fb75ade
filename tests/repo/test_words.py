"""The tree speaks of the project alone: no pointer to files outside the repository, no tracker
numbers, no words of the place it was built. Facts the code relies on live in docs/ with their
public source named."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AREAS = ["supervisor", "tests", "scripts", "docs", "README.md", "etc", "deploy", "benchmarks"]

# Built from pieces so that this file does not match itself.
_WORDS = [
    r"\bfacts" + "/",
    r"\bdesign" + r"\.md\b",
    r"\.\./" + "shared",
    r"/work/" + "shared",
    r"\b[Ii]ssue" + r" [0-9]+",
    r"\blent" + r" H200",
    r"\bdevice" + r" (?:time|session)s?\b",
    r"\bwork" + r"place",
    r"\bthe" + r" seed\b",
    r"\b64" + r" MiB limit",
    r"\bKind" + r" [0-9]+\b",
]
PATTERN = re.compile("|".join(_WORDS))


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard",
                          "--", *AREAS], capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_the_pattern_catches_what_it_is_for() -> None:
    for text in ("see fac" "ts/gpu.md", "the Xid list of iss" "ue 12", "on the le" "nt H200",
                 "Ki" "nd 3: a hung call", "des" "ign.md says"):
        assert PATTERN.search(text), text
    for text in ("typed facts only", "a design choice", "64 MiB (67108864 bytes)", "the seeded rng"):
        assert not PATTERN.search(text), text


def test_no_file_points_outside_the_repository_or_names_a_tracker_issue() -> None:
    files = _tracked_files()
    assert len(files) > 100
    hits = []
    for path in files:
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary data
        for number, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_docs_name_only_files_that_exist() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").glob("*.md"))]
    # A path of this repository; "ggml's `docs/gguf.md`" names another project's file.
    named = re.compile(r"(?<!'s `)(?<![\w/.])((?:supervisor|tests|scripts|docs|benchmarks)/[\w./-]*\w)")
    missing = sorted({f"{doc.name}: {path}" for doc in docs for path in named.findall(doc.read_text())
                      if not any((ROOT / path).parent.glob((ROOT / path).name + "*"))})
    assert not missing, missing
