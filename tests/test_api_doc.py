"""docs/api.md documents exactly the names of ``fxpipe.__all__``, each once, and is what tools/api_doc.py writes.

The tool reads the source with ``ast`` (no import of fxpipe or torch); the one test that imports fxpipe checks that
the ``__all__`` it read is the package's.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"


def tool():
    spec = importlib.util.spec_from_file_location("api_doc", ROOT / "tools" / "api_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def documented() -> list[str]:
    return re.findall(r"^## `([^`]+)`$", PAGE.read_text(), re.M)


def test_api_md_documents_exactly_the_names_of_fxpipe_all():
    names, exported = documented(), tool().package_all()
    twice = sorted({n for n in names if names.count(n) > 1})
    missing, extra = sorted(set(exported) - set(names)), sorted(set(names) - set(exported))
    assert not (twice or missing or extra), (
        f"docs/api.md against fxpipe.__all__: missing {missing}, not exported {extra}, documented twice {twice}; "
        "run python tools/api_doc.py")


def test_api_md_is_what_the_tool_writes():
    assert PAGE.read_text() == tool().render(), (
        "docs/api.md is out of date (a signature or a docstring's first paragraph changed): run python tools/api_doc.py")


def test_every_entry_has_a_signature_and_a_source_file():
    text = PAGE.read_text()
    entries = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(entries) == len(documented())
    for entry in entries:
        name = entry.split("`")[1]
        assert "```python\n" in entry and (f"fxpipe.{name}" in entry or f"class {name}" in entry), entry
        assert re.search(r"defined in \[`(fxpipe/[^`]+\.py)`\]\(\.\./\1\)", entry), entry


def test_the_names_the_tool_reads_are_the_package_s():
    pytest.importorskip("torch")
    import fxpipe
    assert tool().package_all() == list(fxpipe.__all__)
