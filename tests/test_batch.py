"""`--batch`: sequences decoded together in our loop (core.decode.decode_batch over core.static_lm.BatchedLM). Each
slot's greedy tokens and accepted lengths are its batch-of-one's, for every kind of method; slots of different
lengths, finishing at different steps, never see each other's rows."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

from specbench import methods
from specbench.cli.main import main
from specbench.config import RunConfig
from specbench.core import acceptance
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import Generation, Job, Step, decode, decode_batch
from specbench.core.losslessness import sampling_test
from specbench.core.static_lm import BatchedLM, Row
from specbench.core.tree import Tree
from specbench.errors import SpecbenchError
from specbench.heads import dflash as dflash_heads
from specbench.methods.dflash import DFlash
from specbench.methods.eagle import Eagle
from specbench.methods.eagle_trees import DynamicTree
from specbench.methods.sps import DraftModel
from specbench.models.chat import prompt_ids
from specbench.models.decoder import Decoder
from specbench.models.loading import load_causal_lm, load_tokenizer
from specbench.report import batches, metrics
from specbench.report.cells import collect_cells
from specbench.report.sources import load_sources
from specbench.run.plan import check_batch, make
from specbench.run.worker import batch_shares
from specbench.zoo import TINY_DIR

from .conftest import CUDA, random_llama
from .test_tree_methods import random_eagle_head
from .test_verify import UniformClaimDraft

# one of each kind: no drafter, a draft model's chain (its slots drafted together), EAGLE's tree from the target's
# features, a Jacobi side branch. (Suffix decoding's global index is shared by the batch's slots, so its acceptance
# moves with B: docs/metrics.md.)
METHODS = ("vanilla", "sps", "eagle2", "lookahead")
HEADS = {
    family: TINY_DIR / family
    for family in ("pard", "pard2", "medusa", "eagle", "eagle3", "peagle", "dflash", "dflash2", "dspark")
}


@pytest.fixture(scope="module")
def tiny():
    """The tiny family's target, and a chat prompt for it."""
    target = load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(TINY_DIR / "target")
    return target, prompt_ids(tokenizer, [{"role": "user", "content": "Name three uses of a paperclip."}])


@pytest.fixture(scope="module")
def target():
    return Decoder.adopt(random_llama(64, layers=2, seed=4, init=0.3))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_every_slot_sees_its_own_rows_only(target, device):
    """Two slots of different lengths prefilled together (one padded to the other), then in one forward (a tree
    in one, a chain in the other, a third slot idle) give the logits and features each gives alone; rows past a
    slot's length hold large garbage, planted, and reach nobody (NaN would reach everybody: a masked key still
    multiplies); a commit in one slot moves nothing in the other."""
    target = copy.deepcopy(target).to(device)
    batched, alone = BatchedLM(target, 3, context=64), [BatchedLM(target) for _ in range(2)]
    prompts = [[5, 9, 11, 3, 7, 21, 30, 2, 8], [40, 41]]
    prefilled = batched.prefill([0, 1], prompts, layers=(1, -1))
    for ours, lm, prompt in zip(prefilled, alone, prompts, strict=True):
        (theirs,) = lm.prefill([0], [prompt], (1, -1))
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.features, theirs.features, rtol=1e-5, atol=1e-5)
    assert not batched.cache.keys.requires_grad  # (a prefill outside inference mode chained every write's graph)
    with torch.inference_mode():  # every row no slot holds: garbage
        for stored in (batched.cache.keys, batched.cache.values):
            for slot, length in enumerate(batched.lengths):
                for layer in range(2):
                    rows = stored[slot, :, layer * batched.capacity + length : (layer + 1) * batched.capacity]
                    rows.copy_(torch.randn(rows.shape, device=device) * 1e3)
    tree = Tree([12, 13, 14], [-1, -1, 0])
    rows = [Row(0, tree.rows(8), tree), Row(1, [2, 17, 18])]
    outs = batched.run(rows)
    expected = [alone[0].run([Row(0, tree.rows(8), tree)])[0], alone[1].run([Row(0, [2, 17, 18])])[0]]
    for ours, theirs in zip(outs, expected, strict=True):
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)
    batched.commit([(0, 8, [0, 2]), (1, 1, [0, 1, 2])])
    alone[0].commit([(0, 8, [0, 2])])
    alone[1].commit([(0, 1, [0, 1, 2])])
    assert batched.lengths == [10, 4, 0]
    outs = batched.run([Row(0, [20]), Row(1, [21])])  # after the commits
    for ours, lm, token in zip(outs, alone, [20, 21], strict=True):
        torch.testing.assert_close(ours.logits, lm.run([Row(0, [token])])[0].logits, rtol=1e-5, atol=1e-5)
    batched.run([Row(0, [22, 23, 24])])  # slot 1 idle, its rows kept: the padding must not land on them
    ours, theirs = batched.run([Row(1, [25])])[0], alone[1].run([Row(0, [25])])[0]
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True], ids=["draft-per-slot", "shared-draft"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_slots_refilled_as_turns_end_give_each_turns_tokens_alone(target, device, shared):
    """Five turns of different lengths and budgets through two slots (one ends at a stop token, the others at their
    budgets), sps drafting for both, with a cache of the draft per slot (transformers', one after another) or one
    batched cache (drafting them together in one forward per depth): every turn's tokens, accepted lengths and picks
    are its batch of one's."""
    target = copy.deepcopy(target).to(device)
    theirs = random_llama(64, layers=1, seed=5, init=0.3).to(device)
    draft = Decoder.adopt(theirs)
    prompts = [[5, 9, 11], [40, 41, 42, 43, 44, 45, 46], [7], [3, 3, 3, 9], [12, 30]]
    budgets = [9, 3, 12, 6, 7]
    single = BatchedLM(target)
    alone = [
        decode(single, DraftModel(BatchedLM(draft), 3), p, max_new_tokens=b, temperature=0, stop_ids={17})
        for p, b in zip(prompts, budgets, strict=True)
    ]
    jobs = [Job(p, b, 0.0, request=(i, 0)) for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
    ended: dict[int, object] = {}
    together, widths = BatchedLM(draft, 2, context=64), []
    verify = together.verify
    together.verify = lambda rows, **options: widths.append(len(rows)) or verify(rows, **options)
    wall = decode_batch(
        BatchedLM(target, 2, context=64),
        DraftModel(together if shared else theirs, 3),
        lambda: jobs.pop(0) if jobs else None,
        lambda job, gen: ended.__setitem__(job.request[0], gen),
        stop_ids={17},
        rule=acceptance.EXACT,
    )
    assert sorted(ended) == list(range(5))
    for i, gen in ended.items():
        assert (gen.tokens, gen.accept_lengths) == (alone[i].tokens, alone[i].accept_lengths), i
        assert gen.target_top1 == alone[i].target_top1
        assert 0 <= gen.started < gen.ended <= wall + 1e-3  # (a GPU's marks are its events)
    assert len({len(g.tokens) for g in alone}) > 2  # (the turns do end at different steps)
    assert (max(widths, default=0) == 2) == shared  # (a shared draft drafted both slots in one forward)


def test_methods_at_batch_3_give_their_batch_1_tokens(tmp_path):
    """A run at batch sizes 1 and 3: each method's tokens at B = 3 are its own at B = 1 (and vanilla's, the greedy
    check), question by question, and so are the accepted lengths."""
    out = tmp_path / "run"
    argv = ["run", "--methods", ",".join(METHODS), "--batch", "1,3", "--limit", "1", "--tasks", "quick"]
    argv += ["--max-new-tokens", "8", "--no-report", "--no-noise-floor", "--no-warmup", "--out", str(out)]
    assert main(argv) == 0
    answers: dict[tuple, dict] = {}
    for path in (out / "answers" / "quick").glob("*.jsonl"):
        for line in path.open():
            record = json.loads(line)
            ours = record["specbench"]
            answers[ours["method"], ours["batch_size"], record["question_id"]] = record
    assert {b for _, b, _ in answers} == {1, 3}
    for (method, batch, question), record in answers.items():
        if batch == 1:
            continue
        one = answers[method, 1, question]
        assert record["specbench"]["output_ids"] == one["specbench"]["output_ids"], (method, question)
        assert len(record["specbench"]["batch_times"]) == len(one["specbench"]["output_ids"])  # a span per turn
        if method != "vanilla":
            assert record["specbench"]["greedy_check"]["match"], (method, question)
        same = record["choices"][0]["accept_lengths"] == one["choices"][0]["accept_lengths"]
        assert same, (method, question)
    (group,) = batches.groups(collect_cells(load_sources([out])))  # the report's batch sweep: B = 1 and 3 side by side
    rows = batches.rows(group)
    assert sorted(zip(rows.method, rows.batch, strict=True)) == sorted((m, b) for m in METHODS for b in (1, 3))
    assert (rows.total >= rows.per_user).all()
    table = batches.table(group).splitlines()
    assert len(table) == 2 + len(rows) and any(line.startswith("| vanilla ") and "|   3 |" in line for line in table)
    for split in rows.split:  # ms/step at every B: a forward measured and profiled, inside the whole step
        step, forward, profiled, drafting, rest = split
        assert 0 < forward < step and profiled > 0 and drafting >= 0


def test_total_throughput_hand_worked():
    """Two turns of one batch, 10 and 30 tokens over [0, 2] and [1, 4] s: 40 tokens in 4 s together, 40 in 5 s of
    their own spans (per-user); a batch of one sums its wall times."""
    turns = pd.DataFrame(
        {"new_tokens": [10, 30], "wall_time": [2.0, 3.0], "batch_start": [0.0, 1.0], "batch_end": [2.0, 4.0]}
    )
    assert metrics.total_throughput(turns) == 10.0 and metrics.tokens_per_second(turns) == 8.0
    alone = turns.assign(batch_start=float("nan"), batch_end=float("nan"))
    assert metrics.total_throughput(alone) == 8.0


def test_a_batchs_step_split_hand_worked():
    """Two steps of a turn (shared by 2 slots, then alone; widest slots of 3 and 9 rows: buckets 4 and 16) give its
    shares; two turns' shares give the batch's seconds per step: 3 steps in 60 ms, 30 ms of forwards (27 profiled),
    6 ms of drafting, so 20 ms a step: 10 forward [9], 2 drafting, 8 the rest."""
    steps = [Step(2, 1, 3, 0.001, 0.010, slots=2, width=3), Step(1, 0, 9, 0.002, 0.020, slots=1, width=9)]
    profile = {1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008, 16: 0.016}
    assert batch_shares(Generation([1, 2, 3], steps), profile) == pytest.approx([1.5, 0.025, 0.018])
    turns = pd.DataFrame(
        {
            "batch_steps": [2.0, 1.0],
            "batch_forward": [0.02, 0.01],
            "batch_profiled": [0.018, 0.009],
            "draft_time": [0.004, 0.002],
            "batch_start": [0.0, 0.0],
            "batch_end": [0.05, 0.06],
        }
    )
    assert metrics.batch_step_split(turns) == pytest.approx((0.02, 0.01, 0.009, 0.002, 0.008))
    assert metrics.batch_step_split(turns.assign(batch_steps=float("nan"))) is None  # (B = 1: not recorded)


@pytest.mark.parametrize("proposer", [DraftModel, UniformClaimDraft], ids=["sps", "planted-mistake"])
def test_the_sampling_audit_at_batch_4(proposer):
    """Samples drawn four at a time (`verify --batch 4`'s), the slots drafting together from one shared draft (each
    slot's draws from its own generator): sps passes the chi-square against vanilla's exact law; a draft that claims
    uniform draft probabilities fails it."""
    target, draft = (random_llama(8, layers=1, hidden=32, seed=s, init=0.5) for s in (0, 1))
    draft = Decoder.adopt(draft)
    shared, widths = BatchedLM(draft, 4, context=16), []
    verify = shared.verify
    shared.verify = lambda rows, **options: widths.append(len(rows)) or verify(rows, **options)
    slots = proposer(shared, 3)
    prompt = [1, 2, 3, 1, 2]
    result = sampling_test(
        CachedLM(target),
        proposer(draft, 3),
        prompt,
        horizon=2,
        samples=800,
        temperature=1.0,
        stop_ids=set(),
        batch=(BatchedLM(Decoder.adopt(target), 4, context=16), slots),
    )
    assert result.passed == (proposer is DraftModel), result
    assert max(widths) > 1  # (the slots drafted in one forward per depth)


def _slots_drafting_together(method: str, target, widths: list[int]):
    """Four slots of `method` on one static drafting for the batch (random heads for the small-vocabulary target),
    each drafting call's slot count appended to `widths`."""
    if method == "eagle2":
        head, lm_head = random_eagle_head(target), target.get_output_embeddings()
        eagle = Eagle(head, lm_head, DynamicTree(10, 1, 3), slots=4, capture=False)
        together = eagle.static._together
        eagle.static._together = lambda members, depth: widths.append(len(members)) or together(members, depth)
        return eagle
    torch.manual_seed(3)
    draft = dflash_heads.build(dflash_heads.config_for(target.config, 1, 3, mask_token_id=7)).eval()
    with torch.no_grad():  # larger weights: peaked drafts that the target often rejects
        for weights in draft.parameters():
            weights.mul_(4)

    embed, readout = target.get_input_embeddings(), target.get_output_embeddings()
    dflash = DFlash(draft, embed, readout, 2, slots=4, capture=False)
    blocks = dflash.blocks
    together = blocks._together
    blocks._together = lambda members: widths.append(len(members)) or together(members)
    return dflash


@pytest.mark.parametrize("method", ["eagle2", "dflash"])
def test_the_sampling_audit_at_batch_4_with_slots_drafting_together(method):
    """EAGLE-2's trees and DFlash's blocks drafted for four slots at once, each slot's draws from its own
    generator: the samples, four at a time, pass the chi-square against vanilla's exact law."""
    target = random_llama(8, layers=1, hidden=32, seed=0, init=0.5)
    widths: list[int] = []
    slots = _slots_drafting_together(method, target, widths)
    result = sampling_test(
        CachedLM(target),
        slots,
        [1, 2, 3],  # (a prompt of two pairs: its first draft fits the padded, together forward)
        horizon=2,
        samples=800,
        temperature=1.0,
        stop_ids=set(),
        batch=(BatchedLM(Decoder.adopt(target), 4, context=16), slots),
    )
    assert result.passed, result
    assert max(widths, default=0) > 1


def answered_together(target, slots, prompts: list, budgets: list[int], alone: list[Generation]) -> list[Generation]:
    """The greedy turns of `prompts` (with these token budgets) answered in one batch of their number by `slots`,
    each checked against its batch of one (`alone`: tokens and accepted lengths)."""
    jobs = [Job(p, n, 0.0, request=(i, 0)) for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]
    ended: dict[int, Generation] = {}
    decode_batch(
        BatchedLM(Decoder.adopt(target), len(prompts)),
        slots,
        lambda: jobs.pop(0) if jobs else None,
        lambda job, gen: ended.__setitem__(job.request[0], gen),
        stop_ids=set(),
    )
    for i, gen in ended.items():
        assert (gen.tokens, gen.accept_lengths) == (alone[i].tokens, alone[i].accept_lengths), i
    return [ended[i] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "method",
    ["pard", "pard2", "medusa", "eagle", "eagle3", "eagle[nodes=1]", "peagle", "dflash", "dflash[tree=12]", "dflash2"],
)
def test_model_drafters_draft_their_slots_together(tiny, method):
    """Two slots of a batch share one drafter (PARD's or PARD-2's model, Medusa's heads, EAGLE's or P-EAGLE's head or
    DFlash's drafter on one static cache: loaded once) and draft in one forward per step (per level for EAGLE's
    trees; the prompts of EAGLE, P-EAGLE and DFlash, of different lengths, fed in one forward too); each slot's
    tokens and accepted lengths are its batch of one's."""
    target, prompt = tiny
    res = methods.Resources("tiny", target, None, torch.device("cpu"), torch.float32, head_paths=HEADS)
    prompts = [prompt, prompt[: len(prompt) // 2]]
    alone = [
        decode(CachedLM(target), methods.build_batch(method, res), p, max_new_tokens=32, temperature=0, stop_ids=set())
        for p in prompts
    ]
    slots = methods.build_batch(method, res, 2)
    widths: list[int] = []
    prompts_fed: list[int] = []  # the slots of each uncaptured forward (the prompts': both, padded, in one)
    if method.startswith("pard"):
        shared = slots.drafter.batched
        assert shared is not None and shared.batch == 2
        verify = shared.verify  # (what its run and its greedy picks both call)
        shared.verify = lambda rows, **options: widths.append(len(rows)) or verify(rows, **options)
    elif method == "medusa":
        top = slots._top
        slots._top = lambda hidden: widths.append(len(hidden)) or top(hidden)
    elif method == "peagle":
        assert slots.batch == 2
        together, apart = slots._together, slots._apart
        slots._together = lambda members: widths.append(len(members)) or together(members)
        slots._apart = lambda members: prompts_fed.append(len(members)) or apart(members)
    elif method.startswith("dflash"):
        blocks = slots.blocks
        assert blocks.batch == 2
        together, apart = blocks._together, blocks._apart
        blocks._together = lambda members: widths.append(len(members)) or together(members)
        blocks._apart = lambda members: prompts_fed.append(len(members)) or apart(members)
    else:
        drafting = slots.static
        assert drafting.batch == 2
        together, apart = drafting._together, drafting._apart
        drafting._together = lambda members, depths: widths.append(len(members)) or together(members, depths)
        drafting._apart = lambda members, depths: prompts_fed.append(len(members)) or apart(members, depths)
    for gen in answered_together(target, slots, prompts, [32, 32], alone):
        assert max(gen.accept_lengths) > 1  # (its drafts were accepted: the check compared real drafting)
    assert max(widths) == 2
    assert prompts_fed[:1] == ([] if method.startswith("pard") or method == "medusa" else [2])


@pytest.mark.parametrize("method", ["eagle3", "sps", "pard", "peagle", "dflash", "dflash[tree=12]", "dspark"])
def test_slots_near_their_budget_draft_with_the_others_at_t0(tiny, method):
    """At T = 0 a slot whose token budget leaves room for fewer drafts than the method drafts drafts them all with
    its batch-mates (EAGLE: one drafting group a step, not one a depth; a chain: one length, every chain a row of one
    block), its tree cut to the budget in the verdict: each slot keeps its batch of one's tokens and accepted
    lengths, budgets of 32 and 9 tokens. At the end of the target's context the drafted rows lie past it (they are
    never kept): that batch too keeps its batch of one's tokens."""
    target, prompt = tiny
    res = methods.Resources(
        "tiny", target, None, torch.device("cpu"), torch.float32, TINY_DIR / "draft", head_paths=HEADS
    )
    budgets = [32, 9]
    alone = [
        decode(
            CachedLM(target), methods.build_batch(method, res), prompt, max_new_tokens=n, temperature=0, stop_ids=set()
        )
        for n in budgets
    ]
    slots = methods.build_batch(method, res, 2)
    groups: list[int] = []  # EAGLE: each drafting group's depth; the others: each proposal's depth
    if method == "eagle3":
        drafting = slots.static
        together = drafting._together
        drafting._together = lambda members, depths: groups.append(depths) or together(members, depths)
        full = slots.expansion.max_depth
    else:
        propose = slots.propose
        slots.propose = lambda *a: [groups.append(p.tree.depth_bound()) or p if len(p.tree) else p for p in propose(*a)]
        full = slots.k
    ended = answered_together(target, slots, [prompt, prompt], budgets, alone)
    assert set(groups) == {full}  # never a shallower group or chain
    assert sum(len(gen.tokens) for gen in ended) == sum(budgets)
    edge = BatchedLM(Decoder.adopt(target), 2, context=len(prompt) + 9)  # the short turn's last drafts pass its end
    jobs = [Job(prompt, n, 0.0, request=(i, 0)) for i, n in enumerate(budgets)]
    done: dict[int, Generation] = {}
    decode_batch(
        edge,
        methods.build_batch(method, res, 2),
        lambda: jobs.pop(0) if jobs else None,
        lambda job, gen: done.__setitem__(job.request[0], gen),
        stop_ids=set(),
    )
    assert done[0].tokens == done[1].tokens == alone[1].tokens  # (both budgets cut to the context's 9 tokens)


def test_a_batch_that_cannot_fit_is_refused_at_plan_time(capsys):
    """The tiny target in float32 keeps 2 x 12 layers x 5 heads x 64 x 4 bytes = 30 KiB a token; a slot of 8-token
    turns holds at least 1 + 8 + 128 tokens, plus 128 a forward may pad: 265 x 30 KiB. Memory for three such slots
    beside the weights refuses four, naming three; `run --batch 100000 --dry-run` is one line, exit 2."""
    cfg = RunConfig(methods=["vanilla"], tasks=["quick"], max_new_tokens=8, device="cpu", dtype="float32")
    plan = make(cfg)
    per_slot = 265 * 2 * 12 * 5 * 64 * 4
    files = plan.checkpoints["target"].listing.files
    weights = sum(size for name, size in files.items() if name.endswith(".safetensors"))
    check_batch(replace(cfg, batch=[1, 3]), plan, weights + 3 * per_slot + 1)
    with pytest.raises(SpecbenchError, match="largest batch that fits is 3: pass --batch 3 or less"):
        check_batch(replace(cfg, batch=[1, 4]), plan, weights + 3 * per_slot + 1)
    assert main(["run", "--batch", "100000", "--tasks", "quick", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--batch 100000 does not fit" in err and "largest batch that fits is" in err and "\n" not in err


def test_a_reused_prefill_goes_back_to_its_rows_until_they_may_be_written_over(target):
    """The sampling audit answers one prompt thousands of times: a prefill of the same prompt and layers with
    `reuse` returns the first's output and crops back to its rows, while the slot still holds them; a rewind below
    them, or another prompt, makes the next one compute again."""
    lm = BatchedLM(target, 2, context=64, capture=False)
    prompt = [5, 9, 11, 3, 7]
    (first,) = lm.prefill([1], [prompt], reuse=True)
    lm.run([Row(1, [4, 6])])  # a decode's rows after it
    (again,) = lm.prefill([1], [prompt], reuse=True)
    assert again is first and lm.lengths == [0, 4]
    (other,) = lm.prefill([1], [prompt], layers=(1,), reuse=True)  # other layers: computed
    assert other is not first and other.features is not None
    lm.rewind(1, 2)  # below the prompt's rows: they may be written over
    (fresh,) = lm.prefill([1], [prompt], layers=(1,), reuse=True)
    assert fresh is not other
    torch.testing.assert_close(fresh.logits, first.logits, rtol=1e-5, atol=1e-5)
    (plain,) = lm.prefill([1], [prompt], layers=(1,))  # without reuse: always computed
    assert plain is not fresh
