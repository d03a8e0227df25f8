"""Sampling parameters, request validation and per-request token sampling.

Greedy (temperature 0) is the argmax of the fp32 logits (lowest id on ties). Otherwise: logits / temperature,
top-k, then top-p (smallest set of highest-probability tokens whose mass reaches top_p), then one draw from a
per-request `torch.Generator` seeded from `seed` and advanced once per sampled token, so a seeded request yields
the same tokens whatever else shares its batch.

Logits may live on a GPU (`sample_batch`): the greedy rows of a step take one argmax over the batch on the device
and one copy of the ids to the host; sampled rows are copied to the host and drawn there with their CPU
generator, so a seeded request gives the same tokens whatever device produced the logits.

Log-probabilities (`token_logprobs`) are the log-softmax of the model's fp32 logits (before temperature, top-k/p
and banned words), as evaluation harnesses expect.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


MAX_LOGPROBS = 20     # most alternatives per token (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens >= 1; temperature >= 0 (0 = greedy); top_k >= 0 (0 = off); top_p in (0, 1];
    seed: int or None (None with temperature > 0 = nondeterministic); stop_token_ids: finish ("stop") after
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
        """Raise ValueError naming the field."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens!r}: must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature!r}: must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p!r}: must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed = {self.seed!r}: must be an integer or None")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids = {self.stop_token_ids!r}: must be integers")
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
    generator's device, the host)."""
    x = logits.float().reshape(-1)
    if params.temperature == 0:
        return int(torch.argmax(x))
    if generator is not None and x.device != generator.device:
        x = x.to(generator.device)
    x = x / float(params.temperature)
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
                 generators: Sequence[torch.Generator | None],
                 banned: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One token id per row of logits [N, vocab] (any float dtype, any device) with row i's params and generator.
    Same tokens as `sample` row by row; greedy rows cost one batched argmax and one device-to-host copy.
    banned: per row, token ids given -inf first (None: nothing banned)."""
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"sample_batch: {n} logits rows for {len(params)} params and {len(generators)} generators")
    if banned is not None and any(banned):
        logits = logits.float().clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, torch.tensor(list(ids), device=logits.device)] = float("-inf")
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        rows = logits if len(greedy) == n else logits[torch.tensor(greedy, device=logits.device)]
        for i, t in zip(greedy, torch.argmax(rows.float(), dim=-1).tolist()):
            out[i] = int(t)
    rest = [i for i, p in enumerate(params) if p.temperature != 0]
    if rest:
        host = logits[torch.tensor(rest, device=logits.device)].float().cpu()
        for j, i in enumerate(rest):
            out[i] = sample(host[j], params[i], generators[i])
    return out


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_k: Sequence[int]
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row i's log-softmax at token_ids[i] and its top_k[i] (id, logprob) pairs, most likely first, from logits
    [N, vocab] (any float dtype and device; computed in fp32, one copy to the host)."""
    n = logits.shape[0]
    if len(token_ids) != n or len(top_k) != n:
        raise ValueError(f"token_logprobs: {n} logits rows for {len(token_ids)} tokens and {len(top_k)} top_k")
    if n == 0:
        return []
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, torch.tensor(list(token_ids), device=lsm.device).view(-1, 1)).view(-1).tolist()
    k = max(top_k)
    top_v = top_i = None
    if k > 0:
        v, i = torch.topk(lsm, k, dim=-1)
        top_v, top_i = v.tolist(), i.tolist()
    return [(chosen[r], [] if not top_k[r] else list(zip(top_i[r][:top_k[r]], top_v[r][:top_k[r]])))
            for r in range(n)]
