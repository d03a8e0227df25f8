"""Sampling parameters, request validation and per-request token sampling.

Greedy (temperature 0) is the argmax of the fp32 logits (lowest id on ties). Otherwise: (logits - max) /
temperature (shifted first, so any accepted temperature > 0 gives finite probabilities: 1e-38 is greedy, not NaN),
top-k, then top-p (smallest set of highest-probability tokens whose mass reaches top_p), then one draw from a
per-request `torch.Generator` seeded from `seed` and advanced once per sampled token, so a seeded request yields
the same tokens whatever else shares its batch.

Logits may live on a GPU (`sample_batch`): the greedy rows of a step take one argmax over the batch on the device
and one copy of the ids to the host; sampled rows are copied to the host and drawn there with their CPU
generator, so a seeded request gives the same tokens whatever device produced the logits. A row whose logits are not
all finite (NaN/Inf: bad weights, an overflow) draws nothing: `sample_batch` marks it None and `sample` raises
`NonFiniteLogits`; the other rows are unaffected.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1 (prompt + max_tokens <= the cache's max_context, checked at submission); temperature: finite,
    >= 0 (0 = greedy); top_k >= 0 (0 = off); top_p in (0, 1]; seed: int in [-2**63, 2**64) or None (None with
    temperature > 0 = nondeterministic); stop_token_ids: a list of ids in [0, vocab_size): finish ("stop") after
    emitting one of them; ignore_eos: do not stop at the model's eos_token_id."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the field (values the sampler could not use safely are refused here)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens!r}: must be an integer >= 1")
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature = {self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r}: must be in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64):
            raise ValueError(f"seed = {self.seed!r}: must be an integer in [-2**63, 2**64) or None")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids,
                                                                            (Sequence, set, frozenset)):
            raise ValueError(f"stop_token_ids = {self.stop_token_ids!r}: must be a list of token ids"
                             + (f", e.g. [{self.stop_token_ids!r}]" if _is_int(self.stop_token_ids) else ""))
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids = {list(self.stop_token_ids)!r}: {bad[:5]} are not token ids "
                             "(integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos = {self.ignore_eos!r}: must be true or false")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming stop_token_ids when one of them is not below vocab_size."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[:5]} outside [0, vocab_size={vocab_size}); the model never "
                             "emits them")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class NonFiniteLogits(ValueError):
    """A request's logits hold NaN or Inf (bad weights or an overflow upstream): no token can be drawn."""


NON_FINITE = ("logits are not finite (NaN/Inf) for this request: the model produced no usable distribution "
              "(bad weights? check the checkpoint with `k3deploy build`, whose checkpoint step checks every tensor)")


def validate_prompt(prompt_ids, vocab_size: int, max_context: int) -> list[int]:
    """Check a prompt; returns it as a list of ints. Raises ValueError naming `prompt_ids`."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.reshape(-1).tolist()
    try:
        ids = list(prompt_ids)
    except TypeError:
        raise ValueError(f"prompt_ids: expected a list of token ids, got {type(prompt_ids).__name__}") from None
    if not ids:
        raise ValueError("prompt_ids: empty; pass at least one token id")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: token ids {bad[:5]} outside [0, vocab_size={vocab_size})")
    if len(ids) > max_context:
        raise ValueError(f"prompt_ids: {len(ids)} tokens, longer than max_context = {max_context}")
    return [int(t) for t in ids]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The per-request generator (None for greedy)."""
    if params.temperature == 0:
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [vocab] (any float dtype and device; computed in fp32; sampled rows on the
    generator's device, the host). Raises NonFiniteLogits when the logits hold NaN or Inf."""
    x = logits.float().reshape(-1)
    if generator is not None and x.device != generator.device:
        x = x.to(generator.device)
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteLogits(NON_FINITE)
    if params.temperature == 0:
        return int(torch.argmax(x))
    # <= 0 with a 0 at the max: exp never overflows and never underflows everywhere; the temperature is at least
    # the smallest normal fp32 (a subnormal one is flushed to 0 under torch.set_flush_denormal: 0 / 0 = NaN)
    x = (x - x.max()) / max(float(params.temperature), torch.finfo(torch.float32).tiny)
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if params.top_p < 1:
        p, idx = torch.sort(probs, descending=True)
        keep = (p.cumsum(0) - p) < params.top_p          # mass before this token still below top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int | None]:
    """One token id per row of logits [N, vocab] (any float dtype, any device) with row i's params and generator.
    Same tokens as `sample` row by row; greedy rows cost one batched argmax (with their finiteness) and one
    device-to-host copy. Row i is None when its logits hold NaN/Inf (its generator does not advance)."""
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample_batch: {n} logits rows for {len(params)} params and {len(generators)} generators")
    out: list[int | None] = [None] * n
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = (logits if len(greedy) == n else logits[torch.tensor(greedy, device=logits.device)]).float()
        ids, ok = torch.stack([torch.argmax(rows, dim=-1), torch.isfinite(rows).all(dim=-1).long()]).tolist()
        for i, t, good in zip(greedy, ids, ok):
            out[i] = int(t) if good else None
    rest = [i for i, p in enumerate(params) if p.temperature != 0]
    if rest:
        host = logits[torch.tensor(rest, device=logits.device)].float().cpu()
        for j, i in enumerate(rest):
            try:
                out[i] = sample(host[j], params[i], generators[i])
            except NonFiniteLogits:
                out[i] = None
    return out
