"""Train the demo model's tokenizer and write the corpus as token ids.

A byte-level BPE (the ``tokenizers`` library) with Qwen2's pre-tokenizer
regex, trained on the corpus' train split, with three special tokens:
``<|endoftext|>`` (end of a document; also padding), ``<|im_start|>`` and
``<|im_end|>`` (the ChatML chat template; ``<|im_end|>`` is the end-of-turn
token). The folder written (``tokenizer.json`` + ``tokenizer_config.json``)
is what ``transformers.AutoTokenizer`` and mlx-lm's tokenizer loader read from
a model folder.

``encode`` writes each split as one ``uint16`` array (``tokens-<split>.npy``):
every document's tokens followed by ``<|endoftext|>``. Beside it,
``tokens-<split>.json`` records per document its source, first token, token
count and character count, so that bits per character can be computed per
source without the tokenizer.

Usage::

    python training/tokenizer.py all      # train + encode + check
    python training/tokenizer.py train|encode|check [--data training/data]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
DOC_SEPARATOR = f"\n{EOS}\n"

# Qwen2's pre-tokenizer: contractions, words with one leading non-letter,
# single digits, punctuation runs, newlines and spaces.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen's instruct models use it (without tools or a default system
# prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data"
DEFAULT_TOKENIZER = HERE / "tokenizer"


def read_documents(path: Path) -> List[str]:
    """Read a corpus split written by ``corpus.py``.

    Args:
        path: ``train.txt``, ``valid.txt`` or ``test.txt``.

    Returns:
        The documents, in file order.
    """
    return path.read_text(encoding="utf-8").split(DOC_SEPARATOR)


def read_sources(path: Path) -> List[str]:
    """Read the per-document sources written beside a split.

    Args:
        path: The split's text file (``<split>.txt``).

    Returns:
        One source name per document.
    """
    side = path.with_name(path.name.replace(".txt", ".sources.jsonl"))
    with open(side, encoding="utf-8") as f:
        return [json.loads(line)["source"] for line in f]


def train_tokenizer(
    train_txt: Path, out_dir: Path, vocab_size: int = 4096, max_position_embeddings: int = 4096
) -> None:
    """Train the byte-level BPE and write the tokenizer folder.

    Args:
        train_txt: The corpus' train split.
        out_dir: Folder for ``tokenizer.json`` and ``tokenizer_config.json``.
        vocab_size: Vocabulary size including the special tokens.
        max_position_embeddings: Written as ``model_max_length``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for doc in read_documents(train_txt):
            for special in SPECIAL_TOKENS:
                doc = doc.replace(special, "\n")
            yield doc

    tok.train_from_iterator(texts(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"tokenizer: {tok.get_vocab_size()} ids -> {out_dir}")


def encode_split(
    tokenizer_dir: Path, split_txt: Path, out_npy: Path, max_tokens: Optional[int] = None
) -> dict:
    """Encode one split as ``uint16`` ids plus per-document metadata.

    Args:
        tokenizer_dir: Folder holding ``tokenizer.json``.
        split_txt: The split's text file.
        out_npy: The ``.npy`` to write; the metadata goes beside it as
            ``.json``.
        max_tokens: If given, keep only whole documents (in file order, which
            is shuffled) until this many tokens.

    Returns:
        The metadata written: token/char totals and, per document, source,
        start, tokens and chars.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    docs, sources = read_documents(split_txt), read_sources(split_txt)
    assert len(docs) == len(sources), f"{split_txt}: documents and sources disagree"
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    pieces, meta = [], {"source": [], "start": [], "tokens": [], "chars": []}
    total = 0
    for doc, source, enc in zip(docs, sources, encodings):
        ids = enc.ids + [eos]
        if max_tokens is not None and total + len(ids) > max_tokens:
            break
        meta["source"].append(source)
        meta["start"].append(total)
        meta["tokens"].append(len(ids))
        meta["chars"].append(len(doc))
        pieces.append(np.asarray(ids, dtype=np.uint16))
        total += len(ids)
    tokens = np.concatenate(pieces)
    assert tok.get_vocab_size() <= 65536
    tmp = out_npy.with_suffix(".tmp.npy")
    np.save(tmp, tokens)
    tmp.replace(out_npy)
    info = {
        "tokenizer_sha": file_sha(tokenizer_dir / "tokenizer.json"),
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos,
        "n_tokens": int(tokens.size),
        "n_chars": int(sum(meta["chars"])),
        "n_documents": len(meta["source"]),
        "documents": meta,
    }
    out_npy.with_suffix(".json").write_text(json.dumps(info) + "\n")
    print(
        f"{out_npy.name}: {tokens.size} tokens ({tokens.nbytes / 1e6:.1f} MB), "
        f"{info['n_chars'] / tokens.size:.2f} chars/token, {info['n_documents']} documents"
    )
    return info


def file_sha(path: Path) -> str:
    """A short SHA-256 of a file (ties token files to their tokenizer).

    Args:
        path: The file.

    Returns:
        The first 16 hex digits.
    """
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def check_tokenizer(tokenizer_dir: Path) -> None:
    """Load the folder as mlx-lm and transformers do, and try it.

    Checks that encode/decode round-trips, that the special tokens are single
    ids, that the chat template renders ChatML, and that mlx-lm's streaming
    detokenizer gives the same text.

    Args:
        tokenizer_dir: The tokenizer folder.

    Raises:
        AssertionError: If a check fails.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    wrapper = load_tokenizer(tokenizer_dir, eos_token_ids=[hf.convert_tokens_to_ids(EOS)])
    text = "It is a truth universally acknowledged, that a single man in 1813 -- 'naturally'!"
    ids = wrapper.encode(text, add_special_tokens=False)
    assert wrapper.decode(ids) == text, wrapper.decode(ids)
    for special in SPECIAL_TOKENS:
        assert len(wrapper.encode(special, add_special_tokens=False)) == 1, special
    messages = [{"role": "user", "content": 'What does "serendipity" mean?'}]
    prompt = wrapper.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = f'{IM_START}user\nWhat does "serendipity" mean?{IM_END}\n{IM_START}assistant\n'
    assert prompt == expected, repr(prompt)
    prompt_ids = wrapper.apply_chat_template(messages, add_generation_prompt=True)
    assert hf.decode(prompt_ids) == expected
    detok = wrapper.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text, repr(detok.text)
    eos_ids = sorted(wrapper.eos_token_ids)
    print(
        f"tokenizer check ok: {len(hf)} ids, eos ids {eos_ids}, "
        f"detokenizer {type(detok).__name__}, {len(ids)} tokens for {len(text)} chars"
    )


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["train", "encode", "check", "all"])
    p.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="corpus folder (corpus.py's --out); token files are written here",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="tokenizer folder to write or read",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--max-train-tokens",
        type=int,
        default=25_000_000,
        help="cap on tokens-train.npy (2 bytes a token)",
    )
    args = p.parse_args(argv)

    if args.step in ("train", "all"):
        train_tokenizer(args.data / "train.txt", args.tokenizer, args.vocab_size)
    if args.step in ("encode", "all"):
        for split in ("train", "valid", "test"):
            cap = args.max_train_tokens if split == "train" else None
            encode_split(
                args.tokenizer, args.data / f"{split}.txt", args.data / f"tokens-{split}.npy", cap
            )
    if args.step in ("check", "all"):
        check_tokenizer(args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
