"""`--graphs` on the CPU: the static KV cache and bucket padding without capture give the eager loop's tokens,
row for row; the capture itself needs a GPU (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specbench import tasks
from specbench.cli.main import main
from specbench.core import acceptance
from specbench.core.cached_lm import CachedLM, margins
from specbench.core.capture import Replays
from specbench.core.decode import decode
from specbench.core.one_slot import OneSlot
from specbench.core.own_step import verify
from specbench.core.proposer import Proposal
from specbench.core.static_lm import BatchedLM, Row
from specbench.core.transfer import upload
from specbench.core.tree import DeviceTree, Tree
from specbench.methods.sps import DraftModel
from specbench.methods.vanilla import Vanilla
from specbench.models.decoder import Decoder
from specbench.models.loading import load_causal_lm
from specbench.zoo import TINY_DIR
from tests.conftest import CUDA

PROMPT = [5, 17, 99, 230, 11, 42, 7, 301, 64, 12]


@pytest.fixture(scope="module")
def target():
    return load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32, "target")


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_tree_forward_and_commit_match_the_eager_cache(target, device):
    """The same prefill, tree forwards (logits and features) and commits (every layer's rows moved at once) from a
    tree on the host and the same tree on the device; the next forward sees the same cache in both."""
    model = target.to(device)
    eager, static = OneSlot(CachedLM(model)), BatchedLM(Decoder.adopt(model))
    tree = Tree([40, 41, 42, 43], [-1, -1, 1, 2])  # two children of the root, the second with a chain of two
    for lm in (eager, static):
        lm.prefill([0], [PROMPT])
    for root, keep in ((PROMPT[-1], [0, 2, 3]), (9, [0, 1, 4])):
        start = eager.lengths[0]
        drafted = DeviceTree(torch.tensor(tree.tokens, device=device), torch.tensor(tree.parents, device=device), 3)
        outs = [lm.run([Row(0, t.rows(root), t)], layers=(2, -1))[0] for lm, t in ((eager, tree), (static, drafted))]
        assert outs[1].logits.shape == (5, target.config.vocab_size)  # padding rows (5 -> 8) are not returned
        assert drafted.read is None  # verified from the device
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[1].features, outs[0].features, rtol=1e-4, atol=1e-4)
        for lm in (eager, static):
            lm.commit([(0, start, keep)])
        assert static.lengths == eager.lengths == [start + 3]
        nxt = [lm.run([Row(0, [7, 8])])[0].logits for lm in (eager, static)]
        torch.testing.assert_close(nxt[1], nxt[0], rtol=1e-4, atol=1e-4)
    static.rewind(0, len(PROMPT))
    assert static.lengths == [len(PROMPT)]
    target.to("cpu")


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_greedy_forward_computes_its_picks_inside_the_captured_function(target, device):
    """At T = 0 a captured forward computes every row's argmax and top-1/2 margin inside its graph, so the step
    launches none of it from the host; the verification keeps the accepted rows' picks, as the eager cache's
    (which leaves them to the step: it needs a few rows' margins only)."""
    model = target.to(device)
    eager, static = OneSlot(CachedLM(model)), BatchedLM(Decoder.adopt(model))
    tree = Tree([40, 41, 42, 43], [-1, -1, 1, 2])
    steps = []
    for lm in (eager, static):
        lm.prefill([0], [PROMPT])
        (out,) = lm.run([Row(0, tree.rows(PROMPT[-1]), tree)], greedy=True)
        if lm is eager:
            assert out.picks is None
        else:  # (read before the next forward writes over them)
            assert out.picks[0].tolist() == out.logits.argmax(dim=-1).tolist()
            torch.testing.assert_close(out.picks[1], margins(out.logits), rtol=0, atol=0)
        lm.rewind(0, len(PROMPT) - 1)
        steps.append(verify(lm, PROMPT[-1], Proposal(tree), acceptance.EXACT, 0.0, None))
    assert steps[1].new == steps[0].new and steps[1].picks[0] == steps[0].picks[0] == steps[0].new
    torch.testing.assert_close(steps[1].picks[1], steps[0].picks[1], rtol=1e-4, atol=1e-4)
    target.to("cpu")


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_an_upload_queues_host_values_on_the_device(device):
    ids = upload([3, 1, 2], torch.device(device))
    assert (ids.device.type, ids.dtype, ids.tolist()) == (device, torch.long, [3, 1, 2])
    mask = torch.rand(2, 3)
    assert torch.equal(upload(mask, torch.device(device)).cpu(), mask)


def test_a_prompt_longer_than_the_largest_bucket_and_a_full_cache(target):
    static, eager = BatchedLM(Decoder.adopt(target), capture=False), OneSlot(CachedLM(target))
    long = list(range(3, 300))
    (ours,), (theirs,) = (lm.prefill([0], [long]) for lm in (static, eager))
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-4, atol=1e-4)
    with_features = [lm.prefill([0], [PROMPT], layers=(2, -1))[0] for lm in (OneSlot(CachedLM(target)), static)]
    assert with_features[1].features.shape == (len(PROMPT) - 1, 2 * target.config.hidden_size)  # every prompt row
    torch.testing.assert_close(with_features[1].features, with_features[0].features, rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match="do not fit the static cache"):
        static.run([Row(0, list(range(static.context_length)))])


def step_ops():
    """scripts/step_ops.py, which counts what a --graphs step asks of the host."""
    spec = importlib.util.spec_from_file_location("step_ops", Path(__file__).parents[1] / "scripts" / "step_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_uncaptured_replays_keep_a_graphs_contract():
    """On a CPU a key's first call runs three times (a capture's warm-ups and the capture) and its later calls run
    the function first met there, over its inputs, writing the first call's output tensors: a caller that hands a
    replay new inputs or keeps an output past the next replay, or a function whose effects add up, fails here as it
    would on a GPU."""
    replays, inputs, runs = Replays(torch.device("cpu")), torch.zeros(2), []
    out = replays.run("k", lambda: runs.append(1) or inputs + 1)
    assert len(runs) == 3
    assert replays.run("k", lambda: torch.full((2,), 9.0)) is out and out.tolist() == [1, 1]  # what was captured
    inputs.fill_(5)
    replays.run("k", lambda: None)
    assert out.tolist() == [6, 6] and len(runs) == 5  # the earlier output, written over
    growing = [1]
    replays.run("g", lambda: torch.ones(len(growing)))
    growing.append(2)
    with pytest.raises(RuntimeError, match="changed shape, \\(1,\\) -> \\(2,\\)"):
        replays.run("g", lambda: None)


def test_the_step_counter_flags_what_a_capture_refuses():
    """A host number put at tensor indices is a copy from pageable memory; a boolean mask's count is a host read:
    on a GPU each waits, and a CUDA graph's capture refuses it (the CPU tests' only guard against either)."""
    ops = step_ops()
    counter = ops.StepCounter(ops=False)
    counter.step = ([0], [0], [], [0], [0])
    x, at = torch.zeros(4), torch.tensor([1, 2])
    with ops._Reads(counter):
        x[at] = 1.0  # uploaded
        _ = x[x > 0]  # read
        x[at] = torch.ones(2)  # neither: the values are a tensor,
        x[1:3] = 2.0  # and a slice takes a number in place
        x.masked_fill_(x > 1, 0.0)
    assert (counter.step[0], counter.step[3]) == ([1], [1])


METHODS = (
    "vanilla",
    "sps",
    "lookahead",
    "ouroboros",
    "medusa",
    "eagle",
    "eagle2",
    "eagle3",
    "peagle",
    "mtp",
    "dflash",
    "dflash2",
    "dflash2[tree=6,tree_top_k=2]",
    "dspark",
    "dspark[tree=6]",
    "pard",
    "pard2",
)


def eager_and_graphs(out, temperature: float, counting=None, tokens: int = 16) -> None:
    """Every method answers two quick questions (a two-turn one and the long summarization one; `tokens` new ones
    a turn) in the eager loop and under --graphs (on the CPU: static caches and padding, nothing captured), within
    `counting` (a context) if given; both give the same tokens and accepted lengths, step by step, and every
    drafter drafted on its static cache."""
    chosen = [q for q in tasks.load("quick").questions if q.id in (1, 5)]
    questions = out / "two.jsonl"
    questions.write_text(
        "".join(json.dumps({"id": q.id, "category": q.group, "turns": q.turns}) + "\n" for q in chosen)
    )
    common = [
        "run",
        "--methods",
        ",".join(METHODS),
        "--tasks",
        str(questions),
        "--max-new-tokens",
        str(tokens),
        "--no-report",
        "--no-noise-floor",
        "--device",
        "cpu",
        "--temperatures",
        f"{temperature:g}",
        "--no-warmup",
    ]
    assert main([*common, "--out", str(out / "eager")]) == 0
    with counting or contextlib.nullcontext():
        assert main([*common, "--graphs", "--out", str(out / "graphs")]) == 0
    manifest = json.loads((out / "graphs" / "manifest.json").read_text())
    assert manifest["config"]["graphs"] and manifest["graphs"]["captured"] is False
    assert manifest["graphs"]["eager_drafting"] == []  # every drafter here on static caches, captured on a GPU
    assert manifest["graphs"]["decoder"] == "owned"  # (the tiny family is Llama: models.decoder)
    files = sorted((out / "eager" / "answers" / "two").glob("*.jsonl"))
    assert len(files) == len(METHODS)
    for path in files:
        answers = [
            [json.loads(line) for line in (run / "answers" / "two" / path.name).open()]
            for run in (out / "eager", out / "graphs")
        ]
        for eager, graphs in zip(*answers, strict=True):
            assert eager["specbench"]["output_ids"] == graphs["specbench"]["output_ids"], path.name
            assert eager["choices"][0]["accept_lengths"] == graphs["choices"][0]["accept_lengths"], path.name


def test_every_method_under_graphs_gives_the_eager_tokens_waiting_once_a_step(tmp_path):
    """The eager loop's greedy tokens, and one read of the device per step: the accepted path, which brings a tree
    still on the device with it (`DeviceTree`); no copy onto the device from pageable host memory (on a GPU, a wait
    too). The report sets the regimes side by side. (Sampled: test_graphs_sampled.py.)"""
    counter = step_ops().StepCounter(ops=False)
    eager_and_graphs(tmp_path, 0, counter.counting(), tokens=12)
    once = [name for name in METHODS if name != "ouroboros"]  # ouroboros also waits at its draft's own checks
    assert {name: max(counter.reads[name]) for name in once} == dict.fromkeys(once, 1)
    assert {name: max(counter.uploads[name]) for name in METHODS} == dict.fromkeys(METHODS, 0)
    assert main(["report", str(tmp_path / "eager"), str(tmp_path / "graphs"), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    section = report.split("## Regimes side by side")[1].split("\n## ")[0]
    assert "eager (eager) tokens/s" in section and "graphs (graphs) tokens/s" in section
    assert "gpt-fast-style" in section  # what each regime is comparable with
    vanilla = next(line for line in section.splitlines() if line.startswith("| vanilla "))
    assert vanilla.count("1.00×") == 2 and vanilla.count("1.00 ") >= 2  # its own baseline in each regime, τ 1
    steps = re.findall(r"(\d+\.\d) \(\d+\.\d at 1 rows / (\d+\.\d) / ", vanilla)  # over the root alone
    assert len(steps) == 2 and all(float(draft) <= 0.05 * float(step) for step, draft in steps), vanilla  # no drafting
    check_summary(tmp_path / "graphs", tmp_path / "roofline.json")


def check_summary(run, roofline):
    """scripts/gpu_check.py's summary (what a closing note quotes) reads a run: here, a CPU run and a made-up
    roofline of 1,000 tokens/s."""
    roofline.write_text(
        json.dumps(
            {
                "device": "a CPU",
                "roofline_tokens_per_s": 1000.0,
                "copy_bytes_per_s": 1e11,
                "weight_bytes": 1e8,
                "clocks_idle": None,
                "clocks_warm": None,
            }
        )
    )
    script = Path(__file__).parents[1] / "scripts" / "gpu_check.py"
    done = subprocess.run(
        [sys.executable, str(script), "summary", str(run), "--roofline", str(roofline)],
        capture_output=True,
        text=True,
        check=True,
    )
    table = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in done.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    }
    assert {"vanilla", "sps", "eagle2", "medusa"} <= set(table), done.stdout
    assert table["vanilla"][5].endswith("(1.00×)") and table["vanilla"][6].endswith("(1)")  # its own step; 1 row
    rows = float(table["eagle2"][6].split("(")[1].rstrip(")"))
    assert 1 < rows <= 60, "eagle2 verifies its tree of up to 59 drafts and the root"


def test_graphs_is_one_regime(capsys):
    assert main(["run", "--graphs", "--engine", "vllm", "--methods", "vanilla", "--limit", "1"]) == 2
    assert "--graphs captures our loop's own forwards: drop --engine vllm" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sps_on_static_caches_gives_vanillas_tokens_with_step_times_inside_the_wall_time(target, device):
    """The drafted chain stays on the device (each argmax fed to the draft's next forward), is verified from there
    and read once a step; on a GPU the step times are CUDA events, and they fit inside the turn's wall time."""
    model = target.to(device)
    draft = load_causal_lm(TINY_DIR / "draft", torch.device(device), torch.float32, "draft")
    lm = BatchedLM(Decoder.adopt(model))
    plain = decode(lm, Vanilla(), PROMPT, max_new_tokens=24, temperature=0.0, stop_ids=set())
    drafter = DraftModel(BatchedLM(Decoder.adopt(draft)), 4)
    gen = decode(lm, drafter, PROMPT, max_new_tokens=24, temperature=0.0, stop_ids=set())
    target.to("cpu")
    assert gen.tokens == plain.tokens and max(gen.accept_lengths) > 1
    assert all(s.draft_time > 0 and s.verify_time > 0 for s in gen.steps)
    assert sum(s.draft_time + s.verify_time for s in gen.steps) <= gen.wall_time
