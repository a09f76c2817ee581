"""Regenerate the embedded default tokenizer in `default_tokenizer/`.

The default tokenizer lets tandem run end to end (tests, random-weight models) without a model hub.
It is a byte-level BPE with 2048 entries, trained once on the license texts Debian ships in
/usr/share/common-licenses (plain English prose, present on every Debian/Ubuntu machine). The JSON
files it writes are committed; the engine loads those and never runs this script.

    python actors/assets/make_default_tokenizer.py [--corpus DIR] [--out DIR]

Deterministic: files are read in sorted order (symlinks to the same file counted once), and the
`tokenizers` BPE trainer breaks count ties by the pair itself. The script prints the SHA-256 of the
corpus so a regeneration on another machine can tell whether it trained on the same text.

Layout (ids are part of the contract; tests check them):
  0 <|begin_of_text|>  bos, prepended on encode by the post-processor (add_bos_token=True)
  1 <|end_of_text|>    eos
  2 <|pad|>            pad
  3 <|system|>  4 <|user|>  5 <|assistant|>  6 <|end|>   chat markers; <|end|> closes a turn
  7..262               the 256 byte symbols; every UTF-8 string round-trips
  263..2047            merges

Chat format (bos once, each turn `<|role|>\\n{content}<|end|>\\n`):
    <|begin_of_text|><|user|>\\nHi<|end|>\\n<|assistant|>\\n
A chat model trained on this format stops on <|end|>; that id belongs in its generation_config's
eos_token_id list, next to <|end_of_text|>.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ROLE_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_MARKERS, END_OF_TURN]

# Jinja for transformers' apply_chat_template. Content may be a string or a list of OpenAI-style
# parts, of which the text parts are joined.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

DEFAULT_CORPUS = Path("/usr/share/common-licenses")
DEFAULT_OUT = Path(__file__).resolve().parent / "default_tokenizer"


def read_corpus(corpus_dir: Path) -> list[str]:
    """The corpus files' texts in sorted-name order, each real file once."""
    seen: set[Path] = set()
    texts = []
    for path in sorted(corpus_dir.iterdir()):
        real = path.resolve()
        if not real.is_file() or real in seen:
            continue
        seen.add(real)
        texts.append(real.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise ValueError(f"no corpus files under {corpus_dir}")
    return texts


def train(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # The ByteLevel pre-tokenizer's built-in split regex keeps words and their leading space together.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # Paragraphs are the training units; one huge line per file would be just as good but slower.
    lines = [para for text in texts for para in text.split("\n\n") if para.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS}:1 $B:1",
            special_tokens=[(BOS, tok.token_to_id(BOS))],
        ),
    ])
    return tok


def tokenizer_config(tok: Tokenizer) -> dict:
    """The transformers side: which tokens play which role, and the chat template."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [*ROLE_MARKERS, END_OF_TURN],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    texts = read_corpus(args.corpus)
    corpus_sha = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    tok = train(texts)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tok.get_vocab_size()} entries, want {VOCAB_SIZE}: corpus too small")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}, want {i}")

    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=False)
    special_map = {
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [*ROLE_MARKERS, END_OF_TURN],
    }
    for name, obj in [("tokenizer_config.json", tokenizer_config(tok)),
                      ("special_tokens_map.json", special_map)]:
        (args.out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    tok_sha = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()
    print(f"corpus sha256 {corpus_sha} ({len(texts)} files)")
    print(f"tokenizer.json sha256 {tok_sha}")


if __name__ == "__main__":
    main()
