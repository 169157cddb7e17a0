"""The docs run: README.md and docs/*.md are executed, so a newcomer can copy any command.

Each fenced block that holds a command or a Python snippet carries a marker, an HTML
comment on the line before it (invisible on GitHub):

    <!-- doc-test: run [ray] [timeout=S] [name=N] [cmd="..."] [sub="OLD" "NEW"]... -->
        run the block (bash; a ```python block with Python) in a scratch copy of the
        repository, the README's set-up done (``.venv`` there, ``mpipemoe`` on PATH). The
        blocks of one file run in order in one copy, so a later block can use what an
        earlier one made; README.md and docs/training.md, read in that order, share one.
        ``sub`` first replaces OLD (which must occur) by NEW: the small arguments that keep
        the suite quick. ``cmd`` runs that instead (the block is then only checked like
        ``flags``). ``ray``: the block starts Ray (the test gets the pytest marker ``ray``).
        ``name``: an output block further on may name it with ``of=N``.
    <!-- doc-test: output [of=N] [tolerance=R%] [illustration] -->
        quoted output: every line must appear in the output of the last ``run`` block
        before it (or of the one named N); a line ``...`` is skipped. Its words match word
        for word and its numbers number for number, each within R% of the quoted one
        (default 0: the same number); only words starting with ``/`` (paths) match any word.
        ``illustration``: the block shows what a run prints, not figures the suite checks
        (timings, a longer run than the suite's): its words holding digits match any word,
        and the prose just before the block must call it an illustration, so a reader
        knows its figures are not checked.
    <!-- doc-test: flags REASON -->
        not run (GPU, cluster, minutes): every ``mpipemoe`` command in it must parse with
        that command's own options, and every repository file it names must exist.
    <!-- doc-test: skip REASON -->
        neither (e.g. an illustration, not a command).

A block that holds a command and no marker fails the suite, so a new snippet cannot go
untested. Every ``run`` and ``flags`` block is flag-checked too, as is every inline
``mpipemoe ...`` in the prose, and every relative link must point at a file of the
repository.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]
MARKER = re.compile(r"^<!--\s*doc-test:\s*(run|output|flags|skip)\b(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
# A block "holds a command" when a line starts with one of these.
COMMAND_START = re.compile(r"^\s*(\.venv/bin/)?(mpipemoe|make|python3?|ray|bash|mlflow|ssh|export|pip)\b")
# Folders and files of the repository that commands name as inputs.
REPO_PATH = re.compile(r"^(results|tools|docs|tune_spaces|app|moe_engine|workers|tests)/[\w./-]+$|^cluster\.yaml$")
OUTPUT_FLAGS = {"--out", "--summary-json", "--profiles", "--measure-parts"}


@dataclass
class Block:
    doc: Path
    line: int              # 1-based line of the opening fence
    lang: str
    text: str
    kind: str | None       # run / output / flags / skip, None when unmarked
    options: str = ""
    ray: bool = False
    timeout: int = 300
    cmd: str | None = None
    name: str | None = None
    illustration: bool = False
    tolerance: float = 0.0   # output: relative tolerance of each quoted number
    subs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def holds_command(self) -> bool:
        return self.lang == "python" or (self.lang in ("", "bash", "sh", "shell")
                                         and any(COMMAND_START.match(line) for line in self.text.splitlines()))

    def runnable_text(self) -> str:
        if self.cmd is not None:
            return self.cmd
        text = self.text
        for old, new in self.subs:
            assert old in text, f"{self.where}: doc-test sub {old!r} is not in the block any more"
            text = text.replace(old, new)
        return text


def parse_options(block: Block) -> None:
    """``ray``, ``timeout=S``, ``cmd="..."``, ``sub="OLD" "NEW"`` from the marker."""
    words = shlex.split(block.options)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "ray":
            block.ray = True
        elif word == "illustration":
            block.illustration = True
        elif word.startswith("tolerance="):
            block.tolerance = float(word.split("=", 1)[1].rstrip("%")) / 100
        elif word.startswith("timeout="):
            block.timeout = int(word.split("=", 1)[1])
        elif word.startswith(("name=", "of=")):
            block.name = word.split("=", 1)[1]
        elif word.startswith("cmd="):
            block.cmd = word.split("=", 1)[1]
        elif word.startswith("sub="):
            block.subs.append((word.split("=", 1)[1], words[i + 1]))
            i += 1
        else:
            raise AssertionError(f"{block.where}: unknown doc-test option {word!r}")
        i += 1


def read_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        block = Block(doc, i + 1, fence.group(2), "\n".join(lines[i + 1:end]),
                      marker.group(1) if marker else None, marker.group(2).strip() if marker else "")
        if block.kind in ("run", "output"):
            parse_options(block)
        blocks.append(block)
        i = end + 1
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in read_blocks(doc)]


# Files read in sequence by a newcomer share one scratch copy: README.md's `make train` makes
# the run that docs/training.md goes on to resume. Every other file with run blocks stands alone.
STORIES = [[ROOT / "README.md", ROOT / "docs" / "training.md"]]
STORIES += [[doc] for doc in DOCS if doc not in STORIES[0] and any(b.kind == "run" for b in read_blocks(doc))]


def test_every_command_block_is_marked():
    unmarked = [block.where for block in ALL_BLOCKS if block.kind is None and block.holds_command()]
    assert not unmarked, (f"code blocks with a command but no <!-- doc-test: run|flags|skip --> marker "
                          f"on the line before (see tests/test_docs.py): {unmarked}")


def test_output_blocks_follow_a_run():
    for docs in STORIES + [[doc] for doc in DOCS if not any(doc in story for story in STORIES)]:
        seen_run = False
        for block in (block for doc in docs for block in read_blocks(doc)):
            seen_run |= block.kind == "run"
            assert block.kind != "output" or seen_run, f"{block.where}: an output block with no run block before it"


# -- flags: every mpipemoe command parses with its own options --------------------------------

def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block as argument lists, continuation lines joined, comments
    dropped, ``ray exec cluster.yaml '...'`` and ``a && b`` looked into."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if "..." in line or "…" in line:  # an elided illustration, not a command
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        current: list[str] = []
        for word in words + [";"]:
            if word in (";", "&&", "||", "|", "&"):
                if current:
                    commands.append(current)
                current = []
            elif " " in word and COMMAND_START.match(word):  # a quoted command: ray exec ... 'mpipemoe ...'
                commands.extend(shell_commands(word))
            else:
                current.append(word)
    return commands


def check_mpipemoe_args(argv: list[str]) -> str | None:
    """None when ``mpipemoe ARGV`` parses as app.cli parses it, else argparse's complaint."""
    from app import cli

    argv = [arg for arg in argv if arg != "--debug"]
    if argv in (["--help"], ["-h"]):
        return None
    if not argv or argv[0] not in cli.SUBCOMMANDS:
        return f"unknown command {argv[:1]}"
    module = importlib.import_module(cli.SUBCOMMANDS[argv[0]][0])
    parser = argparse.ArgumentParser(prog=f"mpipemoe {argv[0]}", exit_on_error=False)
    module.add_arguments(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(argv[1:])
    except (SystemExit, argparse.ArgumentError) as error:
        return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else str(error)
    return None


def mpipemoe_argv(words: list[str]) -> list[str] | None:
    if words and words[0] in ("mpipemoe", ".venv/bin/mpipemoe"):
        return words[1:]
    if words[:3] in ([".venv/bin/python", "-m", "app.cli"], ["python", "-m", "app.cli"],
                     ["python3", "-m", "app.cli"]):
        return words[3:]
    return None


def inline_commands(doc: Path) -> list[tuple[str, str]]:
    """Inline ``mpipemoe ...`` code spans of the prose that are whole commands."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    found = []
    for span in re.findall(r"`((?:\.venv/bin/)?mpipemoe [^`]+)`", text):
        if any(mark in span for mark in ("...", "…", "<", "|", "[", "N ", "DIR", "NAME", "SPACE")):
            continue
        found.append((f"{doc.relative_to(ROOT)}: `{span}`", " ".join(span.split()), True))
    return found


FLAG_CASES = ([(block.where, block.text, False) for block in ALL_BLOCKS
               if block.kind in ("run", "flags") and block.lang != "python"]
              + [case for doc in DOCS for case in inline_commands(doc)])


@pytest.mark.parametrize("where,text,inline", FLAG_CASES, ids=[case[0] for case in FLAG_CASES])
def test_commands_use_options_that_exist(where, text, inline):
    """Each documented mpipemoe command parses, and the repository files it reads exist.
    Prose may name an option without its value (`mpipemoe simulate --validate`)."""
    problems = []
    for words in shell_commands(text):
        argv = mpipemoe_argv(words)
        if argv is not None:
            complaint = check_mpipemoe_args(argv)
            if complaint and not (inline and "expected one argument" in complaint):
                problems.append(f"{shlex.join(words)}: {complaint}")
        for before, word in zip([""] + words, words):
            if REPO_PATH.match(word) and before not in OUTPUT_FLAGS and not (ROOT / word).exists():
                problems.append(f"{shlex.join(words)}: {word} is not in the repository")
    assert not problems, f"{where}: " + "; ".join(problems)


def tool_commands() -> dict[tuple[str, str], set[str]]:
    """(tool, subcommand) -> the options the docs give it, for `ray` and `mlflow` commands."""
    used: dict[tuple[str, str], set[str]] = {}
    for block in ALL_BLOCKS:
        if block.kind not in ("run", "flags") or block.lang == "python":
            continue
        text = re.sub(r"\$\((ray [^)]*)\)", r" ; \1 ; ", block.text)  # $(ray get-head-ip ...)
        for words in shell_commands(text):
            if len(words) > 1 and words[0] in ("ray", "mlflow") and not words[1].startswith("-"):
                nested = words[1] == "job" and len(words) > 2  # ray job submit|logs|stop ...
                args = words[3 if nested else 2:]
                args = args[:args.index("--")] if "--" in args else args  # after --: the job's command
                used.setdefault((words[0], " ".join(words[1:3]) if nested else words[1]), set()).update(
                    word.split("=")[0] for word in args if word.startswith("--"))
    return used


# The click command group that each tool's console script runs (`ray`: ray.scripts.scripts:main,
# which calls this group; `mlflow`: the group itself). Asked for its help in this process: a
# `ray ... --help` subprocess imports Ray anew each time (3.5 min for the 14 commands on a
# loaded 2-core machine, one of them 47 s), the group's own help is the same text at once.
TOOL_CLI = {"ray": ("ray.scripts.scripts", "cli"), "mlflow": ("mlflow.cli", "cli")}


@pytest.mark.parametrize("tool,subcommand", sorted(tool_commands()))
def test_ray_and_mlflow_commands_use_options_that_exist(tool, subcommand):
    """`ray up`, `ray exec`, `mlflow server` ...: each option the docs pass is in its --help."""
    from click.testing import CliRunner

    if shutil.which(tool, path=str(Path(sys.executable).parent)) is None:
        pytest.skip(f"{tool} is not installed beside this Python")
    module, name = TOOL_CLI[tool]
    done = CliRunner().invoke(getattr(importlib.import_module(module), name), [*subcommand.split(), "--help"],
                              prog_name=tool)
    assert done.exit_code == 0, f"`{tool} {subcommand}` is not a command: {done.output[-500:]}"
    missing = [option for option in tool_commands()[(tool, subcommand)] if option not in done.output]
    assert not missing, f"`{tool} {subcommand}` has no option {missing} (see `{tool} {subcommand} --help`)"


def test_relative_links_point_at_files_of_the_repository():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or ROOT not in path.parents and path != ROOT:
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to files that are not in the repository: {broken}"


def test_no_citation_of_files_outside_the_repository():
    """The product cites its own files: no DESIGN.md, no team folders, no docs/platform.md."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"DESIGN\.md|\.\./shared/|NOTES-platform|docs/platform\.md|STYLE\.md")
    cited = [f"{name}:{number}" for name in tracked if not name.startswith("results/logs")
             and (ROOT / name).is_file() and name != "tests/test_docs.py"
             for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert not cited, f"citations of files the repository does not hold: {cited}"


def test_cited_markdown_files_exist():
    """Every `docs/....md` (or `results/`, `tools/`, ... `.md`) path that code, config, the Makefile
    or the docs cite is a file of the repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    top_folders = "|".join(sorted({name.split("/")[0] for name in tracked if "/" in name}))
    cited_path = re.compile(rf"(?<![\w./-])((?:{top_folders})/[\w./-]*\.md|README\.md)\b")
    sources = [name for name in tracked if name.endswith((".py", ".toml", ".md")) or name == "Makefile"]
    missing = [f"{name}:{number} -> {path}" for name in sources
               if not name.startswith("results/") and name != "tests/test_docs.py"
               for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
               for path in cited_path.findall(line) if not (ROOT / path).is_file()]
    assert not missing, f"citations of markdown files the repository does not hold: {missing}"


def test_cited_sections_of_the_design_exist():
    """`docs/design.md §4.1` (or `[design.md](design.md) §7`) in code and docs names a heading there."""
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (ROOT / "docs" / "design.md").read_text(), flags=re.M))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    cited = {}
    for name in tracked:
        if (ROOT / name).is_file() and not name.startswith("results/logs"):
            text = (ROOT / name).read_text(errors="replace")
            for citation in re.findall(r"design\.md\)? (§[\d.]+(?:, §[\d.]+)*)", text):
                for number in re.findall(r"§(\d+(?:\.\d+)?)", citation):
                    cited.setdefault(number, name)
    unknown = {number: name for number, name in cited.items() if number not in headings}
    assert cited and not unknown, f"sections docs/design.md does not have: {unknown} (it has {sorted(headings)})"


# -- run: the blocks themselves, in a scratch copy of the repository ---------------------------

NUMBER = r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:[eE][-+]?\d+)?"   # 1,713  -0.5  1.45e-14


def as_number(text: str) -> float:
    return float(text.replace(",", ""))


def expected_line_pattern(line: str, illustration: bool = False) -> tuple[re.Pattern, list[float]]:
    """A quoted output line as a regex whose groups are its numbers, and those numbers. Words
    starting with / (paths) match any word; in an illustration, so do words holding digits."""
    parts, numbers = [], []
    for word in line.split():
        if word.startswith("/") or word.startswith("sqlite:") or (illustration and re.search(r"\d", word)):
            parts.append(r"\S+")
            continue
        pieces, position = [], 0
        for match in re.finditer(NUMBER, word):
            pieces += [re.escape(word[position:match.start()]), f"({NUMBER})"]
            numbers.append(as_number(match.group()))
            position = match.end()
        parts.append("".join(pieces) + re.escape(word[position:]))
    return re.compile(r"^\s*" + r"\s+".join(parts) + r"\s*$"), numbers


def line_matches(line: str, have: str, illustration: bool = False, tolerance: float = 0.0) -> bool:
    """Whether the printed line ``have`` is the quoted ``line``: the same words, each number
    within ``tolerance`` (relative) of the quoted one."""
    pattern, numbers = expected_line_pattern(line, illustration)
    match = pattern.match(have)
    return match is not None and all(abs(as_number(got) - want) <= tolerance * abs(want)
                                     for got, want in zip(match.groups(), numbers))


@pytest.mark.parametrize("line,have,illustration,tolerance,expected", [
    ("done: 50 steps, loss 5.165 -> 2.698", "done: 50 steps, loss 5.165 -> 2.698", False, 0.0, True),
    ("done: 50 steps, loss 5.165 -> 2.698", "done: 50 steps, loss 5.165 -> 2.714", False, 0.0, False),
    ("done: 50 steps, loss 5.165 -> 2.698", "done: 50 steps, loss 5.165 -> 2.714", False, 0.01, True),
    ("model.safetensors (0.9 MiB), 1,713 tokens/s", "model.safetensors (2.7 MiB), 1,713 tokens/s", False, 0.0, False),
    ("model.safetensors (0.9 MiB), 1,713 tokens/s", "model.safetensors (2.7 MiB), 9,999 tokens/s", True, 0.0, True),
    ("max |error| 1.45e-14  ok", "max |error| 2.1e-14  ok", False, 0.5, True),
    ("checkpoint: /tmp/x/checkpoint_000050", "checkpoint: /home/y/checkpoint_000050", False, 0.0, True),
    ("done: 50 steps", "done: 50 runs", True, 0.0, False),
])
def test_quoted_output_compares_numbers(line, have, illustration, tolerance, expected):
    assert line_matches(line, have, illustration, tolerance) is expected


def test_illustrations_say_so():
    """An output block whose figures the suite does not check says so where a reader sees it."""
    unsaid = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for block in read_blocks(doc):
            marker_line = block.line - 2  # 0-based index of the marker
            if block.kind == "output" and block.illustration and \
                    "illustration" not in " ".join(lines[max(0, marker_line - 12):marker_line]).lower():
                unsaid.append(block.where)
    assert not unsaid, f"output blocks marked illustration with no word 'illustration' in the prose before: {unsaid}"


def scratch_repository(tmp: Path) -> Path:
    """The repository's tracked files copied into ``tmp`` (a newcomer's fresh clone), with
    ``.venv`` pointing at the environment that runs the tests."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for name in tracked or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]:
        source = ROOT / name
        if source.is_file():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tmp / name)
    (tmp / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    return tmp


def run_env(repo: Path, activated: bool) -> dict:
    """This checkout's code; ``mpipemoe`` on PATH once the README's ``source .venv/bin/activate``
    ran (``activated``), and before that on PATH nowhere, as in a newcomer's fresh shell."""
    env = dict(os.environ)
    plain = [folder for folder in env.get("PATH", "").split(os.pathsep)
             if folder and not (Path(folder) / "mpipemoe").exists()]
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent)] * activated + plain)
    env["PYTHONPATH"] = str(repo)
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    env.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "30")
    return env


def run_block(block: Block, repo: Path, activated: bool) -> str:
    text = block.runnable_text()
    command = ([sys.executable, "-c", text] if block.lang == "python" and block.cmd is None
               else ["bash", "-euo", "pipefail", "-c", text])
    started = time.monotonic()
    done = subprocess.run(command, cwd=repo, env=run_env(repo, activated), capture_output=True, text=True,
                          timeout=block.timeout)
    print(f"{block.where}: {time.monotonic() - started:.1f} s")  # (pytest -s shows where a story's time goes)
    output = done.stdout + done.stderr
    assert done.returncode == 0, (f"{block.where}: the documented command failed (exit {done.returncode}):\n"
                                  f"{text}\n--- output (last 3000 characters) ---\n{output[-3000:]}")
    return output


def check_output(block: Block, output: str, ran: Block) -> None:
    lines = output.splitlines()
    missing = [line for line in block.text.splitlines()
               if line.strip() and line.strip() not in ("...", "…")
               and not any(line_matches(line, have, block.illustration, block.tolerance) for have in lines)]
    tolerance = "" if block.illustration else f" (numbers within {block.tolerance:.0%})"
    assert not missing, (f"{block.where}: quoted output lines that the run of {ran.where} no longer prints{tolerance}: "
                         f"{missing}\n--- its output (last 3000 characters) ---\n{output[-3000:]}")


def digests(repo: Path) -> dict[str, str]:
    """Every copied file's content hash (the repository as the scratch copy started)."""
    return {str(path.relative_to(repo)): hashlib.sha1(path.read_bytes()).hexdigest()
            for path in repo.rglob("*") if path.is_file() and ".venv" not in path.relative_to(repo).parts}


def _story_param(docs: list[Path]):
    blocks = [block for doc in docs for block in read_blocks(doc)]
    marks = [pytest.mark.ray] if any(block.ray for block in blocks) else []
    # Each run block has its own timeout (``timeout=S``, default 300 s); the story as a whole may
    # take their sum. pytest's 600 s for any test (pyproject.toml) ended README.md+docs/training.md
    # (four Ray Train jobs) on a loaded 2-core machine while every block was within its own limit.
    marks.append(pytest.mark.timeout(max(600, sum(block.timeout for block in blocks if block.kind == "run"))))
    return pytest.param(docs, marks=marks, id="+".join(str(doc.relative_to(ROOT)) for doc in docs))


@pytest.mark.parametrize("docs", [_story_param(docs) for docs in STORIES])
def test_doc_runs_as_written(docs, tmp_path):
    """The run blocks, in order, in a fresh copy of the repository; the output blocks quote
    lines the run before them prints; no committed file changes unless a command names it
    (`--out results/x.json` may rewrite results/x.json and its .md)."""
    repo = scratch_repository(tmp_path)
    before = digests(repo)
    last, runs, named = None, {}, ""
    activated = docs[0] != ROOT / "README.md"  # the docs/ files assume the README's set-up done
    for block in (block for doc in docs for block in read_blocks(doc)):
        if block.kind == "run":
            last = runs[block.name] = (run_block(block, repo, activated), block)
            activated |= "source .venv/bin/activate" in block.runnable_text()
            named += " " + block.runnable_text()
        elif block.kind == "output":
            output, ran = runs[block.name] if block.name else last
            check_output(block, output, ran)
    after = digests(repo)
    overwritten = [name for name, digest in before.items() if after.get(name) != digest
                   and os.path.splitext(name)[0] not in named]
    assert not overwritten, f"the documented commands overwrote committed files: {overwritten}"
    added = [name for name in after.keys() - before.keys()
             if name.startswith("results/") and os.path.splitext(name)[0] not in named]
    assert not added, f"the documented commands wrote into results/ unasked (the default is out/): {added}"
