"""``fxpipe plan --help`` is plain text (no Sphinx markup), says its defaults, and every example in it runs as pasted
from the repository's root (joined across backslash continuations, run in-process, ``-o`` into a scratch dir)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fxpipe.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def _examples(text: str) -> list[list[str]]:
    """Every ``fxpipe plan ...`` command of the help's examples, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text.split("\nexamples:\n", 1)[1])
    return [shlex.split(line, comments=True)[1:] for line in joined.splitlines()
            if line.strip().startswith("fxpipe plan ")]


def test_plan_help_is_plain_text_with_its_defaults(capsys):
    text = _help(capsys)
    assert "``" not in text and not re.search(r":(func|mod|class|meth):", text), text
    for option in ("--batch", "--chunks", "--leaf-modules", "--config", "--seq-len", "--devices", "--mesh",
                   "--topology", "--profile", "--time-limit", "-o OUTPUT"):
        block = text.split(f"  {option}", 1)[1].split("\n  -", 1)[0]
        assert "default" in block, (option, block)


def test_every_plan_example_runs_as_pasted(capsys, monkeypatch, tmp_path):
    examples = _examples(_help(capsys))
    assert len(examples) == 6 and all(args[0] == "plan" for args in examples), examples
    monkeypatch.chdir(ROOT)   # the examples name files under the repository (tests/data, examples/)
    for args in examples:
        if "-o" in args:
            at = args.index("-o") + 1
            args[at] = str(tmp_path / args[at])
        assert main(["-q", *args]) == 0, (args, capsys.readouterr().err)
        out = capsys.readouterr().out
        assert "stage" in out, (args, out)
        if "--mesh" in args:
            assert out.startswith("mesh pp=2 dp=2(fsdp) tp=2") or "pp=2 dp=2" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.plan.json", "r101.plan.json"]
