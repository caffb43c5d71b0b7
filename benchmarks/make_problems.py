"""Build the planner benchmark corpus: real models, costed, on four GPU topologies.

Each model is traced by fxpipe and profiled once on this CPU (``estimate`` mode:
FLOPs from ``FlopCounterMode``, saved-activation, parameter and tensor bytes from
one real run at the micro-batch size). Node times are then put on a Titan-V-class
GPU by a roofline, ``max(FLOPs / 1.2e13, bytes moved / 6.5e11) + 5 us`` forward and
twice that backward, so the problems describe the GPU boxes they are placed on.
The corpus is fixed: ``benchmarks/problems/*.json`` is committed and
``benchmarks/planner.py`` only reads it. Regenerate with

    python benchmarks/make_problems.py            # all models, a few minutes on 2 cores
    python benchmarks/make_problems.py --models unet
    python benchmarks/make_problems.py --scale    # only the synthetic scale problems (seconds)

``--scale`` writes ``benchmarks/problems/scale/``: seeded residual chains of 400 nodes on
the Titan V box and 3000 nodes on two such boxes over a network (the issue's scale
targets), on the devices and links of the corpus problems, a second seed of the large one, and
both sizes with every third GPU at half speed; ``planner.py`` times the whole command on them.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

import solvers
from fxpipe.planning.lowering import solver_order
from fxpipe.cost.profile import profile_graph
from fxpipe.planning.topology import links_from_classes, parse_nvidia_smi_topo
from fxpipe.frontend.trace import trace

HERE = Path(__file__).parent
TITAN_TOPOLOGY = HERE.parent / "tests" / "data" / "titan-v-8gpu-2socket.txt"
PEAK_FLOPS, PEAK_BPS, LAUNCH_S = 1.2e13, 6.5e11, 5e-6
GPU_MEMORY = 12 * 2**30          # Titan V
MICRO_BATCHES, SCHEDULE, ADAM = 8, "1f1b", 2.0


class Block(nn.Module):
    """Pre-norm GPT block: causal self-attention and a 4x MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A 24-block GPT-2-medium-sized decoder (width 1024, 16 heads), LM head tied to the embedding."""

    def __init__(self, vocab: int = 50257, width: int = 1024, depth: int = 24, heads: int = 16,
                 seq: int = 512, tied: bool = True) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.tok(tokens) + self.pos)))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """The 4-level U-Net of Ronneberger et al. (64..1024 channels): four long skips."""

    def __init__(self, channels: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = [64, 128, 256, 512, 1024]
        self.down = nn.ModuleList([_double_conv(channels, 64)] +
                                  [_double_conv(a, b) for a, b in zip(widths, widths[1:])])
        self.up = nn.ModuleList(nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:]))
        self.fuse = nn.ModuleList(_double_conv(2 * a, a) for a in widths[:-1])
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(64, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        x = skips.pop()
        for i in reversed(range(len(self.up))):
            x = self.fuse[i](torch.cat([skips.pop(), self.up[i](x)], dim=1))
        return self.head(x)


# name -> (constructor, micro-batch input)
MODELS = {
    "resnet101": (lambda: torchvision.models.resnet101(), lambda: torch.randn(32, 3, 224, 224)),
    "vgg16": (lambda: torchvision.models.vgg16(), lambda: torch.randn(32, 3, 224, 224)),
    "inception_v3": (lambda: torchvision.models.inception_v3(aux_logits=False, init_weights=False),
                     lambda: torch.randn(32, 3, 299, 299)),
    "vit_b_16": (lambda: torchvision.models.vit_b_16(), lambda: torch.randn(32, 3, 224, 224)),
    "gpt24": (lambda: GPT(), lambda: torch.randint(0, 50257, (8, 512))),
    "unet": (lambda: UNet(), lambda: torch.randn(8, 3, 256, 256)),
}


def topologies() -> dict[str, list[list[str]]]:
    """Link-class matrices: NVLink boxes, the Titan V box, and two of those joined by 100 Gb/s."""
    titan = parse_nvidia_smi_topo(TITAN_TOPOLOGY.read_text())
    two = [[(titan[i % 8][j % 8] if i // 8 == j // 8 else "NET") for j in range(16)] for i in range(16)]
    for i in range(16):
        two[i][i] = "X"
    full = lambda n, cls: [["X" if i == j else cls for j in range(n)] for i in range(n)]  # noqa: E731
    return {"nvlink4": full(4, "NV2"), "nvlink8": full(8, "NV12"), "titan8": titan, "titan16x2": two}


def costed_nodes(name: str) -> tuple[list[dict], list[dict]]:
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    gm = trace(model)
    costs = profile_graph(gm, (make_input(),), torch.device("cpu"), mode="estimate")
    order = solver_order(gm)
    in_problem = set(order)
    nodes, edges = [], []
    for n in order:
        c = costs[n.name]
        moved = c.output_bytes + sum(costs[a.name].output_bytes for a in n.all_input_nodes)
        fwd = max(c.flops / PEAK_FLOPS, moved / PEAK_BPS) + LAUNCH_S if n.op.startswith("call") else 0.0
        nodes.append(dict(id=n.name, fwd_s=fwd, bwd_s=2 * fwd, param_bytes=c.param_bytes, act_bytes=c.act_bytes))
        edges += [dict(src=n.name, dst=u.name, bytes=c.output_bytes) for u in n.users if u in in_problem]
    return nodes, edges


SCALE = ((400, "titan8", 0, False), (3000, "titan16x2", 0, False), (3000, "titan16x2", 1, False),
         (400, "titan8", 0, True), (3000, "titan16x2", 0, True))
"""The scale problems: nodes, topology, seed, and whether every third device runs at half speed."""


def scale_problem(n: int, box: str, seed: int = 0, mixed: bool = False) -> solvers.Problem:
    """A residual chain (a skip over every 3 nodes) on the devices and links of a corpus topology
    (``titan8``: the 8-GPU PIX/PHB/SYS Titan V box; ``titan16x2``: two of them over a network). ``mixed``:
    devices 0, 3, 6, ... run at half speed (an older generation beside newer GPUs)."""
    rng = random.Random(seed)
    like = solvers.Problem.load(HERE / "problems" / f"resnet101@{box}.json").to_dict()
    nodes = [dict(id=f"n{i}", fwd_s=rng.uniform(1e-4, 1e-3), bwd_s=rng.uniform(2e-4, 2e-3),
                  param_bytes=rng.uniform(0, 4e6), act_bytes=rng.uniform(1e6, 8e6)) for i in range(n)]
    edges = [dict(src=f"n{i}", dst=f"n{i + 1}", bytes=rng.uniform(1e6, 8e6)) for i in range(n - 1)]
    edges += [dict(src=f"n{i}", dst=f"n{i + 3}", bytes=rng.uniform(1e6, 8e6)) for i in range(0, n - 3, 3)]
    devices = like["devices"]
    if mixed:
        devices = [dict(d, speed=0.5 if i % 3 == 0 else d["speed"]) for i, d in enumerate(devices)]
    name = f"chain{n}{'-mixed' if mixed else ''}{f'-seed{seed}' if seed else ''}@{box}"
    return solvers.Problem.from_dict(dict(format="fxpipe-problem/1", name=name, micro_batches=8,
                                          schedule="1f1b", optimizer_state_factor=2.0, nodes=nodes, edges=edges,
                                          devices=devices, links=like["links"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=str(HERE / "problems"))
    parser.add_argument("--scale", action="store_true", help="write only the synthetic scale problems")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.scale:
        (out / "scale").mkdir(exist_ok=True)
        for n, box, seed, mixed in SCALE:
            problem = scale_problem(n, box, seed, mixed)
            problem.save(out / "scale" / f"{problem.name}.json")
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.models:
        start = time.perf_counter()
        nodes, edges = costed_nodes(name)
        for topo, classes in topologies().items():
            n = len(classes)
            links = links_from_classes(classes)
            problem = solvers.Problem.from_dict(dict(
                format="fxpipe-problem/1", name=f"{name}@{topo}", micro_batches=MICRO_BATCHES,
                schedule=SCHEDULE, stages=None, optimizer_state_factor=ADAM, nodes=nodes, edges=edges,
                devices=[dict(id=f"cuda:{i}", memory_bytes=GPU_MEMORY, speed=1.0) for i in range(n)],
                links=dict(bandwidth_Bps=links.bandwidth_Bps, latency_s=links.latency_s)))
            problem.save(out / f"{name}@{topo}.json")
        print(f"{name}: {len(nodes)} nodes, {len(edges)} edges, "
              f"{sum(x['fwd_s'] + x['bwd_s'] for x in nodes) * 1e3:.1f} ms per micro-batch, "
              f"{sum(x['param_bytes'] for x in nodes) / 2**20:.0f} MiB parameters "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
