"""Workloads: what each request sends, reproducible from a seed and drawn lazily by index.

Prompts are token ids rather than text because we cannot assume the server's tokenizer: a list of
ints is an exact prompt length on any server whose completions API accepts it (tandem and vLLM do).
Ids start at 10 to stay clear of the special tokens at the bottom of common vocabularies.
Request i draws its lengths from its own generator (seed, i), so a run of n requests is a prefix of
a run of n + 1, and a sweep sends the same lengths at every rate. Token contents also depend on a
salt, so a repeated run (or the next step of a sweep) is not answered from the server's prefix cache.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.loadgen.spec import LengthDist, WorkloadSpec

FIRST_TOKEN_ID = 10
_PREFIX_STREAM, _LENGTH_STREAM, _CONTENT_STREAM = 0, 1, 2


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int] | str
    output_len: int
    timestamp: float | None = None  # seconds, from a trace

    @property
    def prompt_len(self) -> int | None:
        """Tokens in the prompt, when known without the server's tokenizer."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def sample_length(dist: LengthDist, rng: np.random.Generator) -> int:
    if dist.kind == "fixed":
        value = dist.mean
    elif dist.kind == "uniform":
        value = rng.integers(dist.low, dist.high + 1)
    else:  # lognormal with the given mean and std of the length itself
        sigma2 = math.log1p((dist.std / dist.mean) ** 2)
        value = rng.lognormal(math.log(dist.mean) - sigma2 / 2, math.sqrt(sigma2))
    value = max(int(round(value)), dist.low)
    return min(value, dist.high) if dist.high is not None else value


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, n).tolist()


class Workload(ABC):
    """Request i of a workload; `natural_count` is how many it holds when finite (a trace), else None."""

    natural_count: int | None = None

    @abstractmethod
    def request(self, i: int) -> RequestSpec: ...


class SyntheticWorkload(Workload):
    def __init__(self, spec: WorkloadSpec):
        self.spec = spec

    def lengths(self, i: int) -> tuple[int, int]:
        rng = np.random.default_rng([self.spec.seed, _LENGTH_STREAM, i])
        return sample_length(self.spec.prompt_len, rng), sample_length(self.spec.output_len, rng)

    def tokens(self, i: int, n: int) -> list[int]:
        rng = np.random.default_rng([self.spec.seed, _CONTENT_STREAM, _salt(self.spec), i])
        return random_tokens(rng, n, self.spec.vocab_size)

    def request(self, i: int) -> RequestSpec:
        n_prompt, n_output = self.lengths(i)
        return RequestSpec(self.tokens(i, n_prompt), n_output)


class SharedPrefixWorkload(SyntheticWorkload):
    """k system prompts, each followed by fresh suffixes; request i uses prefix i mod k."""

    def __init__(self, spec: WorkloadSpec):
        super().__init__(spec)
        self.prefixes = [random_tokens(np.random.default_rng([spec.seed, _PREFIX_STREAM, _salt(spec), j]),
                                       spec.prefix_len, spec.vocab_size) for j in range(spec.num_prefixes)]

    def request(self, i: int) -> RequestSpec:
        n_suffix, n_output = self.lengths(i)
        return RequestSpec(self.prefixes[i % len(self.prefixes)] + self.tokens(i, n_suffix), n_output)


def _salt(spec: WorkloadSpec) -> int:
    return spec.prompt_salt or 0


class TraceWorkload(Workload):
    """A JSONL trace, one request a line: timestamp (s), prompt (text or token ids) or prompt_len, output_len.

    Lines are sorted by timestamp; past the end the trace repeats (only with synthetic arrivals).
    """

    def __init__(self, spec: WorkloadSpec):
        self.requests = load_trace(Path(spec.trace_path), spec.vocab_size, [spec.seed, _salt(spec)])
        self.natural_count = len(self.requests)

    def request(self, i: int) -> RequestSpec:
        return self.requests[i % len(self.requests)]


def load_trace(path: Path, vocab_size: int, seed: list[int]) -> list[RequestSpec]:
    """Requests sorted by timestamp; a prompt_len line gets token ids drawn from (seed, line number)."""
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    out = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            out.append(_trace_request(line, f"{path}:{line_no}", vocab_size, np.random.default_rng([*seed, line_no])))
    if not out:
        raise ValueError(f"trace file {str(path)!r} holds no requests")
    return sorted(out, key=lambda r: r.timestamp)


def _trace_request(line: str, where: str, vocab_size: int, rng: np.random.Generator) -> RequestSpec:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with timestamp, prompt or prompt_len, output_len")
    unknown = set(row) - {"timestamp", "prompt", "prompt_len", "output_len"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
    timestamp, output_len = row.get("timestamp"), row.get("output_len")
    if not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise ValueError(f"{where}: 'timestamp' must be a number of seconds >= 0")
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1")
    prompt = row.get("prompt")
    if prompt is None:
        n = row.get("prompt_len")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: give 'prompt' (text or token ids) or an integer 'prompt_len' >= 1")
        prompt = random_tokens(rng, n, vocab_size)
    elif not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
        raise ValueError(f"{where}: 'prompt' must be text or a list of token ids")
    return RequestSpec(prompt, output_len, float(timestamp))


def build_workload(spec: WorkloadSpec) -> Workload:
    return {"synthetic": SyntheticWorkload, "shared_prefix": SharedPrefixWorkload, "trace": TraceWorkload}[spec.kind](spec)
