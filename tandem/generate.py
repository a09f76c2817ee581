"""`tandem generate`: one completion, offline in this process or on a running cluster."""

from __future__ import annotations

import argparse
import json
import os

from tandem.defaults import DEFAULT_CONFIG


def add_arguments(gen: argparse.ArgumentParser) -> None:
    from actors.engine.model.default_model import DEFAULT_MODEL, SMOLLM2_MODEL

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
    gen.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                     help="default: the config's model.dtype (configs/default.yaml: auto)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    gen.add_argument("--address", default=None,
                     help="send the request to the cluster that `tandem serve` runs at this Ray address ('auto' finds it)")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from actors.engine.engine import Engine
    from actors.protocol.sampling_params import SamplingParams
    from cluster.control.config import ModelSection, TandemConfig

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    if args.address:
        return _on_cluster(args, params)
    config = TandemConfig.from_file(args.config or DEFAULT_CONFIG)
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


def _on_cluster(args: argparse.Namespace, params) -> int:
    import ray

    from actors.engine.text.tokenizer import load_tokenizer
    from cluster.control.config import TandemConfig
    from cluster.control.lifecycle.launch import NAMESPACE, find_schedulers, private_ray_root
    from cluster.frontend.client import TandemClient

    config = TandemConfig.from_file(args.config or DEFAULT_CONFIG)
    if args.address == "auto" and "RAY_TMPDIR" not in os.environ:
        # A `tandem serve` that started Ray itself keeps it under this user's private root: look there first.
        root = private_ray_root()
        if os.path.exists(os.path.join(root, "ray", "ray_current_cluster")):
            os.environ["RAY_TMPDIR"] = root
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    schedulers = find_schedulers()
    if not schedulers:
        raise ValueError(f"no tandem cluster at Ray address {args.address!r}: start one with `tandem serve`")
    client = TandemClient.connect(schedulers, load_tokenizer(config.engine_config().model), host=config.transfer.host,
                                  progress_timeout_s=config.scheduler.progress_timeout_s)
    try:
        out = client.generate([_prompt(args, client.tokenizer, config)], params)[0][0]
    finally:
        client.close()
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0
