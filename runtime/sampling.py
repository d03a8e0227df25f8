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

Log-probabilities (`token_logprobs`) are the log-softmax of the model's fp32 logits (before temperature, top-k/p
and banned words), as evaluation harnesses expect.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import torch


MAX_LOGPROBS = 20     # most alternatives per token (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1 (prompt + max_tokens <= the cache's max_context, checked at submission); temperature: finite,
    >= 0 (0 = greedy); top_k >= 0 (0 = off); top_p in (0, 1]; seed: int in [-2**63, 2**64) or None (None with
    temperature > 0 = nondeterministic); stop_token_ids: a list of ids in [0, vocab_size): finish ("stop") after
    emitting one of them; ignore_eos: do not stop at the model's eos_token_id; stop_sequences: token sequences
    (length >= 1) that finish the request ("stop") once the output ends with one; bad_words: token sequences never
    completed (a word's last token is banned while the tokens so far end with the rest of it);
    logprobs: None (off) or k in 0..MAX_LOGPROBS: each generated token's logprob and the k most likely tokens';
    prompt_logprobs: the same for every prompt token after the first."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    stop_sequences: Sequence[Sequence[int]] = ()
    bad_words: Sequence[Sequence[int]] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
        for name in ("stop_sequences", "bad_words"):
            words = getattr(self, name)
            if any(not isinstance(w, (list, tuple)) or not w or any(isinstance(t, bool) or not isinstance(t, int)
                                                                    for t in w) for w in words):
                raise ValueError(f"{name} = {words!r}: must be non-empty sequences of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} = {k!r}: must be None or an integer in 0..{MAX_LOGPROBS} (top tokens "
                                 "returned besides the chosen one)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming stop_token_ids / stop_sequences / bad_words when an id is not below vocab_size."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("stop_sequences", [t for w in self.stop_sequences for t in w]),
                          ("bad_words", [t for w in self.bad_words for t in w])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name}: {bad[:5]} outside [0, vocab_size={vocab_size}); the model never emits "
                                 "them")


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
    generator's device, the host). Raises NonFiniteLogits when the logits hold NaN or +Inf or no finite value
    (-inf entries, e.g. banned tokens, are probability 0)."""
    x = logits.float().reshape(-1)
    if generator is not None and x.device != generator.device:
        x = x.to(generator.device)
    if not bool(usable(x[None])[0]):
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


def usable(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: row i of logits [N, vocab] holds no NaN and no +Inf and at least one finite value."""
    return ~torch.isnan(logits).any(-1) & ~torch.isposinf(logits).any(-1) & torch.isfinite(logits).any(-1)


def ban(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """A fp32 copy of logits [N, vocab] with row i's `banned[i]` token ids set to -inf."""
    logits = logits.float().clone()
    for i, ids in enumerate(banned):
        if ids:
            logits[i, torch.tensor(list(ids), device=logits.device)] = float("-inf")
    return logits


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 banned: Sequence[Sequence[int]] | None = None) -> list[int | None]:
    """One token id per row of logits [N, vocab] (any float dtype, any device) with row i's params and generator.
    Same tokens as `sample` row by row; greedy rows cost one batched argmax (with their finiteness) and one
    device-to-host copy. banned: per row, token ids given -inf first (None: nothing banned). Row i is None when its
    logits are not `usable` (NaN / +Inf / nothing finite; its generator does not advance)."""
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample_batch: {n} logits rows for {len(params)} params and {len(generators)} generators")
    if banned is not None and any(banned):
        logits = ban(logits, banned)
    out: list[int | None] = [None] * n
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = (logits if len(greedy) == n else logits[torch.tensor(greedy, device=logits.device)]).float()
        ids, ok = torch.stack([torch.argmax(rows, dim=-1), usable(rows).long()]).tolist()
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


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits) in fp32 at token_ids and its top k, on logits' device with no host read: (chosen [N] fp32,
    top values [N, k] fp32, top ids [N, k] int64; k = 0: [N, 0]). logits [N, vocab] any float dtype; token_ids [N]
    int64 on the same device."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, token_ids.view(-1, 1)).view(-1)
    if k > 0:
        v, i = torch.topk(lsm, k, dim=-1)
    else:
        v, i = lsm.new_empty(lsm.shape[0], 0), torch.empty(lsm.shape[0], 0, dtype=torch.long, device=lsm.device)
    return chosen, v, i


def logprob_lists(chosen: list[float], top_v: list[list[float]], top_i: list[list[int]], top_k: Sequence[int | None]
                  ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row (chosen logprob, its top_k[i] (id, logprob) pairs) from host lists of `logprob_tensors`' outputs;
    None for a row whose top_k is None (no logprobs asked)."""
    return [None if top_k[r] is None else (chosen[r], list(zip(top_i[r][:top_k[r]], top_v[r][:top_k[r]])))
            for r in range(len(top_k))]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_k: Sequence[int]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row i's log-softmax at token_ids[i] and its top_k[i] (id, logprob) pairs, most likely first, from logits
    [N, vocab] (any float dtype and device; computed in fp32, one copy to the host)."""
    n = logits.shape[0]
    if len(token_ids) != n or len(top_k) != n:
        raise ValueError(f"token_logprobs: {n} logits rows for {len(token_ids)} tokens and {len(top_k)} top_k")
    if n == 0:
        return []
    chosen, v, i = logprob_tensors(logits, torch.tensor(list(token_ids), device=logits.device), max(top_k))
    return logprob_lists(chosen.tolist(), v.tolist(), i.tolist(), top_k)
