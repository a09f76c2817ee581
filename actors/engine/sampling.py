"""Turning one step's logits into next tokens: truncation filters and the batched `Sampler`.

The engine calls `Sampler(logits, rows)` once per step with one logits row per sequence. Each row
goes through, in this order:

  1. hard constraints: the structured-output grammar's mask (structured.py), `allowed_token_ids`
     (everything else -inf; its mask is built once per request, `AllowedMasks`), then `logit_bias` added, then,
     while fewer than `min_tokens` tokens were generated, EOS and `stop_token_ids` set to -inf;
  2. penalties: `repetition_penalty` over prompt + output tokens (a positive logit is divided by it,
     a negative one multiplied), then OpenAI `frequency_penalty` / `presence_penalty` over output
     tokens (logit -= frequency * count + presence * (count > 0));
  3. temperature 0: argmax, lowest token id on ties. Otherwise divide by the temperature, softmax,
     then the truncation filters top-k -> top-p -> min-p -> typical-p, each renormalizing, then draw.

Draws use the row's own generator when the request has a seed, so batching never changes a seeded
request's tokens; other rows share the sampler's generator. Logprobs are log_softmax of the model's
raw logits, before constraints, penalties and temperature (what OpenAI and vLLM return by default).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from actors.engine.model.host_to_device import tensor_on, to_device
from actors.engine.sampling_filters import min_p_rows, top_k_rows, top_p_rows, typical_rows
from actors.protocol.sampling_params import SamplingParams

# --- The batched sampler. ---


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample for, in the order of the logits rows."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far
    generator: torch.Generator | None  # the request's own generator when params.seed is set, else None
    grammar: object | None = None  # its structured-output GrammarState (structured.py), if any


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None  # log-prob of token_id under the raw logits; None unless params.logprobs is set
    # (id, logprob) of the params.logprobs best tokens, best first, ties lower id first; [] for logprobs=0.
    top_logprobs: list[tuple[int, float]] | None


def new_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request (any device: the sampler draws one number from it per step)."""
    return torch.Generator(device=device).manual_seed(seed)


def skip_draws(generator: torch.Generator, params: SamplingParams, num_tokens: int) -> None:
    """Advance a seeded request's generator past tokens sampled elsewhere (e.g. on a prefill worker).

    Each non-greedy sampled token consumes exactly one float64 uniform (see `Sampler._draw`); greedy
    tokens consume none. Skipping them keeps a handed-off request's stream identical to one engine's.
    """
    if params.is_greedy:
        return
    for _ in range(num_tokens):
        torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator)


class Sampler:
    """One per engine; holds only the generator for unseeded rows, no per-request state.

    `vocab_size` is the model's vocabulary: logits may be wider (padded), never narrower, and every
    column of the logits is a candidate token. Unseeded rows draw from one generator seeded by `seed`.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int], seed: int = 0, grammars=None,
                 grammar_ms_per_token: float | None = None):
        """`grammars`: the engine's structured-output `Grammars` (None until a request needs one, then made
        with `grammar_ms_per_token` as each sequence's budget; None: structured.py's default)."""
        if any(not 0 <= t < vocab_size for t in eos_token_ids):
            raise ValueError(f"eos_token_ids {sorted(eos_token_ids)} must lie in [0, vocab_size={vocab_size})")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.seed = seed
        self.grammars = grammars
        if grammar_ms_per_token is None:
            from actors.engine.structured import DEFAULT_MS_PER_TOKEN  # here: structured.py imports xgrammar lazily only

            grammar_ms_per_token = DEFAULT_MS_PER_TOKEN
        self.grammar_ms_per_token = grammar_ms_per_token
        self.allowed_masks = AllowedMasks()
        self._generators: dict[torch.device, torch.Generator] = {}  # for unseeded rows, one per device

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        return self.draw(logits, rows).results()

    def check_integrity(self) -> None:
        """The state it keeps across steps: the allowed-token masks, and the compiled grammars' cache."""
        self.allowed_masks.check_integrity()
        if self.grammars is not None:
            self.grammars.check_integrity()

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> Draw:
        """Choose every row's token where the logits are; `Draw.results()` brings them to the host. On a
        GPU the greedy path queues its work without waiting for it (overlapped steps rely on that)."""
        if logits.ndim != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            want = f"[{len(rows)}, >= {self.vocab_size}]"
            raise ValueError(f"logits must have shape {want}, got {tuple(logits.shape)}")
        if all(r.params.temperature == 0.0 and r.params.logprobs is None and _untouched(r) for r in rows):
            return Draw(logits.argmax(dim=-1), logits, rows)

        adjusted = self.adjust_logits(logits, rows)
        drawn = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        if not drawn:
            chosen = adjusted.argmax(dim=-1)
        elif len(drawn) == len(rows):
            chosen = self._draw(adjusted, rows)
        else:
            chosen = adjusted.argmax(dim=-1)
            chosen[drawn] = self._draw(adjusted[drawn], [rows[i] for i in drawn])
        return Draw(chosen, logits, rows)

    def adjust_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Hard constraints then penalties (steps 1-2 above); returns `logits` itself when none apply."""
        device, vocab = logits.device, logits.shape[1]
        allowed, biased, banned, repeated, counted, masked = [], [], [], [], [], []
        for i, row in enumerate(rows):
            p = row.params
            if row.grammar is not None:
                masked.append(i)
            if p.allowed_token_ids is not None:
                allowed.append(i)
            if p.logit_bias:
                biased.append(i)
            if len(row.output_token_ids) < p.min_tokens:
                banned.append(i)
            if p.repetition_penalty != 1.0:
                repeated.append(i)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                counted.append(i)
        if not (allowed or biased or banned or repeated or counted or masked):
            return logits

        x = logits.float().clone()
        if masked:
            self.grammars.mask(x, masked, [rows[i].grammar for i in masked])
        if allowed:
            forbidden = torch.stack([self.allowed_masks.of(rows[i].params, vocab, device) for i in allowed])
            x[allowed] = x[allowed].masked_fill(forbidden, float("-inf"))
        if biased:
            r, t = _flatten(biased, [rows[i].params.logit_bias.keys() for i in biased], device)
            bias = [b for i in biased for b in rows[i].params.logit_bias.values()]
            x.index_put_((r, t), torch.tensor(bias, dtype=x.dtype, device=device), accumulate=True)
        if banned:
            stops = [self.eos_token_ids + rows[i].params.stop_token_ids for i in banned]
            x[_flatten(banned, stops, device)] = float("-inf")
        if repeated:
            seen = [chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in repeated]
            r, t = _flatten(repeated, seen, device)
            penalty = _per_row(rows, "repetition_penalty", device)[r]
            v = x[r, t]  # a token seen twice is written twice, with the same value
            x[r, t] = torch.where(v > 0, v / penalty, v * penalty)
        if counted:
            r, t = _flatten(counted, [rows[i].output_token_ids for i in counted], device)
            pairs, counts = torch.unique(r * vocab + t, return_counts=True)
            r, t = pairs // vocab, pairs % vocab
            frequency = _per_row(rows, "frequency_penalty", device)[r]
            presence = _per_row(rows, "presence_penalty", device)[r]
            x[r, t] -= frequency * counts + presence
        return x

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, truncation filters, one draw per row. Takes adjusted logits of non-greedy rows."""
        device, vocab = logits.device, logits.shape[1]
        probs = torch.softmax(logits.float() / _per_row(rows, "temperature", device).unsqueeze(1), dim=-1)
        broken = ~torch.isfinite(probs).all(dim=-1)
        # A temperature so small that logits / T overflows is the greedy limit: take the argmax. On a GPU
        # without asking whether any row broke (that question would wait for the device).
        if probs.is_cuda:
            greedy = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(broken.unsqueeze(1), greedy, probs)
        elif bool(broken.any()):
            greedy = torch.zeros_like(probs[broken]).scatter_(-1, logits[broken].argmax(-1, keepdim=True), 1.0)
            probs[broken] = greedy
        filters = (
            (top_k_rows, [min(r.params.top_k or vocab, vocab) for r in rows], vocab),
            (top_p_rows, [r.params.top_p for r in rows], 1.0),
            (min_p_rows, [r.params.min_p for r in rows], 0.0),
            (typical_rows, [r.params.typical_p for r in rows], 1.0),
        )
        for kernel, values, neutral in filters:
            active = [j for j, v in enumerate(values) if v != neutral]
            if len(active) == len(rows):
                probs = kernel(probs, tensor_on(values, None, device).unsqueeze(1))
            elif active:
                column = tensor_on([values[j] for j in active], None, device).unsqueeze(1)
                probs[active] = kernel(probs[active], column)

        # Inverse CDF: one uniform per row. A seeded row takes its uniform from its own generator, so
        # its draw ignores the rest of the batch. float64, or the tail of a 150k vocabulary rounds away.
        cdf = probs.double().cumsum(dim=-1)
        uniform = torch.empty(len(rows), 1, dtype=torch.float64, device=device)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            generator = self._generator(device)
            uniform[shared] = torch.rand(len(shared), 1, dtype=torch.float64, device=device, generator=generator)
        for j in (j for j, r in enumerate(rows) if r.generator is not None):
            g = rows[j].generator  # drawn where the generator lives: a CPU generator serves GPU logits too
            uniform[j] = to_device(torch.rand(1, dtype=torch.float64, device=g.device, generator=g), device)
        total = cdf[:, -1:]
        # Strictly below the total, so the draw lands on a token with positive probability.
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = new_generator(self.seed, device)
        return self._generators[device]


class AllowedMasks:
    """Each live request's `allowed_token_ids` as a mask of the tokens it forbids, built once: a step's work
    for the list is then one row of the vocabulary, however long the list (rebuilding it per step cost
    every stream 9.66x TPOT with 140k ids, n=16). Keyed by the request's `SamplingParams` object, which its
    samples share for its life; an entry goes when the params object does (a weakref finalizer), so no
    release path can forget it."""

    def __init__(self):
        self._masks: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    def of(self, params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor:
        key = (id(params), device, vocab)
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = False
            self._masks[key] = mask
            weakref.finalize(params, self._masks.pop, key, None)
        return mask

    def __len__(self) -> int:
        return len(self._masks)

    def check_integrity(self) -> None:
        wrong = [k for k, m in self._masks.items() if m.dtype != torch.bool or m.shape != (k[2],)]
        if wrong:
            raise RuntimeError(f"allowed_token_ids masks: {len(wrong)} of {len(self._masks)} are not a vocabulary row")


class Draw:
    """One step's chosen tokens, still where the logits are (`chosen`, int64 [rows]): the next step may take
    them as its input ids there. `results()` is the one copy to the host (with the logprobs asked for)."""

    def __init__(self, chosen: torch.Tensor, logits: torch.Tensor, rows: list[SamplingRow]):
        self.chosen, self._logits, self._rows = chosen, logits, rows
        self._host, self._ready = chosen, None
        if chosen.device.type == "cuda":  # a non-blocking copy into pinned memory, waited for in results()
            self._host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            self._host.copy_(chosen, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def results(self) -> list[SampleResult]:
        if self._ready is not None:
            self._ready.synchronize()
        results = [SampleResult(t, None, None) for t in self._host.tolist()]
        _fill_logprobs(self._logits, self._rows, self.chosen, results)
        return results


def _fill_logprobs(logits, rows, chosen, results) -> None:
    """Each row that asked for logprobs gets its token's and its top ones (of the raw logits)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return
    if len(wanted) < len(rows):
        logits, chosen = logits[wanted], chosen[wanted]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(rows[i].params.logprobs for i in wanted), logprobs.shape[1])
    top_values, top_ids = top_n(logprobs, k) if k else ([[]] * len(wanted),) * 2
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        results[i].logprob = picked[j]
        results[i].top_logprobs = list(zip(top_ids[j][:n], top_values[j][:n]))


def _untouched(row: SamplingRow) -> bool:
    """True when adjust_logits would leave this row's logits as they are."""
    p = row.params
    return (
        row.grammar is None
        and p.allowed_token_ids is None
        and not p.logit_bias
        and len(row.output_token_ids) >= p.min_tokens
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
    )


def _per_row(rows: list[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    return tensor_on([getattr(r.params, name) for r in rows], torch.float32, device)


def _flatten(row_ids: list[int], token_lists: list, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(row, token) index pairs: row_ids[j] repeated once per token of token_lists[j]."""
    token_lists = [list(tokens) for tokens in token_lists]
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row = torch.repeat_interleave(torch.tensor(row_ids, device=device), lengths)
    return row, torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)


def top_n(logprobs: torch.Tensor, n: int) -> tuple[list[list[float]], list[list[int]]]:
    """The n best (value, id) per row, best first, ties to the lower id."""
    values, ids = logprobs.topk(n, dim=-1)
    # topk picks an arbitrary member of a tie; where the n-th value is tied with tokens left out,
    # rank the whole row with a stable sort instead.
    boundary_tie = (logprobs >= values[:, -1:]).sum(dim=-1) > n
    if bool(boundary_tie.any()):
        full_values, full_ids = logprobs[boundary_tie].sort(dim=-1, descending=True, stable=True)
        values[boundary_tie], ids[boundary_tie] = full_values[:, :n], full_ids[:, :n]
    # Order within the n: by id, then stably by value descending.
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values.tolist(), ids.gather(-1, by_value).tolist()
