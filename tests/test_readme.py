"""Every code block of the README runs, and what it shows is what it prints.

Each fenced block is one of: ``python`` (executed in order in one namespace, as a reader pasting them into one
session; ``<!-- separate -->`` starts a fresh one), ``bash`` (each line run in a shell with this checkout's
``fxpipe``; ``<!-- ci -->`` blocks are the install and test commands ``.ci/run`` runs), ``<!-- output -->``
(what the block before it prints: the same lines, numbers and names aside), ``<!-- console -->`` (``$ command``
lines run, several at once when there are several (``<!-- console: in order -->``: one after another, in
a scratch directory), their output compared the same way), ``<!-- fragment: FILE
... -->`` (a piece of FILE, which a test or example runs: it must compile and every call in it must be in FILE),
``<!-- shown: ... -->`` (a long benchmark's recorded output) or ``<!-- text -->`` (a diagram).
"""

from __future__ import annotations

import contextlib
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
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"(?:^[ \t]*<!-- (?P<marker>.*?) -->\n)?^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$",
                   re.M | re.S)
KINDS = {"ci", "output", "console", "fragment", "shown", "text", "separate"}


@dataclass
class Block:
    kind: str     # python, bash, or a marker's first word
    lang: str
    body: str
    line: int
    marker: str = ""


def blocks() -> list[Block]:
    found = []
    for m in FENCE.finditer(README):
        marker = (m.group("marker") or "").split(":")[0].split()
        kind = marker[0] if marker and marker[0] != "separate" else m.group("lang")
        if marker and marker[0] == "separate":
            kind = "python-separate"
        found.append(Block(kind, m.group("lang"), textwrap.dedent(m.group("body")), README[:m.start()].count("\n") + 1,
                           m.group("marker") or ""))
    return found


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
        f"README line {where}: the shown output does not match what the block prints.\n"
        f"missing: {missing}\nprinted:\n{printed}")


def test_every_block_is_run_or_marked():
    found = blocks()
    assert len(found) > 15 and len(CONSOLES) >= 4   # (an empty CONSOLES would parametrize no console test)
    for b in found:
        assert b.kind in {"python", "python-separate", "bash"} | KINDS, (
            f"README line {b.line}: a ```{b.lang} block with no marker; mark it <!-- output -->, <!-- console -->, "
            "<!-- shown: ... --> or <!-- text --> (or make it python/bash that runs)")
        if b.kind == "fragment":
            file = ROOT / b.marker.split("fragment:")[1].split()[0]
            assert file.is_file(), f"README line {b.line}: {file} does not exist"
            compile(b.body, f"README:{b.line}", "exec")
            source = file.read_text()
            # the library calls it makes (fxd.PipelineRank, torch.optim.SGD, F.cross_entropy) are the file's too
            calls = set(re.findall(r"\b(?:fxd|torch(?:\.\w+)*|F|nn|fxpipe)\.(\w+)\(", b.body))
            assert calls and all(c in source for c in calls), (
                f"README line {b.line}: {sorted(c for c in calls if c not in source)} not in {file.name}")
        if b.kind == "output":
            previous = found[found.index(b) - 1]
            assert previous.kind in {"python", "python-separate", "bash"}, f"README line {b.line}: output of what?"


def test_ci_blocks_are_the_install_and_test_commands():
    ci = [b.body for b in blocks() if b.kind == "ci"]
    assert any("pip install -e" in c for c in ci) and any("pytest" in c for c in ci), ci


@pytest.fixture
def shell(tmp_path):
    """A directory with the repository's data, and this checkout's fxpipe first on PATH."""
    for name in ("tests", "benchmarks", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
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


@pytest.mark.slow   # compiles ResNet-18 three times and GPT-2 once: 1-3 minutes with the load average at 10-15
def test_python_blocks_run_and_print_what_the_readme_shows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path / "cache"))
    found = blocks()
    scope: dict = {}
    for i, b in enumerate(found):
        if b.kind not in ("python", "python-separate"):
            continue
        if b.kind == "python-separate":
            scope = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b.body, f"README.md:{b.line}", "exec"), scope)
        if i + 1 < len(found) and found[i + 1].kind == "output":
            assert_same_shape(found[i + 1].body, out.getvalue(), str(found[i + 1].line))


@pytest.mark.slow   # plans ResNet-101 twice from shapes, times ResNet-18 steps, solves corpus problems: 1-3 minutes
def test_bash_blocks_run(shell):
    cwd, env = shell
    found = blocks()
    for i, b in enumerate(found):
        if b.kind != "bash":
            continue
        for n, line in enumerate(line for line in b.body.splitlines() if line.strip()):
            done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"README line {b.line}: {line}\n{done.stdout}\n{done.stderr}"
            if n == 0 and i + 1 < len(found) and found[i + 1].kind == "output":
                assert_same_shape(found[i + 1].body, done.stdout, str(found[i + 1].line))


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


CONSOLES = [b for b in blocks() if b.kind == "console"]


@pytest.mark.slow   # torchrun: 2 to 4 processes a command; one test a block, so that the test workers share them
@pytest.mark.parametrize("b", CONSOLES, ids=[f"line{b.line}" for b in CONSOLES])
def test_console_blocks_run_and_print_what_the_readme_shows(shell, b):
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
        assert process.returncode == 0, f"README line {b.line}:\n{stdout}\n{stderr}"
        # ranks print in either order: compare the sorted lines
        assert_same_shape("\n".join(sorted(shown.splitlines())), "\n".join(sorted(stdout.splitlines())),
                          str(b.line))
