"""What a user gets from ``fxpipe.compile(model, ["cpu", "cpu"], (x,))`` with nothing else set, on models
in train mode: does it compile, what did it choose, and does ``pipe.step`` give the model's gradients.

The reference is the model itself run on the same micro-batches (``x.tensor_split(chunks)``) with the
same per-micro-batch loss summed (``reduction="sum"``): a train-mode BatchNorm normalises each
micro-batch by its own statistics in both, so what is left is fxpipe's own error. Models whose train mode
draws random numbers (dropout, stochastic depth) are compiled and stepped but not compared (``grad rel``
is ``random``).

    python benchmarks/defaults.py                 # every model below
    python benchmarks/defaults.py timm:repvgg_a0 custom:counter

Prints one row a model: compiled or the first line of the error, front end, chunks, schedule, stages,
worst relative gradient error (over parameters, relative to each gradient's largest magnitude or a thousandth of
the model's largest gradient, whichever is larger), seconds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
import warnings
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe

BATCH = 8
IMAGE = (BATCH, 3, 64, 64)


def _timm(name: str, **kwargs) -> Callable[[], tuple[nn.Module, tuple]]:
    def make():
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs), (torch.randn(*IMAGE),)
    return make


def _torchvision(name: str, size: int = 64, **kwargs) -> Callable[[], tuple[nn.Module, tuple]]:
    def make():
        import torchvision
        model = torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs)
        return model, (torch.randn(BATCH, 3, size, size),)
    return make


def _hf(name: str) -> Callable[[], tuple[nn.Module, tuple]]:
    def make():
        import transformers as T
        small = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=64, vocab_size=128)
        model = {
            "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=4, n_head=4,
                                                          n_positions=64)),
            "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **small)),
            "bert": lambda: T.BertForSequenceClassification(T.BertConfig(num_labels=3, **small)),
            "albert": lambda: T.AlbertForSequenceClassification(T.AlbertConfig(embedding_size=16, **small)),
            "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                                    num_experts_per_tok=2, **small)),
            "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
                vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
        }[name]()
        # the reference returns no cache either: the pipeline traces with use_cache off (it trains), and a
        # cache in the model's output would be projected into the reference's loss
        model.config.use_cache = False
        return model, (torch.randint(0, 128, (BATCH, 12)),)
    return make


class _Counter(nn.Module):
    """A step counter assigned in forward (``self.calls += 1``) in front of an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Variadic(_Counter):
    """``forward(self, *xs)``."""

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = xs[0] + xs[1]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    **{f"timm:{n}": _timm(n) for n in [
        "resnet18", "efficientnet_b0", "regnety_002", "repvgg_a0", "rexnet_100", "vovnet39a", "cspresnet50",
        "dpn48b", "skresnet18", "resnest14d", "fastvit_t8", "convnext_atto"]},
    "timm:vit_tiny_patch16_224": _timm("vit_tiny_patch16_224", img_size=IMAGE[-1]),
    "timm:levit_128s": _timm("levit_128s", img_size=IMAGE[-1]),
    "torchvision:densenet121": _torchvision("densenet121", 64),
    "torchvision:mnasnet0_5": _torchvision("mnasnet0_5", 64),
    "torchvision:inception_v3": _torchvision("inception_v3", 299, aux_logits=True, init_weights=True),
    "torchvision:googlenet": _torchvision("googlenet", 64, aux_logits=True, init_weights=True),
    "torchvision:swin_t": _torchvision("swin_t", 64),
    "torchvision:mobilenet_v3_small": _torchvision("mobilenet_v3_small", 64),
    **{f"hf:{n}": _hf(n) for n in ["gpt2", "llama", "bert", "albert", "mixtral", "bart"]},
    "custom:counter": lambda: (_Counter(), (torch.randn(BATCH, 16),)),
    "custom:variadic": lambda: (_Variadic(), (torch.randn(BATCH, 16), torch.randn(BATCH, 16))),
}


def _projection(out: object, samples: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of every floating output leaf, row ``i`` weighted by the weights of the
    sample ``samples[i]`` of the batch: a loss sensitive to every element, the same for a sample in any
    micro-batch."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    total = torch.zeros(())
    for k, t in enumerate(leaves):
        g = torch.Generator().manual_seed(k)
        weights = torch.randn((BATCH, *t.shape[1:]), generator=g)
        total = total + (t * weights[samples]).sum()
    return total


def _random(model: nn.Module, inputs: tuple) -> bool:
    """Whether the model's train mode draws random numbers (dropout, stochastic depth): two runs under
    different seeds differ. The pipeline draws its own, so such a model is not compared."""
    state = copy.deepcopy(model.state_dict())   # with its metadata: MNASNet's loading reads its version
    with torch.no_grad():
        runs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            runs.append([t for t in tree_flatten(model(*inputs))[0] if isinstance(t, torch.Tensor)])
    model.load_state_dict(state)
    return any(not torch.equal(a, b) for a, b in zip(*runs))


def run(name: str) -> str:
    torch.manual_seed(0)
    started = time.perf_counter()
    model, inputs = MODELS[name]()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the train-mode BatchNorm and buffer warnings: expected here
        try:
            pipe = fxpipe.compile(model, ["cpu", "cpu"], inputs)
        except Exception as exc:   # the row says why
            return f"{name:32s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
    plan = pipe.plan
    state = copy.deepcopy(model.state_dict())   # with its metadata: MNASNet's loading reads its version
    model.zero_grad(set_to_none=True)
    samples = torch.arange(BATCH)
    pipe.step(inputs, samples, _projection, reduction="sum")
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    for part, index in zip(zip(*[t.tensor_split(plan.chunks) for t in inputs]), samples.tensor_split(plan.chunks)):
        _projection(model(*part), index).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if _random(model, inputs):
        error = "random"
    elif set(got) != set(want):
        error = f"grads on {len(got)} params, model {len(want)}"
    else:
        # relative to each gradient's largest magnitude, but at least a thousandth of the model's largest: a
        # gradient that is zero in exact arithmetic (an attention key's bias) is rounding noise on both sides
        floor = 1e-3 * max(w.abs().max().item() for w in want.values())
        worst = max((got[n] - want[n]).abs().max().item() / max(want[n].abs().max().item(), floor, 1e-30)
                    for n in want)
        error = f"{worst:.1e}"
    elapsed = time.perf_counter() - started
    return (f"{name:32s} ok     {plan.frontend['name']:6s} {plan.chunks:6d} {plan.schedule:16s} {len(plan.stages):6d} "
            f"{error:>9s} {elapsed:6.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"a subset of: {', '.join(MODELS)}")
    names = parser.parse_args(argv).models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; choose from {list(MODELS)}")
    print(f"{'model':32s} result front  chunks schedule         stages grad rel      s")
    for name in names:
        print(run(name), flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
