"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import sys

from actors.models.default_model import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run the engine offline in this process and print one completion")
    gen.add_argument("--config", default=None, help="YAML config whose model and engine sections to use")
    gen.add_argument("--model", default=None, help=f"Hugging Face checkpoint directory (default: {DEFAULT_MODEL})")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: float32")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from cluster.bench_engine import add_arguments as add_bench_engine

    add_bench_engine(bench_sub.add_parser("engine", help="offline engine throughput vs HF (and vLLM)"))

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from actors.engine import Engine
    from actors.sampling_params import SamplingParams
    from cluster.config import ModelSection, TandemConfig

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    config = TandemConfig.from_file(args.config) if args.config else TandemConfig()
    if args.model is not None or args.dtype is not None:
        model = config.model.model_dump()
        model.update({k: v for k, v in (("path", args.model), ("dtype", args.dtype)) if v is not None})
        config = config.model_copy(update={"model": ModelSection(**model)})
    engine = Engine(config.engine_config())
    (result,) = engine.generate([args.prompt], params)
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


if __name__ == "__main__":
    sys.exit(main())
