"""Every code block of the README and of every page in docs/ runs, and what it shows is what it prints.

Each page is read the same way. Each fenced block is one of: ``python`` (executed in order in one namespace per
page, as a reader pasting them into one session; ``<!-- separate -->`` starts a fresh one; a page's first python
block imports and defines what the page needs, never a name of another page), ``bash`` (each line run in a shell
with this checkout's ``fxpipe``; ``<!-- ci -->`` blocks, in the README only, are the install and test commands
``.ci/run`` runs), ``<!-- output -->`` (what the block before it prints: the same lines, numbers and names aside),
``<!-- console -->`` (``$ command`` lines run, several at once when there are several (``<!-- console: in order
-->``: one after another, in a scratch directory), their output compared the same way), ``<!-- fragment: FILE
... -->`` (a piece of FILE, which a test or example runs: it must compile and every call in it must be in FILE),
``<!-- shown: ... -->`` (a long benchmark's recorded output) or ``<!-- text -->`` (a diagram, a signature).

The README links every docs page, and every relative link of every page names a file (and a heading) that exists.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
FENCE = re.compile(r"(?:^[ \t]*<!-- (?P<marker>.*?) -->\n)?^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
                   re.M | re.S)
KINDS = {"ci", "output", "console", "fragment", "shown", "text", "separate"}


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass
class Block:
    kind: str     # python, bash, or a marker's first word
    lang: str
    body: str
    line: int
    marker: str = ""
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


@functools.cache
def blocks(page: Path = README) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        marker = (m.group("marker") or "").split(":")[0].split()
        kind = marker[0] if marker and marker[0] != "separate" else m.group("lang")
        if marker and marker[0] == "separate":
            kind = "python-separate"
        found.append(Block(kind, m.group("lang"), textwrap.dedent(m.group("body")), text[:m.start()].count("\n") + 1,
                           m.group("marker") or "", name(page)))
    return found


def pages_with(*kinds: str) -> list[Path]:
    return [page for page in PAGES if any(b.kind in kinds for b in blocks(page))]


def heads(text: str) -> list[str]:
    """Each line's first two words, numbers masked, runs of equal heads once: the shape of an output, not its
    values (a plan measured on a busy machine may have another number of stages or another chosen row)."""
    out: list[str] = []
    for line in text.strip().splitlines():
        masked = re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?[%*]?", "#", line.strip())
        words = [w for w in masked.split() if w != "*"]   # a "* chosen" mark moves with the measurement
        head = " ".join(words[:2])
        # a table's rows share one head: as many stages as the measured plan has, one line in the shape
        if head and (not out or out[-1] != head):
            out.append(head)
    return out


def assert_same_shape(shown: str, printed: str, where: str) -> None:
    want, got = heads(shown), heads(printed)
    it = iter(got)
    missing = [w for w in want if w not in it]   # subsequence: shown lines appear in order
    assert not missing and len(got) - len(want) <= 2, (
        f"{where}: the shown output does not match what the block prints.\n"
        f"missing: {missing}\nprinted:\n{printed}")


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_block_is_run_or_marked(page):
    found = blocks(page)
    for b in found:
        assert b.kind in {"python", "python-separate", "bash"} | KINDS, (
            f"{b.where}: a ```{b.lang} block with no marker; mark it <!-- output -->, <!-- console -->, "
            "<!-- shown: ... --> or <!-- text --> (or make it python/bash that runs)")
        if b.kind == "fragment":
            file = ROOT / b.marker.split("fragment:")[1].split()[0]
            assert file.is_file(), f"{b.where}: {file} does not exist"
            compile(b.body, f"{b.page}:{b.line}", "exec")
            source = file.read_text()
            # the library calls it makes (fxd.PipelineRank, torch.optim.SGD, F.cross_entropy) are the file's too
            calls = set(re.findall(r"\b(?:fxd|torch(?:\.\w+)*|F|nn|fxpipe)\.(\w+)\(", b.body))
            assert calls and all(c in source for c in calls), (
                f"{b.where}: {sorted(c for c in calls if c not in source)} not in {file.name}")
        if b.kind == "output":
            previous = found[found.index(b) - 1]
            assert previous.kind in {"python", "python-separate", "bash"}, f"{b.where}: output of what?"


def test_the_pages_hold_the_blocks_the_tests_run():
    found = [b for page in PAGES for b in blocks(page)]
    assert len(found) > 15 and len(CONSOLES) >= 4   # (an empty CONSOLES would parametrize no console test)
    assert len(blocks(README)) >= 5 and DOCS, [name(p) for p in PAGES]


def test_ci_blocks_are_the_install_and_test_commands():
    ci = [b.body for b in blocks(README) if b.kind == "ci"]
    assert any("pip install -e" in c for c in ci) and any("pytest" in c for c in ci), ci
    # .ci/run reads README.md alone: a <!-- ci --> block on another page would never run
    elsewhere = [b.where for page in DOCS for b in blocks(page) if b.kind == "ci"]
    assert not elsewhere, f"<!-- ci --> blocks outside README.md, which .ci/run does not read: {elsewhere}"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    unlinked = [name(p) for p in DOCS if not re.search(rf"\]\({re.escape(name(p))}(#[^)]*)?\)", text)]
    assert not unlinked, f"README.md links no [...]({unlinked[0]}): a docs page a newcomer cannot find"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    one numbered (the second ``plan`` is ``plan-1``)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_name_files_and_headings_that_exist(page):
    """Text moved between pages keeps its links working: ``[...](path)`` relative to the page, ``#heading``
    one of the target page's headings."""
    prose = FENCE.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):   # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {name(file)})")
    assert not broken, f"{name(page)}: broken links: {broken}"


@pytest.fixture
def shell(tmp_path):
    """A directory with the repository's data, and this checkout's fxpipe first on PATH."""
    for folder in ("tests", "benchmarks", "examples"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fxpipe").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fxpipe "$@"\n')
    (bin_dir / "fxpipe").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               FXPIPE_CACHE_DIR=str(tmp_path / "cache"))
    for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "FXPIPE_NODE"):   # as a user's shell has them
        env.pop(key, None)
    return tmp_path, env


# compiles ResNet-18 three times, GPT-2 and a Llama once, plans a meta model and an 8-GPU MLP: 1-3 minutes in all
# with the load average at 10-15
@pytest.mark.slow
@pytest.mark.parametrize("page", pages_with("python", "python-separate"), ids=name)
def test_python_blocks_run_and_print_what_the_page_shows(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "cache"))
    found = blocks(page)
    scope: dict = {}
    for i, b in enumerate(found):
        if b.kind not in ("python", "python-separate"):
            continue
        if b.kind == "python-separate":
            scope = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b.body, f"{b.page}:{b.line}", "exec"), scope)
        if i + 1 < len(found) and found[i + 1].kind == "output":
            assert_same_shape(found[i + 1].body, out.getvalue(), found[i + 1].where)


@pytest.mark.slow   # plans ResNet-101 twice from shapes, times ResNet-18 steps, solves corpus problems: 1-3 minutes
@pytest.mark.parametrize("page", pages_with("bash"), ids=name)
def test_bash_blocks_run(page, shell):
    cwd, env = shell
    found = blocks(page)
    for i, b in enumerate(found):
        if b.kind != "bash":
            continue
        for n, line in enumerate(line for line in b.body.splitlines() if line.strip()):
            done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{b.where}: {line}\n{done.stdout}\n{done.stderr}"
            if n == 0 and i + 1 < len(found) and found[i + 1].kind == "output":
                assert_same_shape(found[i + 1].body, done.stdout, found[i + 1].where)


def commands(body: str) -> list[tuple[str, str]]:
    """``$ command`` (with ``\\`` continuations and a trailing ``# comment``) and the output shown after it."""
    out: list[tuple[str, str]] = []
    lines = body.splitlines()
    k = 0
    while k < len(lines):
        if lines[k].startswith("$ "):
            command = lines[k][2:]
            while command.rstrip().endswith("\\"):
                k += 1
                command = command.rstrip()[:-1] + " " + lines[k].strip()
            shown = []
            while k + 1 < len(lines) and not lines[k + 1].startswith("$ "):
                k += 1
                shown.append(lines[k])
            out.append((command.split(" #")[0].strip(), "\n".join(shown)))
        k += 1
    return out


CONSOLES = [b for page in PAGES for b in blocks(page) if b.kind == "console"]


@pytest.mark.slow   # torchrun: 2 to 4 processes a command; one test a block, so that the test workers share them
@pytest.mark.parametrize("b", CONSOLES, ids=[f"{b.page}:line{b.line}" for b in CONSOLES])
def test_console_blocks_run_and_print_what_the_page_shows(shell, b):
    scratch, env = shell
    # "in order": each command waits for the one before (it reads what that one wrote), in a scratch
    # directory (the repository's examples beside it), or "from an empty directory" (nothing beside it: the
    # commands need only the installed package); otherwise the commands run at once (two torchrun "nodes"
    # that rendezvous)
    in_order = "in order" in b.marker
    where = scratch if in_order else ROOT
    if "empty directory" in b.marker:
        where = scratch / "empty"
        where.mkdir(exist_ok=True)
    runs = []
    for command, shown in commands(b.body):
        process = subprocess.Popen(["bash", "-c", command], cwd=where, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        runs.append((process, shown, process.communicate(timeout=300) if in_order else None))
    for process, shown, done in runs:
        stdout, stderr = done or process.communicate(timeout=300)
        assert process.returncode == 0, f"{b.where}:\n{stdout}\n{stderr}"
        # ranks print in either order: compare the sorted lines
        assert_same_shape("\n".join(sorted(shown.splitlines())), "\n".join(sorted(stdout.splitlines())), b.where)
