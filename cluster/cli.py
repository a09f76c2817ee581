"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from actors.engine.model.default_model import DEFAULT_MODEL, SMOLLM2_MODEL
from experiments.smoke import shrink

_DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run the engine offline in this process and print one completion")
    gen.add_argument("--config", default=None,
                     help="YAML config whose model and engine sections to use (default: configs/default.yaml)")
    gen.add_argument("--model", default=None,
                     help=f"checkpoint directory, GGUF file, {SMOLLM2_MODEL} (the default) or {DEFAULT_MODEL}")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    gen.add_argument("--address", default=None,
                     help="send the request to the cluster that `tandem serve` runs at this Ray address ('auto' finds it)")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="start the cluster from a config and serve until Ctrl-C")
    serve.add_argument("--config", default=str(_DEFAULT_CONFIG), help="YAML config (default: configs/default.yaml, SmolLM2-135M-Instruct)")
    serve.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    serve.add_argument("--host", default=None, help="HTTP bind address (default: the config's ingress.host)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's ingress.port)")
    serve.set_defaults(func=_serve)

    scale = sub.add_parser("scale", help="resize the pools of a running `tandem serve` (new workers register; "
                                         "removed ones drain first)")
    scale.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    scale.add_argument("--decode", type=int, default=None, help="decode replicas")
    scale.add_argument("--colocated", type=int, default=None, help="colocated replicas")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    # The key never goes on the command line, where `ps` and shell history would show it.
    scale.add_argument("--admin-key-file", default=None,
                       help="a file holding the server's admin key (default: $TANDEM_ADMIN_KEY, if set)")
    scale.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the resize to finish")
    scale.set_defaults(func=_scale)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from experiments.bench_engine import add_arguments as add_bench_engine

    add_bench_engine(bench_sub.add_parser("engine", help="offline engine throughput vs HF (and vLLM)"))
    from experiments.bench_structured import add_arguments as add_bench_structured

    add_bench_structured(bench_sub.add_parser("structured", help="the structured-output grammar mask's cost per step"))
    from experiments.bench_cluster import add_arguments as add_bench_cluster

    add_bench_cluster(bench_sub.add_parser("cluster", help="cluster stack overhead: TPOT and idle TTFT vs the engine"))
    from experiments.bench_recovery import add_arguments as add_bench_recovery

    add_bench_recovery(bench_sub.add_parser("recovery", help="kill a worker under load: time to route around it, blocks reclaimed/s"))
    from experiments.bench_tenants import add_arguments as add_bench_tenants

    add_bench_tenants(bench_sub.add_parser("tenants", help="one tenant floods: the other's latency and KV, with and without shares"))
    from experiments.bench_chaos import add_arguments as add_bench_chaos

    add_bench_chaos(bench_sub.add_parser("chaos", help="SIGKILL a random worker every few seconds under HTTP streams: exact / error / hung"))
    from experiments.bench_link import add_arguments as add_bench_link

    add_bench_link(bench_sub.add_parser("link", help="TTFT vs the prefill -> decode link's rate on the namespaced cluster (root)"))
    from experiments.fleet.bench_control_plane import add_arguments as add_bench_control_plane

    add_bench_control_plane(bench_sub.add_parser(
        "control-plane", help="the scheduler with N simulated workers: admissions/s, decision time p50/p99"))
    from experiments.loadgen.cli import add_arguments as add_bench_serve

    add_bench_serve(bench_sub.add_parser("serve", help="open-loop load against an OpenAI-compatible server: latency, SLO goodput"))
    from experiments.compare.cli import add_arguments as add_bench_compare

    add_bench_compare(bench_sub.add_parser("compare", help="the same trace against colocated and disaggregated layouts of equal resources"))
    from experiments.planner.cli import add_arguments as add_plan

    add_plan(sub.add_parser("plan", help="simulate the cluster and recommend prefill/decode pool sizes under SLOs"))

    args = parser.parse_args(argv)
    shrink(args, getattr(args, "smoke", None))  # TANDEM_SMOKE=1: bench and plan commands at toy sizes
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from actors.engine.engine import Engine
    from actors.protocol.sampling_params import SamplingParams
    from cluster.control.config import ModelSection, TandemConfig

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    if args.address:
        return _generate_on_cluster(args, params)
    config = TandemConfig.from_file(args.config or _DEFAULT_CONFIG)
    if args.model is not None or args.dtype is not None:
        model = config.model.model_dump()
        model.update({k: v for k, v in (("path", args.model), ("dtype", args.dtype)) if v is not None})
        config = config.model_copy(update={"model": ModelSection(**model)})
    engine = Engine(config.engine_config())
    (result,) = engine.generate([_prompt(args, engine.tokenizer, config)], params)
    out = result.outputs[0]
    if args.json:
        print(json.dumps({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "finish_reason": out.finish_reason,
        }))
    else:
        print(out.text)
    return 0


def _prompt(args: argparse.Namespace, tokenizer, config) -> str | list[int]:
    """The prompt as given, or with --chat as the token ids of one user message in the chat template."""
    if not args.chat:
        return args.prompt
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError(f"--chat needs a chat template, and model {config.model.path} has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote its own bos


def _generate_on_cluster(args: argparse.Namespace, params) -> int:
    import ray

    from actors.engine.text.tokenizer import load_tokenizer
    from cluster.control.config import TandemConfig
    from cluster.control.launch import NAMESPACE, find_schedulers
    from cluster.frontend.client import TandemClient

    config = TandemConfig.from_file(args.config or _DEFAULT_CONFIG)
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    schedulers = find_schedulers()
    if not schedulers:
        raise ValueError(f"no tandem cluster at Ray address {args.address!r}: start one with `tandem serve`")
    client = TandemClient.connect(schedulers, load_tokenizer(config.engine_config().model), host=config.transfer.host)
    try:
        out = client.generate([_prompt(args, client.tokenizer, config)], params)[0][0]
    finally:
        client.close()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0


def _scale(args: argparse.Namespace) -> int:
    import httpx

    body = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode), ("colocated", args.colocated))
            if n is not None}
    if not body:
        raise ValueError("give at least one of --prefill, --decode, --colocated")
    key = os.environ.get("TANDEM_ADMIN_KEY")
    if args.admin_key_file:
        try:
            key = Path(args.admin_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --admin-key-file {args.admin_key_file}: {exc.strerror}") from None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(args.url.rstrip("/") + "/admin/scale", json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"could not reach tandem serve at {args.url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError):
            message = resp.text
        raise ValueError(f"resize refused ({resp.status_code}): {message}")
    result = resp.json()
    print(f"tandem: pools now {', '.join(f'{r} x{n}' for r, n in result['replicas'].items())}; "
          f"added {', '.join(result['added']) or 'none'}; removed {', '.join(result['removed']) or 'none'}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    import ray

    from cluster.control.config import TandemConfig
    from cluster.control.launch import Cluster
    from cluster.control.scaling import ConfigWatcher
    from cluster.frontend.http.server import check_exposure, make_server, served_model_name

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = TandemConfig.from_file(args.config)
    host, port = args.host or config.ingress.host, args.port or config.ingress.port
    check_exposure(config.ingress, host)  # before anything starts
    cluster = Cluster.start(config, address=args.address)
    watcher = ConfigWatcher(cluster, args.config).start()  # edits of the pools' replicas resize live
    try:
        server = make_server(cluster, host, port)
        pools = ", ".join(f"{role} x{pool.replicas}" for role, pool in config.pools().items())
        # The Ray address is what `tandem generate --address` (or RAY_ADDRESS) takes to reach this cluster.
        print(f"tandem: serving model {served_model_name(cluster)!r} ({config.mode}: {pools}) at "
              f"http://{host}:{port}/v1, Ray at {ray.get_runtime_context().gcs_address}; Ctrl-C stops", flush=True)
        try:
            server.run()  # returns (or re-raises the interrupt) after a graceful HTTP shutdown
        except KeyboardInterrupt:
            pass
    finally:
        print("tandem: shutting down", flush=True)
        watcher.stop()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
