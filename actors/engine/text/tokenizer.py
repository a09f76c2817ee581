"""Loading tokenizers: a model's own, or the small byte-level BPE embedded in tandem.

The default tokenizer (`DEFAULT_TOKENIZER_DIR`, built by `assets/make_default_tokenizer.py`) lets
random-weight models and tests run without a model hub. Its encode prepends <|begin_of_text|>
(id 0) the way Llama-3 does; chat templates render that bos themselves, so text produced by
`apply_chat_template(..., tokenize=False)` must be encoded with `add_special_tokens=False`.
Note that transformers 5 reports `tokenizer.add_bos_token == False` for any tokenizer.json-backed
tokenizer: the post-processor in tokenizer.json decides, not that attribute.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

DEFAULT_TOKENIZER_DIR: Path = Path(__file__).resolve().parent / "assets" / "default_tokenizer"

# Any one of these makes a directory loadable by AutoTokenizer (fast or slow files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def has_tokenizer(path: str | Path) -> bool:
    """Whether directory `path` holds tokenizer files (a checkpoint may ship without them)."""
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER_DIR) -> PreTrainedTokenizerBase:
    """The tokenizer stored in directory `path`, from local files only.

    Raises ValueError naming the path when it is not a directory holding tokenizer files.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {str(path)!r}: expected one of {', '.join(_TOKENIZER_FILES)}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, config=_plain_config(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from exc


def _plain_config(path: Path) -> PreTrainedConfig | None:
    """config.json as a plain config, when tokenizer_config.json names the tokenizer's class. AutoTokenizer
    otherwise loads the model's own config class to read the same fields, and importing it pulls in
    torch.distributed.tensor: 1-3 s of every worker's and ingress's start. None: AutoTokenizer's way."""
    config_file, tokenizer_config = path / "config.json", path / "tokenizer_config.json"
    if not (config_file.is_file() and tokenizer_config.is_file()):
        return None
    try:
        if not json.loads(tokenizer_config.read_text()).get("tokenizer_class"):
            return None
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # AutoTokenizer reports it
    if not isinstance(hf, dict):
        return None
    config = PreTrainedConfig.from_dict(hf)
    config.model_type = hf.get("model_type", "")  # a class attribute of the model's config class
    config._name_or_path = str(path)
    return config


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config: Mapping | None = None
) -> frozenset[int]:
    """Ids that end generation: the tokenizer's eos plus a generation_config's `eos_token_id`.

    `generation_config` is the parsed generation_config.json of a HF checkpoint (or None); its
    `eos_token_id` may be an int, a list of ints, or absent.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = (generation_config or {}).get("eos_token_id")
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        if not isinstance(configured, (list, tuple)) or not all(isinstance(i, int) for i in configured):
            raise ValueError(
                f"generation_config eos_token_id must be an int or a list of ints, got {configured!r}"
            )
        ids.update(configured)
    return frozenset(ids)


def model_eos_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """Ids that end generation for a checkpoint: its tokenizer's and generation_config's, or, without
    a tokenizer, those named in generation_config.json and config.json."""
    model_dir = Path(model_dir)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    if tokenizer is not None:
        return eos_token_ids(tokenizer, gen)
    cfg = json.loads((model_dir / "config.json").read_text())
    ids: set[int] = set()
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(source)
    return frozenset(ids)
