"""The command lines documented in the README, in docs/ and in --help run.

The commands run in this process (``run``: ``main(argv)`` as ``python -m`` calls it, its exit code, stdout and
stderr): a fresh interpreter costs an import of torch each, 5-15 s on the CI machine. Two tests start real
processes, for what only a process shows: ``python -m fxpipe`` and ``python -m solvers`` as entry points, and
``-v``/``-q``'s logging, which is set up once per process.
"""

import contextlib
import io
import subprocess
import sys

from fxpipe.__main__ import main as fxpipe_main
from solvers.__main__ import main as solvers_main


def process(*args, timeout=600):
    """``python -m ARGS`` in a new interpreter."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def run(program, *args):
    """``program ARGS`` (fxpipe or solvers) in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = {"fxpipe": fxpipe_main, "solvers": solvers_main}[program](list(args))
        except SystemExit as exc:   # argparse: --help, and usage errors
            code = 0 if exc.code is None else exc.code
    return subprocess.CompletedProcess([program, *args], code, out.getvalue(), err.getvalue())


def test_fxpipe_help_lists_commands_and_examples():
    out = process("fxpipe", "--help")
    assert out.returncode == 0, out.stderr
    for word in ("demo", "plan", "bench", "show", "fxpipe demo", "fxpipe plan torchvision:resnet101"):
        assert word in out.stdout


def test_plan_and_show(tmp_path):
    path = tmp_path / "r18.plan.json"
    out = run("fxpipe", "plan", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "32",
              "--profile", "estimate", "--save", str(path))
    assert out.returncode == 0, out.stderr
    assert "fxpipe plan for ResNet" in out.stdout and path.exists()
    shown = run("fxpipe", "show", str(path))
    assert shown.returncode == 0 and "bottleneck: stage" in shown.stdout


def test_small_demo_reports_a_match():
    out = run("fxpipe", "demo", "--model", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "64",
              "--profile", "estimate")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MATCH: the pipeline computes the same function" in out.stdout


def test_ci_runs_the_readme_commands():
    """.ci/run extracts the README's <!-- ci --> blocks; they must install and run the demo and the tests."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    blocks = readme.split("<!-- ci -->")[1:]
    commands = [b.split("```bash\n", 1)[1].split("```", 1)[0].strip() for b in blocks]
    assert any("pip install" in c and "python -m fxpipe demo" in c for c in commands), commands
    assert any("pytest" in c for c in commands), commands
    assert "<!-- ci -->" in (root / ".ci" / "run").read_text()


def test_plan_for_a_preset_without_the_hardware(tmp_path):
    path = tmp_path / "r18-h100.plan.json"
    out = run("fxpipe", "plan", "resnet18", "--preset", "h100", "--count", "2", "--batch", "8", "--chunks", "2",
              "--image-size", "64", "--save", str(path))
    assert out.returncode == 0, out.stderr
    assert "profile: analytic on H100-SXM5-80GB" in out.stdout and "param+grad+opt GiB" in out.stdout
    assert path.exists()
    bad = run("fxpipe", "plan", "resnet18", "--preset", "tpu")
    assert bad.returncode != 0 and "unknown device preset 'tpu'" in bad.stderr


def test_solvers_search_help_and_fxpipe_help_mention_the_new_commands():
    assert "search" in process("solvers", "--help").stdout
    assert "--devices v100x8" in run("fxpipe", "--help").stdout


def test_plan_without_a_preset_uses_the_schedule_asked_for(tmp_path):
    path = tmp_path / "r18-zb.plan.json"
    out = run("fxpipe", "plan", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "32",
              "--profile", "estimate", "--schedule", "zb-h1", "--save", str(path))
    assert out.returncode == 0, out.stderr
    assert "schedule zb-h1" in out.stdout
    import fxpipe
    assert fxpipe.load_plan(path).schedule == "zb-h1"


def test_plan_recomputes_what_memory_needs_by_default_and_checkpoint_says_otherwise(tmp_path):
    """``fxpipe plan`` defaults to ``--checkpoint auto`` as ``fxpipe.compile`` and ``fxpipe.plan`` do (nothing
    recomputed where the memory holds it), and ``--checkpoint MODE`` plans that mode, on this machine's devices and
    for a preset; a mode the runtime does not run is one error line naming the modes."""
    import fxpipe
    measured = run("fxpipe", "plan", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "32",
                   "--profile", "estimate", "--schedule", "1f1b", "--save", str(tmp_path / "auto.json"))
    assert measured.returncode == 0, measured.stderr
    plan = fxpipe.load_plan(tmp_path / "auto.json")
    assert plan.checkpoint == "auto" and {st.checkpoint for st in plan.stages} == {"never"}, plan.checkpoint
    llama = ("num_hidden_layers=4,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
             "vocab_size=256,max_position_embeddings=64")
    preset = run("fxpipe", "plan", "hf:llama", "--config", llama, "--seq-len", "16", "--batch", "8", "--devices",
                 "h100x2", "--schedule", "1f1b", "--chunks", "4", "--checkpoint", "blocks", "-q",
                 "-o", str(tmp_path / "blocks.json"))
    assert preset.returncode == 0, preset.stderr
    assert fxpipe.load_plan(tmp_path / "blocks.json").checkpoint == "blocks"
    bad = run("fxpipe", "plan", "resnet18", "--batch", "4", "--image-size", "32", "--profile", "estimate",
              "--checkpoint", "sometimes")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "'sometimes'" in bad.stderr
    assert "'blocks:K'" in bad.stderr, bad.stderr


def test_files_that_cannot_be_read_or_written_are_named_without_a_traceback(tmp_path):
    missing = run("fxpipe", "show", str(tmp_path / "nope.plan.json"))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.startswith("error: ") and "nope.plan.json" in missing.stderr
    unwritable = tmp_path / "no-such-dir" / "r18.plan.json"
    out = run("fxpipe", "plan", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "32",
              "--profile", "estimate", "--save", str(unwritable))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: ") and f"{unwritable}: No such file or directory" in out.stderr


def test_the_documented_compare_command_names_files_that_exist():
    """The README once sent users to problems/*.json, which does not exist (the corpus is benchmarks/problems/);
    the command now lives in docs/solvers.md, and every page that shows it is read."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    lines = [(page.name, line.split("#")[0].split()) for page in pages for line in page.read_text().splitlines()
             if line.startswith("python -m solvers compare")]
    assert any(name == "solvers.md" for name, _ in lines), lines
    for name, words in lines:
        for pattern in [w for w in words[4:] if not w.startswith("-")]:
            assert sorted(root.glob(pattern)), f"{name}: {' '.join(words)}: {pattern} matches nothing"


def test_topo_prints_the_classes_and_the_bandwidths_used(tmp_path):
    from pathlib import Path
    topo = Path(__file__).parent / "data" / "titan-v-8gpu-2socket.txt"
    png = tmp_path / "links.png"
    out = run("fxpipe", "topo", str(topo), "--png", str(png))
    assert out.returncode == 0, out.stderr
    assert "8 GPUs" in out.stdout and "GPU7    SYS" in out.stdout
    assert "PIX     12.0 GB/s    8.0 us" in out.stdout and "SYS      6.0 GB/s   20.0 us" in out.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "fxpipe topo box.topo.txt" in run("fxpipe", "topo", "--help").stdout


def test_topo_errors_name_the_file_and_the_fix(tmp_path):
    missing = run("fxpipe", "topo", str(tmp_path / "box.txt"))
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "box.txt: No such file" in missing.stderr
    wrong = tmp_path / "notes.txt"
    wrong.write_text("hello\n")
    bad = run("fxpipe", "topo", str(wrong))
    assert bad.returncode == 2 and "not nvidia-smi topo -m output" in bad.stderr and "Traceback" not in bad.stderr


def test_verbose_logs_and_quiet_silences():
    args = ("plan", "resnet18", "--batch", "4", "--chunks", "2", "--image-size", "32", "--profile", "estimate")
    loud = process("fxpipe", "-v", *args)
    assert loud.returncode == 0 and "fxpipe: " in loud.stderr and " nodes " in loud.stderr, loud.stderr   # or cached
    quiet = process("fxpipe", "-q", *args)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert run("fxpipe", "-v", "-q", *args).returncode == 2    # one or the other


def test_show_json_and_png_and_diff(tmp_path):
    import json
    common = ("--batch", "4", "--chunks", "2", "--image-size", "32", "--profile", "estimate", "-q")
    a, b = tmp_path / "a.plan.json", tmp_path / "b.plan.json"
    assert run("fxpipe", "plan", "resnet18", *common, "--save", str(a)).returncode == 0
    assert run("fxpipe", "plan", "resnet18", *common, "--devices", "cpu,cpu,cpu", "--save", str(b)).returncode == 0
    shown = run("fxpipe", "show", str(a), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout) == json.loads(a.read_text())
    drawn = run("fxpipe", "show", str(a), "--png", str(tmp_path / "a.png"))
    assert drawn.returncode == 0, drawn.stderr
    assert all((tmp_path / f).read_bytes()[:4] == b"\x89PNG" for f in ("a.png", "a.timeline.png"))
    same = run("fxpipe", "diff", str(a), str(a))
    assert same.returncode == 0 and "same pipeline" in same.stdout
    other = run("fxpipe", "diff", str(a), str(b))
    assert other.returncode == 1 and "stages: 2 -> 3" in other.stdout and "predicted iteration" in other.stdout
    missing = run("fxpipe", "diff", str(a), str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "nope.json" in missing.stderr
    for command in ("show", "diff"):
        assert "examples:" in run("fxpipe", command, "--help").stdout
