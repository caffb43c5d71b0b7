"""``fxpipe plan`` and ``fxpipe bench``: every way of naming a model and devices, and every user error as one
``error:`` line with the cause and the fix (in process: ``main`` is what the console script calls)."""

from pathlib import Path

import pytest

import fxpipe
from fxpipe.__main__ import main
from fxpipe.planning import topology

BOX = Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt"
SMALL = ("--batch", "8", "--chunks", "2", "--image-size", "32")


def fxpipe_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_resnet_for_the_8_gpu_box_from_its_topology_file(tmp_path, capsys):
    path = tmp_path / "r18.plan.json"
    code, out, err = fxpipe_cli(capsys, "plan", "torchvision:resnet18", "--devices", "v100x8", "--topology",
                                str(BOX), "--batch", "64", "--chunks", "8", "--schedule", "1f1b",
                                "--leaf-modules", "BasicBlock", "-o", str(path))
    assert code == 0, err
    assert "profile: analytic on V100-SXM2-16GB" in out and "param+grad+opt GiB" in out
    plan = fxpipe.load_plan(path)
    assert plan.chunks == 8 and plan.schedule == "1f1b"
    # the links the planner used are the file's PIX/PHB/SYS classes, not the preset's NVLink
    want = topology.links_from_classes(topology.parse_nvidia_smi_topo(BOX.read_text())).bandwidth_Bps
    assert plan.to_dict()["problem"]["links"]["bandwidth_Bps"] == want
    # a bare preset takes its count from the file
    code, out, _ = fxpipe_cli(capsys, "plan", "resnet18", "--devices", "v100", "--topology", str(BOX), *SMALL,
                              "--time-limit", "2", "-o", str(path))
    assert code == 0 and len(fxpipe.load_plan(path).to_dict()["problem"]["devices"]) == 8


def test_plan_a_factory_from_a_file_with_its_own_inputs(tmp_path, capsys):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(64, 4))\n"
        "    return model, (torch.randint(0, 50, (8, 4)),)\n"
        "def mlp():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2))\n")
    out_path = tmp_path / "tok.plan.json"
    code, out, err = fxpipe_cli(capsys, "plan", f"{tmp_path / 'mymodels.py'}:build", "--devices", "h100x2",
                                "--chunks", "2", "-o", str(out_path))
    assert code == 0, err
    assert fxpipe.load_plan(out_path).batch_size == 8
    code, out, err = fxpipe_cli(capsys, "plan", f"{tmp_path / 'mymodels.py'}:mlp", "--devices", "cpu,cpu",
                                "--input-shape", "12", "--batch", "4", "--chunks", "2", "--profile", "estimate", "-q")
    assert code == 0, err
    assert "fxpipe plan for Sequential" in out


def test_plan_a_module_factory_and_timm(capsys):
    code, out, err = fxpipe_cli(capsys, "plan", "torchvision.models:resnet18", "--devices", "a100x2", *SMALL)
    assert code == 0 and "fxpipe plan for ResNet" in out, err
    pytest.importorskip("timm")
    code, out, err = fxpipe_cli(capsys, "plan", "timm:resnet10t", "--devices", "h100x2", *SMALL)
    assert code == 0 and "profile: analytic on H100" in out, err


def test_plan_for_gpus_on_two_nodes_puts_the_network_between_them(tmp_path, capsys):
    path = tmp_path / "two.plan.json"
    for devices in (("--devices", "h100@0:0-1,1:0-1"), ("--preset", "h100", "--count", "0:0-1,1:0-1")):
        code, out, err = fxpipe_cli(capsys, "plan", "resnet18", *devices, *SMALL, "--time-limit", "2", "--mesh", "none",
                                    "--schedule", "zb-h1",   # one stage a device
                                    "-o", str(path))   # one pipeline over both nodes (by default: a mesh searched)
        assert code == 0, err
        problem = fxpipe.load_plan(path).to_dict()["problem"]
        bandwidth = problem["links"]["bandwidth_Bps"]
        net = topology.LINK_CLASSES["NET"][0]   # the network between nodes
        assert len(bandwidth) == 4 and bandwidth[0][2] == bandwidth[1][3] == net < bandwidth[0][1], bandwidth


@pytest.mark.parametrize("args, code, words", [
    (("plan", "torchvision:resnet1o1", "--devices", "h100x2"), 2, ("no model 'resnet1o1'", "did you mean resnet101")),
    (("plan", "timm:no_such_net", "--devices", "h100x2"), 2, ("timm has no model 'no_such_net'", "list_models")),
    (("plan", "no_such_pkg.models:build"), 2, ("cannot import 'no_such_pkg.models'", "pkg.module:factory")),
    (("plan", "missing.py:build"), 2, ("no file 'missing.py'", "path/to/file.py:factory")),
    (("plan", "torchvision.models:no_factory"), 2, ("has no callable 'no_factory'", "returns an nn.Module")),
    (("plan", "resnet18", "--devices", "h100x2", "--topology", "/no/such/box.txt"), 1,
     ("/no/such/box.txt: No such file",)),
    (("plan", "resnet18", "--devices", "h100x2", "--topology", __file__), 2,
     ("not nvidia-smi topo -m output", "nvidia-smi topo -m > FILE")),
    (("plan", "resnet18", "--devices", "v100x4", "--topology", str(BOX)), 2, ("has 8", "use v100x8")),
    (("plan", "resnet18", "--devices", "cpu,cpu", "--topology", str(BOX)), 2, ("leave --topology out",)),
    (("plan", "resnet18", "--devices", "v100"), 2, ("say how many", "v100x8")),
    (("plan", "resnet18", "--devices", "gpu0,gpu1"), 2, ("'gpu0' is not a torch device string", "cuda:0,cuda:1")),
    (("plan", "resnet18", "--devices", "tpux4"), 2, ("unknown device preset 'tpu'", "h100x8")),
    (("plan", "resnet18", "--devices", "0"), 2, ("at least 1",)),
    (("plan", "resnet18", "--devices", "h100@0:0-x"), 2, ("is not NODE:FIRST-LAST", "0:0-7,1:0-7")),
    (("plan", "resnet18", "--devices", "tpu@0:0-3"), 2, ("unknown device preset 'tpu'", "h100@0:0-7,1:0-7")),
    (("plan", "resnet18", "--devices", "v100@0:0-3", "--topology", str(BOX)), 2, ("leave it out",)),
    (("plan", "resnet18", "--devices", "h100x2", "--input-shape", "3,x,32"), 2, ("--input-shape", "3,224,224")),
    (("plan", "resnet18", "--devices", "h100x2", "--input-shape", "3,32"), 2,
     ("failed on example inputs of shape [(32, 3, 32)]", "pass --input-shape")),
    (("plan", "resnet18", "--devices", "h100x2", "--leaf-modules", "Block"), 2, ("no such module class", "BasicBlock")),
    (("plan", "resnet18", "--devices", "h100x2", "--chunks", "0"), 2, ("must be positive",)),
    (("bench", "resnet18", "--devices", "h100x2"), 2, ("not a preset", "fxpipe plan")),
    (("bench", "resnet18", "--steps", "0"), 2, ("--steps must be 1 to 20",)),
])
def test_user_errors_are_one_line_naming_the_cause_and_the_fix(capsys, args, code, words):
    got, out, err = fxpipe_cli(capsys, *args)
    assert got == code, (got, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.mark.slow   # 10-25 s with the machine's load average at 10-15: a compile and four training steps
def test_bench_prints_its_table(capsys):
    code, out, err = fxpipe_cli(capsys, "-q", "bench", "torchvision:resnet18", *SMALL, "--profile", "estimate",
                                "--steps", "1")
    assert code == 0, err
    lines = out.splitlines()
    assert "batch 8 in 2 micro-batches, 1f1b, devices cpu,cpu, 2 stages" in lines[0]
    rows = {line[:34].strip(): line[34:].split() for line in lines[2:]}
    assert list(rows) == ["compile", "model's own step", "pipeline step (median of 1)", "predicted step (plan)",
                          "predicted step (pipe.report)"]
    assert all(float(v[0]) > 0 for v in rows.values()) and rows["model's own step"][1] == "1.00x"


@pytest.mark.parametrize("command", ["plan", "bench", "show", "diff", "topo", "demo"])
def test_every_subcommand_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "example" in out and f"fxpipe {command}" in out, out


def test_a_model_with_keyword_or_structured_outputs_is_refused_by_bench(tmp_path, capsys):
    (tmp_path / "dictmodel.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return {'y': self.a(x)}\n"
        "def build():\n"
        "    return M()\n")
    code, _, err = fxpipe_cli(capsys, "bench", f"{tmp_path / 'dictmodel.py'}:build", "--input-shape", "4",
                              "--batch", "4", "--chunks", "2")
    assert code == 2 and "one tensor output" in err and "returns dict" in err, err
