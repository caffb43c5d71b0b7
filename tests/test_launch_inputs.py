"""What ``fxpipe.launch`` takes besides a plan, in one process: ``--data mock`` (token batches of the plan's shape,
labels padded), ``--data``/``--loss`` as ``pkg.module:fn`` or ``path/to/file.py:fn`` (the resolver ``--model``'s
factories share with ``fxpipe plan``), and ``--compare`` (a run's checkpoint, its recorded losses and parameters,
against this process training the same batches). The launch itself under torchrun: README's journey
(``tests/test_readme.py``) and ``tests/test_launch.py``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fxpipe.cli.compare_run import compare_run
from fxpipe.cli.mock_data import MockTokens, parse_mock
from fxpipe.cli.models import load_function
from fxpipe.frontend.input_record import record_inputs

transformers = pytest.importorskip("transformers")


def _frontend(with_labels: bool = True, shape: tuple[int, int] = (8, 16)) -> dict:
    ids = torch.zeros(shape, dtype=torch.long)
    return {"name": "export", "inputs": record_inputs((ids,), {"labels": ids} if with_labels else {})}


class _Config:
    vocab_size = 50


def test_mock_batches_are_the_plans_shape_padded_and_the_same_wherever_they_are_read():
    model = nn.Linear(2, 2)
    model.config = _Config()
    data = parse_mock("mock:batches=5,last=6,seed=3", _frontend(), model)
    assert data == MockTokens(8, 16, 50, batches=5, last=6, seed=3)
    batches = list(data)
    assert [b["input_ids"].shape[0] for b in batches] == [8, 8, 8, 8, 6]
    for b in batches:
        ids, labels = b["input_ids"], b["labels"]
        assert ids.shape[1] == 16 and ids.dtype == torch.long and 0 <= ids.min() and ids.max() < 50
        kept = labels != -100
        # labels are the ids up to each sequence's length (at least 2), -100 after it
        assert torch.equal(labels[kept], ids[kept]) and (kept.sum(1) >= 2).all()
        assert all(bool(row[: int(n)].all()) and not bool(row[int(n):].any()) for row, n in zip(kept, kept.sum(1)))
    assert len({int(b["labels"].ne(-100).sum()) for b in batches}) > 1   # another token count in each batch
    # another process, or a resumed run skipping to batch 3, reads the same batches
    again = parse_mock("mock:batches=5,last=6,seed=3", _frontend(), model)
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(batches, again))
    assert torch.equal(again.batch_at(3)["input_ids"], batches[3]["input_ids"])
    assert not torch.equal(parse_mock("mock:seed=4", _frontend(), model).batch_at(0)["input_ids"],
                           batches[0]["input_ids"])
    endless = iter(parse_mock("mock", _frontend(), model))
    assert len([next(endless) for _ in range(12)]) == 12


@pytest.mark.parametrize("text, frontend, configured, says", [
    ("mock:batch=4", _frontend(), True, "KEY among batches, last, seed"),
    ("mock:last=9,batches=2", _frontend(), True, "1 <= last <= the plan's batch (8)"),
    ("mock:last=2", _frontend(), True, "last=2 needs batches=N"),
    ("mock", _frontend(), False, "config.vocab_size"),
    ("mock", {"name": "fx"}, True, "planned with input_ids of shape (batch, sequence)"),
    ("mock", _frontend(with_labels=False), True, "plan the model with labels among its inputs"),
])
def test_mock_data_a_plan_cannot_take_is_refused_with_the_fix(text, frontend, configured, says):
    model = nn.Linear(2, 2)
    if configured:
        model.config = _Config()
    with pytest.raises(ValueError) as caught:
        parse_mock(text, frontend, model)
    assert says in str(caught.value), str(caught.value)


def test_a_function_is_named_by_module_or_by_file(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text("def batches():\n    return [1, 2]\nvalue = 3\n")
    monkeypatch.chdir(tmp_path)
    assert load_function("mydata.py:batches", "--data")() == [1, 2]          # a path, from the working directory
    assert load_function(f"{tmp_path}/mydata.py:batches", "--data")() == [1, 2]
    assert load_function("torch.nn.functional:mse_loss", "--loss") is torch.nn.functional.mse_loss
    for text, says in (("nosuch.models:make", "--data nosuch.models:make: cannot import 'nosuch.models'"),
                       ("mydata.py:batchez", "has no function 'batchez' (did you mean batches?)"),
                       ("mydata.py:value", "has no function 'value'"),
                       ("missing.py:f", "--data missing.py:f: no file 'missing.py'"),
                       ("batches", "expected pkg.module:function or path/to/file.py:function")):
        with pytest.raises(ValueError) as caught:
            load_function(text, "--data")
        assert says in str(caught.value), (text, str(caught.value))


def _tiny_llama() -> nn.Module:
    from fxpipe.cli.hf import build_hf
    torch.manual_seed(0)
    return build_hf("llama", {"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50,
                              "max_position_embeddings": 32})


def _published_run(root, steps: int, lr: float, record_losses: bool = True, dtype: torch.dtype | None = None,
                   halves: bool = False) -> None:
    """What fxpipe.launch --checkpoint leaves after ``steps`` steps: the parameters under ``model.``, in a
    published snapshot whose metadata holds every step's loss. ``halves``: each batch's gradient summed over its
    two halves, each weighted by its share of the counted tokens (a pipeline's micro-batches: the same step, its
    sums in another order)."""
    import torch.distributed.checkpoint as dcp
    from fxpipe.distributed import snapshots
    model, data = _tiny_llama().to(dtype or torch.float32), MockTokens(4, 8, 50, batches=steps, last=3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in data:
        parts = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}] if halves else [batch]
        counted = [(p["labels"][:, 1:] != -100).sum().item() for p in parts]
        loss = sum(model(**p).loss * (n / sum(counted)) for p, n in zip(parts, counted))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    snapshots.publish(str(root), steps, lambda path: dcp.save(state, checkpoint_id=path),
                      meta={"losses": losses} if record_losses else None)


def test_compare_says_match_for_the_run_it_repeats_and_differ_for_another(tmp_path):
    _published_run(tmp_path / "ckpt", 3, 0.1)
    lines: list[str] = []
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    data = MockTokens(4, 8, 50, batches=3, last=3)
    assert compare_run(str(tmp_path / "ckpt"), _tiny_llama(), data, sgd, None, write=lines.append) == 0
    assert lines[-1].startswith("MATCH") and lines[0].startswith("one process: losses "), lines
    assert lines[0].split()[3:] == lines[1].split()[2:], lines   # the same six-digit losses
    lines.clear()
    other = functools.partial(torch.optim.SGD, lr=0.2)   # another learning rate: the second loss on differs
    assert compare_run(str(tmp_path / "ckpt"), _tiny_llama(), data, other, None, write=lines.append) == 1
    assert lines[-1].startswith("DIFFER"), lines
    with pytest.raises(ValueError, match="--data gave 2 batches; the checkpoint's run trained 3"):
        compare_run(str(tmp_path / "ckpt"), _tiny_llama(), MockTokens(4, 8, 50, batches=2), sgd, None,
                    write=lines.append)
    with pytest.raises(ValueError, match="no checkpoint there"):
        compare_run(str(tmp_path / "none"), _tiny_llama(), data, sgd, None)
    _published_run(tmp_path / "old", 3, 0.1, record_losses=False)
    with pytest.raises(ValueError, match="records no loss for each of its 3 steps"):
        compare_run(str(tmp_path / "old"), _tiny_llama(), data, sgd, None)


def test_compare_takes_the_tolerance_of_the_model_s_dtype(tmp_path):
    """A bfloat16 run whose sums went in another order (micro-batches) matches one process at bfloat16's
    tolerance (torch.testing's rtol 1.6e-2), which float32's 1e-5 would call DIFFER; another learning rate still
    differs."""
    _published_run(tmp_path / "ckpt", 3, 0.1, dtype=torch.bfloat16, halves=True)
    data = MockTokens(4, 8, 50, batches=3, last=3)
    bf16 = lambda: _tiny_llama().to(torch.bfloat16)   # noqa: E731
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    lines: list[str] = []
    assert compare_run(str(tmp_path / "ckpt"), bf16(), data, sgd, None, write=lines.append) == 0, lines
    assert lines[-1] == "MATCH: the launched run trained as one process does (rtol 0.016, atol 1e-05)", lines
    assert compare_run(str(tmp_path / "ckpt"), bf16(), data, sgd, None, rtol=1e-5, write=lines.append) == 1
    other = functools.partial(torch.optim.SGD, lr=0.3)
    assert compare_run(str(tmp_path / "ckpt"), bf16(), data, other, None, write=lines.append) == 1
    assert lines[-1].startswith("DIFFER"), lines
