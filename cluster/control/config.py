"""User-facing configuration (YAML -> pydantic). A typo or a bad value fails at load, naming the field.

The engine's hot path never reads these models: `engine_config()` derives the frozen `EngineConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from actors.engine.config import EngineConfig
from actors.engine.model.builtin_names import DEFAULT_MODEL, SMOLLM2_MODEL
from cluster.control.config_base import Strict as _Strict, where as _where
from cluster.control.ingress_config import IngressSection, TenantSection  # the ingress's sections: their own file
from cluster.control.observability_config import ObservabilitySection

__all__ = ["ModelSection", "EngineSection", "PoolSection", "LoadThresholds", "SloSection", "AutoscalerSection",
           "SchedulerSection", "TransferSection", "KvTierSection", "TenantSection", "IngressSection",
           "ObservabilitySection", "TandemConfig"]

# The most uncached prompt tokens a decode worker prefills itself, by default (scheduler.local_prefill_max_tokens).
LOCAL_PREFILL_MAX_TOKENS = 512
# The predicted time to first token on the best prefill worker past which a decode worker takes a prompt of
# any length, by default (scheduler.local_prefill_overflow_s).
LOCAL_PREFILL_OVERFLOW_S = 0.25


class ModelSection(_Strict):
    path: str = Field(DEFAULT_MODEL, description=f"Hugging Face checkpoint directory, a GGUF file, {DEFAULT_MODEL!r} (a tiny "
                                                 f"random model, for tests) or {SMOLLM2_MODEL!r} (SmolLM2-135M-Instruct)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight, activation and KV cache dtype; auto: bfloat16 on a CPU with AVX512-BF16 or AMX "
        "and on CUDA GPUs of compute capability 8.0 on, float32 on other CPUs (float16 on older GPUs), each worker "
        "choosing on its own machine (actors/engine/model/dtype_choice.py); float32 for exact parity with transformers")
    max_model_len: int | None = Field(None, gt=0, description="context length; null uses the model's max_position_embeddings")


class EngineSection(_Strict):
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, gt=0, description="KV blocks per worker; null sizes the cache from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV cache size per worker when num_kv_blocks is null")
    max_num_seqs: int = Field(64, gt=0, description="most sequences in one engine step")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one engine step")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = Field(True, description="split long prompts into chunks that share steps with decodes")
    seed: int = Field(0, description="seed of the generator shared by unseeded requests")
    tenant_slowdown: float | None = Field(
        2.0, gt=1, description="while several tenants' sequences share a worker, each step is cut to the tokens "
        "that keep it within this factor of a one-token step's measured time (one tenant's flood then slows "
        "another's tokens at most that much); null: steps take the whole token budget")
    step_budget_ms: float | None = Field(
        None, gt=0, description="a step that carries decodes computes only the prompt tokens that keep it within "
        "this many milliseconds by the worker's measured step cost (at least 32 a step, so a prompt always "
        "progresses); a step with no decode takes the whole token budget; null (the default): the token budget "
        "alone. Decodes go first in every step either way. It bounds the longest gap between tokens; on a CPU it "
        "costs TTFT and TPOT p50 (small prompt chunks compute less efficiently), so it is off unless asked for")
    grammar_ms_per_token: float = Field(
        1.0, gt=0, description="structured output: the engine-thread CPU milliseconds one sequence's grammar "
        "(its token masks and accepts) may take per token it generated, on average, after a grace of 64 tokens; a "
        "sequence past it ends with an error naming its grammar (one whose cost grows with the output, e.g. an "
        "ambiguous one, would otherwise slow every stream of the worker). JSON schemas and regexes took 0.01-0.2 ms")
    attention_backend: Literal["auto", "sdpa", "cpu", "flashinfer", "triton"] = Field(
        "auto", description="attention kernels: cpu (tandem's C kernels reading KV blocks in place, built with the "
        "machine's C compiler on first use: one for decodes and runs of up to 4 tokens, one for prompts and longer chunks), flashinfer (FlashInfer's paged kernels on CUDA; "
        "pip install flashinfer-python flashinfer-cubin), triton (tandem's paged decode kernel on CUDA, SDPA for "
        "prefill), sdpa (torch's scaled_dot_product_attention over gathered blocks; every device), auto (cpu on a "
        "CPU, sdpa if it cannot build; on CUDA flashinfer if installed, else triton)")
    cuda_graphs: bool = Field(
        True, description="replay decode steps from CUDA graphs captured per batch-size bucket (CUDA, flashinfer "
        "or triton attention, no tensor parallelism; skipped with a log line elsewhere)")
    fused_kernels: bool = Field(
        True, description="on CUDA with triton (CUDA builds of torch ship it): RMSNorm, the rotary embedding and "
        "silu-and-mul each run as one Triton kernel instead of several torch ops; the CPU keeps the torch ops")
    overlap_steps: bool | None = Field(
        None, description="launch each engine step before the previous step's tokens are read back, so the host "
        "schedules and post-processes while the device computes; null (auto): on CUDA without tensor parallelism. "
        "true on a CPU runs the same order and saves nothing (each token reaches its client one step later)")


class PoolSection(_Strict):
    replicas: int = Field(1, ge=0, description="number of workers in this pool")
    max_replicas: int = Field(64, ge=1, description="most workers a live resize (`tandem scale`, /admin/scale, the "
                              "autoscaler) may ask for")
    min_replicas: int = Field(1, ge=1, description="fewest workers the autoscaler leaves in this pool")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per worker")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per worker; > 0 places the model on cuda")
    torch_threads: int = Field(1, gt=0, description="torch intra-op threads per worker")
    resources: dict[str, float] = Field(default_factory=dict, description="extra Ray custom resources per worker (e.g. a node type)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks per worker (one actor each, all on one node; num_cpus, num_gpus and resources "
        "are per rank): the model's heads and MLP widths are split across them")


class LoadThresholds(_Strict):
    """`autoscaler.mode: load`: grow a pool when its load passes `*_high`, shrink it when every signal of it is
    below `*_low` (hysteresis between the two); nothing to profile."""

    prefill_queue_high_s: float = Field(2.0, gt=0, description="seconds of prompts queued per prefill (or colocated) "
                                        "worker, at its measured cost, above which the pool grows")
    prefill_queue_low_s: float = Field(0.25, ge=0, description="... below which it may shrink")
    kv_high: float = Field(0.8, gt=0, le=1, description="fraction of the decode (or colocated) pool's KV committed to "
                           "requests in flight above which it grows; so does any request waiting for KV room")
    kv_low: float = Field(0.3, ge=0, le=1, description="... below which it may shrink")

    @model_validator(mode="after")
    def _ordered(self) -> "LoadThresholds":
        if self.prefill_queue_low_s >= self.prefill_queue_high_s or self.kv_low >= self.kv_high:
            raise ValueError("each *_low threshold must be below its *_high")
        return self


class SloSection(_Strict):
    """`autoscaler.mode: slo`: the objectives the pools are sized for, and the model that predicts them."""

    ttft_ms: float = Field(..., gt=0, description="time to first token the prefill pool is sized for")
    tpot_ms: float = Field(..., gt=0, description="time per output token the decode pool is sized for")
    percentile: float = Field(90.0, gt=0, lt=100, description="the percentile of TTFT that must meet ttft_ms")
    profile: str = Field(..., description="engine profile JSON of this model on these workers, from "
                         "`tandem plan profile` (or hand-written): the step costs the pools are sized with")
    forecast: Literal["constant", "trend"] = Field("trend", description="next interval's arrival rate: the last "
                                                   "one, or the last plus its smoothed slope")
    shrink_window_s: float = Field(60.0, ge=0, description="a pool shrinks only to the most it needed within this "
                                   "window (growth is at once)")
    headroom: float = Field(0.0, ge=0, description="size for this fraction more than the forecast rate")
    react_s: float = Field(2.0, ge=0, description="between decisions, check this often whether the newest demand "
                           "(since the last check) already needs a pool to grow, and grow it at once (a new phase of traffic "
                           "then waits seconds, not the rest of the interval); it never shrinks a pool but for a "
                           "flip into the one that grows; 0 (or >= interval_s): only at decisions")
    refit: bool = Field(True, description="keep the profile's step cost current: refit it every interval on the "
                        "workers' own steps, timed end to end, once both prefill-only and decode-only steps are logged")


class AutoscalerSection(_Strict):
    mode: Literal["off", "load", "slo"] = Field(
        "off", description="off: pools keep their replicas (resize by hand); load: resize from queue depth and KV "
        "use (autoscaler.load); slo: size the pools for autoscaler.slo from the forecast demand and a profile")
    interval_s: float = Field(10.0, gt=0, description="how often the pools' load is read and a decision made")
    cooldown_s: float = Field(30.0, ge=0, description="no resize this soon after the last one ended (no flapping)")
    max_workers: int | None = Field(None, ge=1, description="most workers of all pools together; null: each pool's "
                                    "max_replicas")
    load: LoadThresholds = Field(default_factory=LoadThresholds, description="thresholds of mode load")
    slo: SloSection | None = Field(None, description="objectives and profile of mode slo")
    flips: bool = Field(True, description="when one pool shrinks while another grows, turn the shrinking pool's "
                        "workers into the growing pool's (no weights reloaded) instead of stopping some and starting "
                        "others, where the pools' workers ask the same resources")

    @model_validator(mode="after")
    def _slo_given(self) -> "AutoscalerSection":
        if self.mode == "slo" and self.slo is None:
            raise ValueError("autoscaler.mode slo needs autoscaler.slo (ttft_ms, tpot_ms, profile)")
        return self


class SchedulerSection(_Strict):
    routing: Literal["cache_aware", "least_loaded", "round_robin"] = Field(
        "cache_aware", description="how a prefill worker is chosen"
    )
    lease_s: float = Field(30.0, gt=0, description="deadline of a KV handoff: a reservation or hold older than this is released")
    reserve: Literal["prompt_plus_max_tokens", "prompt"] = Field(
        "prompt_plus_max_tokens", description="KV a decode worker must have free to admit a request"
    )
    max_queued: int = Field(1024, ge=0, description="requests waiting for admission before new ones are rejected")
    queue_timeout_s: float = Field(30.0, gt=0, description="how long a request may wait for admission")
    max_predicted_ttft_s: float | None = Field(
        None, gt=0, description="load shedding: a request whose predicted time to first token (its wait so far + "
        "the prefill queue ahead of it + its own prefill + transfer) exceeds this gets 429 with Retry-After; "
        "null: half of progress_timeout_s, the silence after which a request is moved anyway")
    local_prefill: bool = Field(True, description="let the cost model prefill short or cached prompts on the decode worker")
    local_prefill_penalty: float = Field(
        1.0, ge=0, description="a local prefill must be predicted (1 + penalty) times faster than the best remote one"
    )
    local_prefill_max_tokens: int = Field(
        LOCAL_PREFILL_MAX_TOKENS, ge=0, description="the most uncached prompt tokens a decode worker prefills itself "
        "(but see local_prefill_overflow_s), and the most prompt tokens it computes in one step: a longer prefill "
        "step there would stall every token it decodes meanwhile, and every reservation asked of it")
    local_prefill_overflow_s: float | None = Field(
        LOCAL_PREFILL_OVERFLOW_S, gt=0, description="when even the best prefill worker is predicted to take longer than this to a "
        "prompt's first token (a burst, a prefill pool still growing), a decode worker takes a prompt of any "
        "length whenever it is predicted faster: it computes at most local_prefill_max_tokens of it a step, so "
        "its decodes slow no more than a short local prompt slows them; only while the requests of the last 60 s "
        "came from one tenant (with several, one tenant's long prompts would run in the steps all of them share on a "
        "decode worker); null: never")
    prefill_s_per_token: float = Field(2e-4, gt=0, description="initial prefill cost per token, replaced by measurements")
    transfer_bytes_per_s: float = Field(2e9, gt=0, description="initial KV transfer bandwidth, replaced by measurements")
    heartbeat_s: float = Field(0.05, gt=0, description="how often workers report stats and finished requests")
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="a worker that sends neither report nor pulse this long is declared dead (or cut "
        "off) and routed around; a long step is not silence: the worker's pulse thread speaks during it"
    )
    progress_timeout_s: float = Field(
        60.0, gt=0, description="the longest a request may go without progress in any phase (waiting for a worker, "
        "prefilling, handing off, decoding, migrating) before it is moved to another worker or ended with a clean "
        "error: no stream stays silent longer")
    shards: int = Field(
        1, ge=1, description="scheduler actors, each with its share of every pool; the ingress sends a request to "
        "the shard its prompt's first tokens hash to (requests sharing a system prompt meet on one). More than one "
        "only when one scheduler cannot keep up (`tandem bench control-plane --shards`)")


class TransferSection(_Strict):
    backend: Literal["zmq", "collective"] = Field("zmq", description="KV page transport")
    zmq_transport: Literal["ipc", "tcp"] = Field("ipc", description="ipc on one host, tcp across hosts")
    host: str = Field("127.0.0.1", description="address workers bind for tcp transfers and token streams")
    encryption: Literal["curve", "none"] | None = Field(
        None, description="curve: zmq CURVE (authenticated, encrypted) on every data-plane socket; none: plain "
        "sockets anyone who reaches them may use; null: curve on tcp sockets (token streams, KV pages over tcp), "
        "none on ipc ones (a private socket directory on one host)")
    shm: bool = Field(
        True, description="with zmq_transport ipc, KV pages between workers of one host and user go through "
        "shared memory (/dev/shm, a 0600 segment per sender and receiver, up to 256 MiB each, taken as used): "
        "written once by the sender, copied into the blocks by the receiver; only a small note crosses the "
        "socket. The pages never leave the host. false: the pages travel on the socket as frames")

    def kv_encrypted(self) -> bool:
        return self.encryption == "curve" or (self.encryption is None and self.zmq_transport == "tcp")

    def tokens_encrypted(self) -> bool:  # token sinks are always tcp
        return self.encryption != "none"


class KvTierSection(_Strict):
    host_bytes: int = Field(
        0, ge=0, description="bytes of host memory (shared memory, /dev/shm) per node for a KV tier below the "
        "workers' prefix caches: blocks they evict are kept there (least recently used out) and a prompt that "
        "misses a worker's cache loads its blocks from there instead of computing them. One tier actor per "
        "node, shared by the node's workers; 0: no tier")


class TandemConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = Field("disaggregated", description="split prefill and decode pools, or colocated workers")
    model: ModelSection = Field(default_factory=ModelSection, description="which model to serve")
    engine: EngineSection = Field(default_factory=EngineSection, description="per-worker engine limits")
    prefill: PoolSection = Field(default_factory=PoolSection, description="the prefill pool (disaggregated mode)")
    decode: PoolSection = Field(default_factory=PoolSection, description="the decode pool (disaggregated mode)")
    colocated: PoolSection = Field(
        default_factory=lambda: PoolSection(replicas=0), description="the colocated pool (colocated mode)"
    )
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="global scheduler policy")
    transfer: TransferSection = Field(default_factory=TransferSection, description="KV transfer between workers")
    ingress: IngressSection = Field(default_factory=IngressSection, description="the OpenAI HTTP server")
    kv_tier: KvTierSection = Field(default_factory=KvTierSection, description="the per-node host KV tier")
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection, description="pools that size themselves")
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection,
                                                description="request tracing (OpenTelemetry); off by default")

    @model_validator(mode="after")
    def _pools_fit_the_mode(self) -> "TandemConfig":
        if self.mode == "disaggregated" and (self.prefill.replicas < 1 or self.decode.replicas < 1):
            raise ValueError("mode disaggregated needs prefill.replicas >= 1 and decode.replicas >= 1")
        if self.mode == "colocated" and self.colocated.replicas < 1:
            raise ValueError("mode colocated needs colocated.replicas >= 1")
        short = [role for role, pool in self.pools().items() if pool.replicas < self.scheduler.shards]
        if short:
            raise ValueError(f"scheduler.shards {self.scheduler.shards} needs at least that many replicas in every "
                             f"pool (each shard has its own workers); {', '.join(short)} has fewer")
        bounds = [role for role, pool in self.pools().items() if pool.min_replicas > pool.max_replicas]
        if bounds:
            raise ValueError(f"min_replicas above max_replicas in {', '.join(bounds)}")
        split = [role for role, pool in self.pools().items() if pool.tensor_parallel_size > 1]
        if split and self.transfer.backend == "collective":
            raise ValueError("tensor_parallel_size > 1 needs transfer.backend zmq (a rank's process holds one "
                             "torch.distributed group: its worker's)")
        return self

    def pools(self) -> dict[str, PoolSection]:
        """Role -> pool for the roles this mode runs."""
        if self.mode == "colocated":
            return {"colocated": self.colocated}
        return {"prefill": self.prefill, "decode": self.decode}

    @classmethod
    def from_file(cls, path: str | Path) -> "TandemConfig":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{path}: {problems}") from None

    def engine_config(self, detokenize: bool = True) -> EngineConfig:
        # Here, not at the top: building a model needs torch, which the scheduler never loads (a restart
        # that imports it takes seconds longer, and every request waits for it).
        from actors.engine.model.default_model import resolve_model

        e = self.engine
        return EngineConfig(
            detokenize=detokenize,
            model=resolve_model(self.model.path),
            model_source=self.model.path,
            dtype=self.model.dtype,
            max_model_len=self.model.max_model_len,
            block_size=e.block_size,
            num_kv_blocks=e.num_kv_blocks,
            kv_cache_memory_bytes=int(e.kv_cache_memory_gb * (1 << 30)),
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            enable_prefix_caching=e.enable_prefix_caching,
            enable_chunked_prefill=e.enable_chunked_prefill,
            seed=e.seed,
            tenant_slowdown=e.tenant_slowdown,
            step_budget_ms=e.step_budget_ms,
            grammar_ms_per_token=e.grammar_ms_per_token,
            attention_backend=e.attention_backend,
            cuda_graphs=e.cuda_graphs,
            fused_kernels=e.fused_kernels,
            overlap_steps=e.overlap_steps,
        )
