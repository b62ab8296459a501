"""Build a packed training dataset (see train/data.py) from text or JSONL files.

    python -m train.prepare_data --input corpus/ extra.jsonl --tokenizer /ckpt/Qwen3.5-0.8B --output data/mix

--tokenizer is a local directory with an HF tokenizer (a Qwen3.5 checkpoint directory works; it is
opened with local_files_only, nothing is downloaded) or "bytes" for the built-in byte tokenizer.
Inputs: .jsonl files (one JSON object per line, text under --text-key), .txt files (one document
per file, or per blank-line paragraph / per line with --txt-split), or directories of those.
Every document gets the tokenizer's end-of-document token appended.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from train.data import ByteTokenizer, write_packed_dataset
from train.embedded_corpus import embedded_documents

INPUT_SUFFIXES = (".txt", ".jsonl")
TXT_SPLITS = ("file", "blank-line", "line")
TOKENIZE_BATCH = 512
# Files AutoTokenizer builds a vocabulary from. Without one it does not fail: a directory with
# only config.json (a run's hf_final) gives a 1-token tokenizer, an empty one a misleading
# sentencepiece/tiktoken error.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")


class HFTokenizer:
    """An HF tokenizer from a local directory, with the ids we need from it."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as error:
            raise ImportError("--tokenizer with a directory needs transformers: pip install transformers") from error
        if not Path(path).is_dir():
            raise ValueError(f"--tokenizer={path!r} is not a directory (expected a local HF tokenizer or 'bytes')")
        check_tokenizer_files(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = str(Path(path).resolve())
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"--tokenizer={path!r} defines no eos_token; documents need an end marker")
        self.vocab_size = len(self.tokenizer)
        if self.vocab_size < 2:
            raise ValueError(
                f"--tokenizer={path!r} loads as a tokenizer with vocabulary size {self.vocab_size}; expected a real "
                f"tokenizer (at least 2 tokens; Qwen3.5's has about 248k). Are its tokenizer files complete?"
            )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]


def check_tokenizer_files(path: str) -> None:
    """Refuse a directory without tokenizer files, before anything is written."""
    directory = Path(path)
    if any((directory / name).is_file() for name in VOCABULARY_FILES):
        return
    present = sorted(entry.name for entry in directory.iterdir())
    holds = f"it holds {present[:8]}{' ...' if len(present) > 8 else ''}" if present else "it is empty"
    hint = (" (config.json without tokenizer files: a model's weights, e.g. a run's hf_final; point --tokenizer "
            "at the tokenizer of the checkpoint it started from)" if "config.json" in present else "")
    raise ValueError(
        f"--tokenizer={path!r}: directory {directory.resolve()} has no tokenizer files, {holds}{hint}; expected "
        f"tokenizer.json and tokenizer_config.json as tokenizer.save_pretrained writes them, or another vocabulary "
        f"file ({', '.join(VOCABULARY_FILES[1:])})"
    )


def load_tokenizer(spec: str):
    return ByteTokenizer() if spec == ByteTokenizer.name else HFTokenizer(spec)


def iter_input_files(inputs: list[str]) -> Iterator[Path]:
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in INPUT_SUFFIXES)
            if not found:
                raise ValueError(f"--input {item!r} is a directory with no {'/'.join(INPUT_SUFFIXES)} files")
            yield from found
        elif path.is_file():
            if path.suffix not in INPUT_SUFFIXES:
                raise ValueError(f"--input {item!r} has suffix {path.suffix!r}, expected one of {INPUT_SUFFIXES}")
            yield path
        else:
            raise ValueError(f"--input {item!r} does not exist")


def iter_texts(files: Iterator[Path], text_key: str, txt_split: str) -> Iterator[str]:
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as lines:
                for line_number, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if text_key not in record:
                        raise ValueError(f"{path}:{line_number} has no key {text_key!r} (see --text-key)")
                    yield record[text_key]
        else:
            text = path.read_text(encoding="utf-8")
            if txt_split == "file":
                yield text
            elif txt_split == "line":
                yield from (line for line in text.splitlines() if line.strip())
            else:
                yield from (part for part in text.split("\n\n") if part.strip())


def tokenize_documents(texts: Iterator[str], tokenizer) -> Iterator[list[int]]:
    """Token ids per document, end-of-document id appended; HF tokenizers get batches."""
    if isinstance(tokenizer, ByteTokenizer):
        for text in texts:
            yield tokenizer.encode(text) + [tokenizer.eos_id]
        return
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == TOKENIZE_BATCH:
            yield from (ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(batch))
            batch = []
    if batch:
        yield from (ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(batch))


def refuse_degenerate(documents: Iterator[list[int]], eos_id: int, tokenizer_spec: str) -> Iterator[list[int]]:
    """Pass documents through; at the end, refuse a dataset of nothing but end-of-document tokens
    (raised inside write_packed_dataset, which then removes its partial output)."""
    num_documents = content_tokens = 0
    for ids in documents:
        num_documents += 1
        content_tokens += sum(1 for token in ids if token != eos_id)
        yield ids
    if num_documents == 0:
        raise ValueError("--input gave no documents (every file was empty); expected at least one non-empty text")
    if content_tokens == 0:
        raise ValueError(
            f"--tokenizer={tokenizer_spec!r} turned all {num_documents} documents into no tokens (only the "
            f"end-of-document token); expected text the tokenizer covers (are the inputs empty, or --text-key wrong?)"
        )


def build_embedded_dataset(output_dir: str | os.PathLike, num_documents: int, seed: int = 0) -> dict:
    """The default dataset: the synthetic corpus of train/embedded_corpus.py, byte-tokenized."""
    tokenizer = ByteTokenizer()
    documents = tokenize_documents(embedded_documents(num_documents, seed), tokenizer)
    return write_packed_dataset(
        output_dir, documents, tokenizer.vocab_size, tokenizer.eos_id, f"bytes (embedded corpus, seed {seed})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl files or directories of them")
    parser.add_argument("--tokenizer", required=True, help="local HF tokenizer directory, or 'bytes'")
    parser.add_argument("--output", required=True, help="dataset directory to create (must not exist)")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the document text")
    parser.add_argument("--txt-split", choices=TXT_SPLITS, default="file", help="what one document is in a .txt")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    texts = iter_texts(iter_input_files(args.input), args.text_key, args.txt_split)
    documents = refuse_degenerate(tokenize_documents(texts, tokenizer), tokenizer.eos_id, args.tokenizer)
    meta = write_packed_dataset(args.output, documents, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.name)
    print(
        f"wrote {args.output}: {meta['num_documents']} documents, {meta['num_tokens']} tokens "
        f"({meta['dtype']}), vocab {meta['vocab_size']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
