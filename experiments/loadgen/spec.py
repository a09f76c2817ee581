"""What a load-generator run is: the endpoint, the workload, the arrival process and the SLOs.

User-facing, so pydantic with `extra="forbid"`: a bad value is a `ValueError` naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(_Strict):
    """A distribution of token counts; every draw is clipped to [min, max] and is at least 1."""

    kind: Literal["fixed", "uniform", "lognormal"] = Field("fixed", description="shape of the distribution")
    mean: float = Field(128, gt=0, description="fixed value, or the mean of uniform/lognormal")
    std: float = Field(0, ge=0, description="standard deviation of the lognormal")
    low: int = Field(1, ge=1, description="smallest value (uniform: lower bound)")
    high: int | None = Field(None, ge=1, description="largest value (uniform: upper bound); None is unbounded")

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "uniform" and self.high is None:
            raise ValueError("a uniform length needs both bounds, e.g. 'uniform:64:256'")
        if self.high is not None and self.high < self.low:
            raise ValueError(f"length bounds are reversed: low {self.low} > high {self.high}")
        if self.kind == "lognormal" and self.std <= 0:
            raise ValueError("a lognormal length needs a positive std, e.g. 'lognormal:200:50'")
        return self

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'128' (fixed), 'uniform:LOW:HIGH', or 'lognormal:MEAN:STD'."""
        parts = text.split(":")
        try:
            numbers = [float(x) for x in parts[1:]] if len(parts) == 3 else [float(x) for x in parts]
        except ValueError:
            numbers = []
        if len(parts) == 1 and numbers:
            return cls(kind="fixed", mean=numbers[0])
        if parts[0] == "uniform" and len(numbers) == 2:
            return cls(kind="uniform", mean=sum(numbers) / 2, low=int(numbers[0]), high=int(numbers[1]))
        if parts[0] == "lognormal" and len(numbers) == 2:
            return cls(kind="lognormal", mean=numbers[0], std=numbers[1])
        raise ValueError(f"bad length {text!r}: use N, 'uniform:LOW:HIGH' or 'lognormal:MEAN:STD'")

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.mean))
        if self.kind == "uniform":
            return f"uniform[{self.low},{self.high}]"
        return f"lognormal(mean {self.mean:g}, std {self.std:g})"


class WorkloadSpec(_Strict):
    kind: Literal["synthetic", "shared_prefix", "trace"] = Field(
        "synthetic", description="random token prompts, k shared system prompts x suffixes, or a JSONL trace")
    prompt_len: LengthDist = Field(LengthDist(mean=128), description="prompt tokens (shared_prefix: the suffix)")
    output_len: LengthDist = Field(LengthDist(mean=32), description="output tokens (sent as max_tokens)")
    vocab_size: int = Field(2000, gt=10, description="token ids are drawn from [10, vocab_size)")
    num_prefixes: int = Field(4, ge=1, description="shared_prefix: how many distinct system prompts")
    prefix_len: int = Field(256, ge=1, description="shared_prefix: tokens in each system prompt")
    trace_path: str | None = Field(None, description="trace: JSONL with timestamp, prompt or prompt_len, output_len")
    seed: int = Field(0, description="seeds prompt lengths and contents")
    prompt_salt: int | None = Field(
        None, description="varies prompt contents but not lengths; None draws one per run (recorded in the "
                          "result), so a repeated run is not served from the server's prefix cache")

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "trace" and not self.trace_path:
            raise ValueError("a trace workload needs a trace path (--trace FILE)")
        return self

    def describe(self) -> str:
        lengths = f"output {self.output_len.describe()} tokens"
        if self.kind == "trace":
            return f"trace {self.trace_path}"
        if self.kind == "shared_prefix":
            return (f"{self.num_prefixes} shared prefixes of {self.prefix_len} tokens + suffix "
                    f"{self.prompt_len.describe()}, {lengths}")
        return f"prompt {self.prompt_len.describe()}, {lengths}"


class ArrivalSpec(_Strict):
    kind: Literal["poisson", "gamma", "constant", "trace", "closed"] = Field(
        "poisson", description="open-loop process, the trace's own timestamps, or closed loop at a fixed concurrency")
    rate: float | None = Field(None, gt=0, description="requests per second (trace: rescales the trace to this mean rate)")
    burstiness: float = Field(1.0, gt=0, description="gamma shape: 1 is Poisson, < 1 burstier, > 1 smoother")
    concurrency: int | None = Field(None, ge=1, description="closed loop: requests kept in flight")
    seed: int = Field(0, description="seeds the inter-arrival draws")

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "closed" and self.concurrency is None:
            raise ValueError("closed-loop arrivals need a concurrency (--concurrency N)")
        if self.kind in ("poisson", "gamma", "constant") and self.rate is None:
            raise ValueError(f"{self.kind} arrivals need a rate (--rate R requests/s)")
        return self

    def describe(self) -> str:
        if self.kind == "closed":
            return f"closed loop, concurrency {self.concurrency} (latency excludes queueing the client did not do)"
        if self.kind == "trace":
            return "trace timestamps" + (f" rescaled to {self.rate:g} req/s" if self.rate else "")
        shape = f" (burstiness {self.burstiness:g})" if self.kind == "gamma" else ""
        return f"open loop, {self.kind}{shape} at {self.rate:g} req/s"


class BenchSpec(_Strict):
    base_url: str = Field(description="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    model: str | None = Field(None, description="model name; None asks the server's /v1/models")
    api_key: str | None = Field(None, description="sent as a bearer token")
    workload: WorkloadSpec = Field(WorkloadSpec(), description="what to send")
    arrival: ArrivalSpec = Field(ArrivalSpec(rate=1.0), description="when to send it")
    num_requests: int | None = Field(None, ge=1, description="measured requests (after the warm-up)")
    duration_s: float | None = Field(None, gt=0, description="stop scheduling measured requests after this long")
    warmup: int = Field(0, ge=0, description="requests sent first and reported apart")
    slo_ttft_ms: float | None = Field(None, gt=0, description="TTFT SLO; None means no TTFT condition")
    slo_tpot_ms: float | None = Field(None, gt=0, description="TPOT SLO; None means no TPOT condition")
    request_timeout_s: float = Field(120.0, gt=0, description="per request, counted from its scheduled arrival")
    temperature: float = Field(0.0, ge=0, description="sampling temperature sent with every request")
    progress: bool = Field(True, description="draw a progress bar on stderr")

    @model_validator(mode="after")
    def _check(self):
        if self.num_requests is None and self.duration_s is None and self.workload.kind != "trace":
            raise ValueError("say how long to run: --num-requests N or --duration S")
        if self.arrival.kind == "trace" and self.workload.kind != "trace":
            raise ValueError("trace arrivals need a trace workload (--trace FILE)")
        return self

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def with_rate(self, rate: float) -> BenchSpec:
        """The same run at another arrival rate (the sweep's step)."""
        return self.model_copy(update={"arrival": self.arrival.model_copy(update={"rate": rate})})

    def with_salt(self, salt: int) -> BenchSpec:
        return self.model_copy(update={"workload": self.workload.model_copy(update={"prompt_salt": salt})})

    def with_fixed_salt(self) -> BenchSpec:
        """This spec with a concrete prompt salt (a fresh random one if none was given)."""
        if self.workload.prompt_salt is not None:
            return self
        import secrets

        return self.with_salt(secrets.randbelow(2**31))
