"""The docs speak of the product: what it does, how to run it, what was measured on which
hardware by which command. They do not speak of how the project was made: no issue numbers,
no temporary folders of the machine a figure came from, no commits as the history of a
figure, no word on which development machine was or was not available. Where a figure needs
provenance, the doc names the record under results/ (which holds its command and commit).

Unit tier: reads README.md and docs/*.md, runs nothing.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (what it is, the pattern; case-insensitive). A commit hash is a word of 7-12 hex digits with
# a digit and a letter (dates, run names and 32-digit MLflow run ids are not).
FORBIDDEN = [
    ("an issue number", r"\bissues? ?#?\d+|(?<![\w&/])#\d+\b|\bissue-\d+"),
    ("a temporary-folder path", r"(?<![\w.])/tmp/"),
    ("a commit hash", r"(?<![\w-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w-])|\bgit show \w+:"),
    ("which development machine was available",
     r"\blent\b|\bnext GPU (run|session|call)\b|\b(GPU|device|later|earlier|same|one|that|a) "
     r"sessions?\b|\bdevice (tool|call|session)s?\b|`device` tool|\bshared machine\b|\bmachine shared\b"
     r"|\banother engineer|\bother engineers|\bthe GPU machine\b|\bGPU box\b|\blease of\b|gpu-machine\.md"),
]


def findings(text: str, name: str) -> list[str]:
    """``name:line: what (the words)`` for each forbidden mention in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            for match in re.finditer(pattern, line, flags=re.IGNORECASE):
                found.append(f"{name}:{number}: {what} ({match.group(0)!r})")
    return found


@pytest.mark.parametrize("text,what", [
    ("the figure of issue 36", "an issue number"),
    ("fixed in #36 last week", "an issue number"),
    ("written to /tmp/t29/bpe/val.bin", "a temporary-folder path"),
    ("measured at commit cce253a", "a commit hash"),
    ("`git show fbc5f16:results/README.md`", "a commit hash"),
    ("on one H100 (the H200 was not lent)", "which development machine was available"),
    ("the next GPU session times it", "which development machine was available"),
    ("a 2-core machine shared with another engineer's tests", "which development machine was available"),
    ("on the GPU machine", "which development machine was available"),
])
def test_the_check_catches_each_kind(text, what):
    assert {line.split(": ", 1)[1].split(" (")[0] for line in findings(text, "x")} == {what}


@pytest.mark.parametrize("text", [
    "a tmux session", "run `tiny-gpt-mpipemoe-20261206-083156-d020`", "on 2026-12-06",
    "MLflow run 88fd3a1469e04416b45ba32b8f4543fd", "replace `fs-0123456789abcdef0`",
    "rank #", "results/step-h100-emulated-8x8-dgx-h200-gpt-s.md", "released once the pool",
    "ratio 1.005 over 4096 tokens", "`docs/training.md` §5",
])
def test_the_check_lets_product_text_pass(text):
    assert findings(text, "x") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_docs_speak_of_the_product_only(doc: Path):
    found = findings(doc.read_text(), str(doc.relative_to(ROOT)))
    assert not found, ("the docs speak of the product, not of how it was made (name the record under results/ "
                       "and its command instead):\n" + "\n".join(found))


def test_results_readme_lists_every_folder():
    """results/README.md names every folder of results/ (as `NAME/`), so each record's command is findable."""
    readme = (ROOT / "results" / "README.md").read_text()
    missing = [path.name for path in sorted((ROOT / "results").iterdir())
               if path.is_dir() and f"`{path.name}/" not in readme]
    assert not missing, f"results/README.md does not list these folders (add a row saying what made them): {missing}"
