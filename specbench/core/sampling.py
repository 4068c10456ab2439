"""From logits to token choices: temperature scaling and seeded sampling, shared by targets and drafts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SparseLaws:
    """Rows of laws, each over a few candidate tokens (DFlash2's top 16 at a row): ids [n, K] and their probs [n, K],
    zero at every other token, so a step keeps K numbers a row, not the vocabulary's V."""

    ids: torch.Tensor
    probs: torch.Tensor

    def __getitem__(self, rows: Any) -> SparseLaws:  # (rows, or rows and positions: what indexes ids)
        return SparseLaws(self.ids[rows], self.probs[rows])

    def __len__(self) -> int:
        return self.ids.shape[0]

    def dense(self, vocab: int) -> torch.Tensor:
        """The laws over the vocabulary [..., V]."""
        return self.probs.new_zeros(*self.ids.shape[:-1], vocab).scatter_add_(-1, self.ids, self.probs)


def dense(laws: torch.Tensor | SparseLaws | None, vocab: int) -> torch.Tensor | None:
    """Laws as rows over the vocabulary (a dense row as it is: its own width)."""
    return laws.dense(vocab) if isinstance(laws, SparseLaws) else laws


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of logits / temperature in float32 (rows are distributions); temperature must be > 0."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from a 1D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator | None, device: torch.device | str) -> float:
    return float(torch.rand((), generator=generator, device=device))


def inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The token [m] each row of probs [m, V] (a law, or any non-negative weights) gives at its uniform draw [m] in
    [0, 1): the first whose cumulative sum passes the draw times the row's total. A token without mass is never
    chosen, so a row is sampled exactly from its law with one uniform, on the device, with no read."""
    cumulative = probs.cumsum(-1)
    threshold = draws[:, None].to(cumulative) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, threshold, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def drawn(
    logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token [m] per row of logits [m, V] and the law it came from [m, V]: at a temperature above 0 a draw from
    the row's own generator (one uniform each: `inverse_cdf`), at 0 the argmax (its law then means nothing)."""
    device = logits.device
    scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device)
    laws = torch.softmax(logits.float() / scale[:, None], dim=-1)
    draws = torch.stack(
        [
            torch.rand((), generator=g, device=device) if t > 0 else laws.new_zeros(())
            for t, g in zip(temperatures, generators, strict=True)
        ]
    )
    tokens = inverse_cdf(laws, draws)
    greedy = [i for i, t in enumerate(temperatures) if t == 0]
    if greedy:
        rows = torch.tensor(greedy, device=device)
        tokens[rows] = logits[rows].argmax(-1)
    return tokens, laws


def next_rows(
    logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None], laws: list
) -> torch.Tensor:
    """A chain's next row for every slot [m] from logits [m, V]: the argmax while every slot is greedy, else
    `drawn`'s tokens, the law they came from appended to `laws`."""
    if all(t == 0 for t in temperatures):
        return logits.argmax(-1)
    tokens, law = drawn(logits, temperatures, generators)
    laws.append(law)
    return tokens


def draw_distinct(
    probs: torch.Tensor, k: int, generator: torch.Generator | None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """For each row of probs [F, V]: up to k distinct tokens drawn one after another without replacement (fewer
    when the row has fewer tokens with mass), and the law each was drawn from ([k', V]: the row without the
    earlier draws, renormalised); `draw_distinct_padded` with each row cut to its real draws."""
    order, laws, drawn = draw_distinct_padded(probs, k, generator)
    support = drawn.tolist()
    return [row[:n] for row, n in zip(order.tolist(), support, strict=True)], [
        law[:n] for law, n in zip(laws, support, strict=True)
    ]


def draw_distinct_padded(
    probs: torch.Tensor, k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of probs [F, V]: k' = min(k, V) tokens drawn one after another without replacement [F, k'],
    the law each was drawn from [F, k', V] (the row without the earlier draws, renormalised), and how many of
    the row's draws are real [F] (at most its tokens with mass; the draws past them mean nothing). The draws are
    the top k of log-probabilities plus Gumbel noise, which orders them as successive sampling without
    replacement. Rejection sampling verifies such siblings exactly when each is tested against its own law
    (recursive rejection sampling)."""
    probs = probs.float()
    k = min(k, probs.shape[-1])
    noise = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_min(1e-20)
    keys = torch.log(probs) - torch.log(-torch.log(noise))  # log p + Gumbel; -inf where p = 0
    order = keys.topk(k, dim=-1).indices  # [F, k]
    drawn = torch.nn.functional.one_hot(order, probs.shape[-1]).to(probs)  # [F, k, V]
    earlier = drawn.cumsum(dim=1) - drawn  # the tokens drawn before each draw
    rest = probs[:, None, :] * (1 - earlier)  # [F, k, V]
    laws = rest / rest.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return order, laws, (probs > 0).sum(dim=-1).clamp(max=k)
