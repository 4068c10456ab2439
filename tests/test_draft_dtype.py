"""`draft_dtype`: an EAGLE head (and for EAGLE-1/2 its readout, the target's lm_head) computing in a dtype other
than the run's, on the bundled tiny family: outputs stay vanilla's, the draft stays as good, bad names fail."""

import pytest
import torch

from specbench import methods
from specbench.core.cached_lm import CachedLM
from specbench.core.decode import decode
from specbench.errors import SpecbenchError
from specbench.models import loading as models
from specbench.models.chat import prompt_ids
from specbench.models.few_rows import FewRowLinear
from specbench.zoo import TINY_DIR

HEADS = {"eagle": TINY_DIR / "eagle", "eagle3": TINY_DIR / "eagle3"}
QUESTION = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def tiny():
    target = models.load_causal_lm(TINY_DIR / "target", torch.device("cpu"), torch.float32)
    tokenizer = models.load_tokenizer(TINY_DIR / "target")
    return target, prompt_ids(tokenizer, [{"role": "user", "content": QUESTION}])


def resources(target) -> methods.Resources:
    return methods.Resources("tiny", target, None, torch.device("cpu"), torch.float32, head_paths=HEADS)


def greedy(target, proposer, prompt):
    return decode(CachedLM(target), proposer, prompt, max_new_tokens=48, temperature=0, stop_ids=set())


def test_the_draft_dtype_is_the_runs_unless_named(tiny):
    res = resources(tiny[0])
    assert res.draft_dtype(None) is torch.float32 and res.draft_dtype("bfloat16") is torch.bfloat16
    assert res.readout(torch.float32) is tiny[0].get_output_embeddings()
    readout = res.readout(torch.bfloat16)
    assert res.readout(torch.bfloat16) is readout  # one copy per dtype
    assert type(readout) is torch.nn.Linear and not isinstance(readout, FewRowLinear)  # the layout is float32's
    assert torch.equal(readout.weight, tiny[0].get_output_embeddings().weight.bfloat16())


def test_a_bad_draft_dtype_names_the_choices(tiny):
    with pytest.raises(SpecbenchError, match=r"bad parameters for method 'eagle2\[draft_dtype=float8\]'.*bfloat16"):
        methods.build("eagle2[draft_dtype=float8]", resources(tiny[0]))


@pytest.mark.parametrize("method", ["eagle", "eagle2[total_tokens=16,depth=3,top_k=4]", "eagle3[total_tokens=8]"])
def test_a_bfloat16_draft_keeps_vanillas_output_and_its_acceptance(tiny, method):
    target, prompt = tiny
    res = resources(target)
    reference = greedy(target, methods.build("vanilla", res), prompt).tokens
    plain = greedy(target, methods.build(method, res), prompt)
    base, _, rest = method.partition("[")
    coarse = methods.build(f"{base}[{rest.rstrip(']') + ',' if rest else ''}draft_dtype=bfloat16]", res)
    assert coarse.head.fc.weight.dtype is torch.bfloat16
    gen = greedy(target, coarse, prompt)
    assert gen.tokens == reference == plain.tokens
    tau, tau_plain = len(gen.tokens) / len(gen.steps), len(plain.tokens) / len(plain.steps)
    assert tau > 1.5 and tau >= 0.8 * tau_plain  # bfloat16's rounding moves a near tie, not the draft's guesses
