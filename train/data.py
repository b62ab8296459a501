"""Packed, pre-tokenized training data and the micro-batches cut from it.

On disk a dataset is a directory:
  tokens.bin       every document's token ids back to back (uint16 or uint32, see meta.json)
  doc_offsets.npy  int64 [num_docs + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
  meta.json        format version, token dtype, counts, vocab size, end-of-document id, tokenizer

A micro-batch is a fixed window of `tokens_per_micro_batch` consecutive tokens of that stream:
no padding. Its `cu_seqlens` mark where documents start and end inside the window; documents
longer than `max_seq_len` are cut into pieces of at most that length. Without document boundaries
(for benchmarks that want full-length sequences from short-document data) only that cut is made. Windows are visited in a
seeded permutation per epoch, and global micro-batch `i` goes to rank `i % world_size`, so the
order is a pure function of (seed, position): resuming needs only the position.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
META_FILE = "meta.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus an end-of-document id 256: needs no files and no download."""

    name = "bytes"
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def write_packed_dataset(
    output_dir: str | os.PathLike,
    documents: Iterable[Iterable[int]],
    vocab_size: int,
    eos_id: int | None,
    tokenizer_name: str,
) -> dict:
    """Write token-id documents (each already ending in `eos_id` if wanted) as a packed dataset.

    Writes into a temporary directory next to `output_dir` and renames it at the end, so an
    interrupted build never leaves a directory that looks complete. Returns the meta dict.
    """
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise ValueError(f"output directory {str(output_dir)!r} already exists; remove it or choose another path")
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    partial_dir = output_dir.with_name(output_dir.name + f".partial-{os.getpid()}")
    partial_dir.mkdir(parents=True)
    try:
        meta = _write_files(partial_dir, documents, dtype, vocab_size, eos_id, tokenizer_name)
        partial_dir.rename(output_dir)
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        if output_dir.exists() and (output_dir / META_FILE).is_file():
            return json.loads((output_dir / META_FILE).read_text())  # another process finished the same build
        raise
    return meta


def _write_files(directory: Path, documents, dtype, vocab_size: int, eos_id: int | None, tokenizer_name: str) -> dict:
    offsets = [0]
    with open(directory / TOKENS_FILE, "wb") as tokens_file:
        for doc in documents:
            ids = np.asarray(doc, dtype=np.int64)
            if ids.size == 0:
                continue
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(
                    f"document {len(offsets) - 1} has token ids in [{ids.min()}, {ids.max()}], "
                    f"outside the vocabulary [0, {vocab_size})"
                )
            tokens_file.write(ids.astype(dtype).tobytes())
            offsets.append(offsets[-1] + ids.size)
    if len(offsets) == 1:
        raise ValueError("documents is empty: no document had any tokens")
    np.save(directory / OFFSETS_FILE, np.asarray(offsets, dtype=np.int64))
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": np.dtype(dtype).name,
        "num_tokens": offsets[-1],
        "num_documents": len(offsets) - 1,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer": tokenizer_name,
    }
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class PackedDataset:
    """A packed dataset directory opened read-only (tokens memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise ValueError(
                f"data.path={str(path)!r} is not a packed dataset: {META_FILE} is missing "
                f"(build one with `python -m train.prepare_data`)"
            )
        self.path = path
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"data.path={str(path)!r} has format_version {self.meta.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}"
            )
        self.tokens = np.memmap(path / TOKENS_FILE, dtype=np.dtype(self.meta["dtype"]), mode="r")
        self.doc_offsets = np.load(path / OFFSETS_FILE, mmap_mode="r")
        if self.tokens.size != self.meta["num_tokens"] or self.doc_offsets[-1] != self.tokens.size:
            raise ValueError(
                f"data.path={str(path)!r} is inconsistent: {self.tokens.size} tokens on disk, "
                f"meta says {self.meta['num_tokens']}, offsets end at {int(self.doc_offsets[-1])}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, T] int64; also the labels (the model shifts them)
    cu_seqlens: torch.Tensor  # [N + 1] int32, document pieces inside the window (the model derives positions)
    index: int  # global micro-batch index, for logging and checks


class MicroBatchSampler:
    """Deterministic windows of a PackedDataset for one rank, addressed by global index."""

    def __init__(
        self,
        dataset: PackedDataset,
        tokens_per_micro_batch: int,
        max_seq_len: int,
        seed: int,
        rank: int,
        world_size: int,
        document_boundaries: bool = True,
    ):
        if tokens_per_micro_batch < 2:
            raise ValueError(f"tokens_per_micro_batch must be >= 2, got {tokens_per_micro_batch}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_windows = dataset.num_tokens // tokens_per_micro_batch
        if self.num_windows < 1:
            raise ValueError(
                f"train.tokens_per_micro_batch={tokens_per_micro_batch} is larger than the dataset at "
                f"{str(dataset.path)!r} ({dataset.num_tokens} tokens)"
            )
        self.dataset = dataset
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.document_boundaries = document_boundaries
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def window_of(self, global_index: int) -> int:
        epoch, within = divmod(global_index, self.num_windows)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch_order = (epoch, order)
        return int(self._epoch_order[1][within])

    def micro_batch(self, global_index: int) -> MicroBatch:
        """The window for global micro-batch `global_index` (any rank can ask for any index)."""
        length = self.tokens_per_micro_batch
        start = self.window_of(global_index) * length
        end = start + length
        input_ids = torch.from_numpy(self.dataset.tokens[start:end].astype(np.int64)).unsqueeze(0)
        doc_starts = np.zeros(0, dtype=np.int64)
        if self.document_boundaries:
            offsets = self.dataset.doc_offsets
            first_doc = int(np.searchsorted(offsets, start, side="right"))
            last_doc = int(np.searchsorted(offsets, end, side="left"))
            doc_starts = np.asarray(offsets[first_doc:last_doc], dtype=np.int64) - start
        bounds = np.concatenate([[0], doc_starts, [length]])
        cu_seqlens = _split_long_pieces(bounds, self.max_seq_len)
        return MicroBatch(
            input_ids=input_ids,
            cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
            index=global_index,
        )

    def rank_micro_batch(self, position: int, micro_step: int) -> MicroBatch:
        """This rank's micro-batch number `micro_step` after `position` global micro-batches."""
        return self.micro_batch(position + micro_step * self.world_size + self.rank)


def _split_long_pieces(bounds: np.ndarray, max_len: int) -> np.ndarray:
    """Boundaries with every piece longer than max_len cut into max_len pieces (plus a remainder)."""
    cuts = [0]
    for begin, finish in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        cuts.extend(range(begin + max_len, finish, max_len))
        if finish > cuts[-1]:
            cuts.append(finish)
    return np.asarray(cuts, dtype=np.int64)
