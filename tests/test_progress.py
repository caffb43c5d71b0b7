"""Progress: a tqdm bar on a terminal, nothing on stderr otherwise, and the profiling time logged under ``fxpipe``."""

import io
import logging
import sys

import torch
from torch import nn

import fxpipe


def _compile() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fxpipe.compile(model, ["cpu", "cpu"], (torch.randn(8, 8),), chunks=2,
                   profile=fxpipe.ProfileOptions(mode="estimate", cache=False, progress=True))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_progress_bar_where_stderr_is_not_a_terminal_but_a_log_record(capfd, caplog):
    with caplog.at_level(logging.INFO, logger="fxpipe"):
        _compile()
    assert capfd.readouterr().err == ""
    assert any(r.name.startswith("fxpipe") and "profiled 5 nodes (estimate, effort fast)" in r.getMessage()
               for r in caplog.records)


def test_a_tqdm_bar_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _compile()
    shown = terminal.getvalue()
    assert "profiling" in shown and "5/5" in shown and "node/s" in shown
