"""The packed data format, its micro-batches (cu_seqlens, determinism, sharding) and prepare_data."""
import json
import re

import numpy as np
import pytest
import torch

from train.data import ByteTokenizer, MicroBatchSampler, PackedDataset, write_packed_dataset
from train.embedded_corpus import embedded_documents
from train.prepare_data import build_embedded_dataset, main as prepare_data_main


def _random_documents(num_docs, vocab_size, seed=0, max_len=300):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=rng.integers(1, max_len)).tolist() for _ in range(num_docs)]


def test_round_trip_keeps_every_document(tmp_path):
    docs = _random_documents(50, 1000)
    meta = write_packed_dataset(tmp_path / "ds", docs, vocab_size=1000, eos_id=999, tokenizer_name="test")
    dataset = PackedDataset(tmp_path / "ds")
    assert meta["dtype"] == "uint16" and meta["num_documents"] == 50
    assert dataset.num_tokens == sum(len(d) for d in docs)
    for d, doc in enumerate(docs):
        start, end = dataset.doc_offsets[d], dataset.doc_offsets[d + 1]
        assert dataset.tokens[start:end].tolist() == doc


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    docs = [[0, 151_000, 248_000]]
    meta = write_packed_dataset(tmp_path / "ds", docs, vocab_size=248_320, eos_id=None, tokenizer_name="test")
    assert meta["dtype"] == "uint32"
    assert PackedDataset(tmp_path / "ds").tokens.tolist() == docs[0]


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        write_packed_dataset(tmp_path / "a", [[1, 2, 10]], vocab_size=10, eos_id=None, tokenizer_name="t")
    with pytest.raises(ValueError, match="documents is empty"):
        write_packed_dataset(tmp_path / "b", [[]], vocab_size=10, eos_id=None, tokenizer_name="t")
    write_packed_dataset(tmp_path / "c", [[1]], vocab_size=10, eos_id=None, tokenizer_name="t")
    with pytest.raises(ValueError, match="already exists"):
        write_packed_dataset(tmp_path / "c", [[1]], vocab_size=10, eos_id=None, tokenizer_name="t")
    assert not list(tmp_path.glob("*.partial-*"))
    with pytest.raises(ValueError, match="meta.json is missing"):
        PackedDataset(tmp_path)


@pytest.fixture
def small_dataset(tmp_path):
    docs = _random_documents(200, 500, seed=1, max_len=700)
    write_packed_dataset(tmp_path / "ds", docs, vocab_size=500, eos_id=None, tokenizer_name="test")
    return PackedDataset(tmp_path / "ds")


def test_micro_batch_is_a_full_window_with_document_boundaries(small_dataset):
    length, max_seq_len = 1024, 256
    sampler = MicroBatchSampler(small_dataset, length, max_seq_len, seed=3, rank=0, world_size=1)
    offsets = np.asarray(small_dataset.doc_offsets)
    for index in range(sampler.num_windows):
        batch = sampler.micro_batch(index)
        start = sampler.window_of(index) * length
        assert batch.input_ids.shape == (1, length) and batch.input_ids.dtype == torch.int64
        assert batch.input_ids[0].tolist() == small_dataset.tokens[start : start + length].tolist()
        cu = batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == length and batch.cu_seqlens.dtype == torch.int32
        pieces = np.diff(cu)
        assert (pieces >= 1).all() and (pieces <= max_seq_len).all()
        # every document start inside the window is a boundary
        inside = offsets[(offsets > start) & (offsets < start + length)] - start
        assert set(inside.tolist()) <= set(cu)


def test_order_is_deterministic_and_ranks_read_disjoint_windows(small_dataset):
    world_size = 3
    samplers = [MicroBatchSampler(small_dataset, 512, 512, seed=7, rank=r, world_size=world_size) for r in range(3)]
    num_windows = samplers[0].num_windows
    steps = num_windows // world_size
    seen = [samplers[r].window_of(samplers[r].rank_micro_batch(s * world_size, 0).index)
            for s in range(steps) for r in range(world_size)]
    assert len(set(seen)) == len(seen)  # one epoch: no window twice
    again = MicroBatchSampler(small_dataset, 512, 512, seed=7, rank=1, world_size=world_size)
    assert torch.equal(again.rank_micro_batch(6, 0).input_ids, samplers[1].rank_micro_batch(6, 0).input_ids)
    other_seed = MicroBatchSampler(small_dataset, 512, 512, seed=8, rank=0, world_size=1)
    assert [other_seed.window_of(i) for i in range(num_windows)] != [samplers[0].window_of(i) for i in range(num_windows)]
    # the next epoch is a different permutation of the same windows
    epoch0 = [samplers[0].window_of(i) for i in range(num_windows)]
    epoch1 = [samplers[0].window_of(num_windows + i) for i in range(num_windows)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_sampler_rejects_a_window_larger_than_the_data(small_dataset):
    with pytest.raises(ValueError, match="tokens_per_micro_batch=1000000 is larger than the dataset"):
        MicroBatchSampler(small_dataset, 1_000_000, 1024, seed=0, rank=0, world_size=1)


def test_embedded_corpus_is_reproducible(tmp_path):
    assert list(embedded_documents(20, seed=5)) == list(embedded_documents(20, seed=5))
    assert list(embedded_documents(20, seed=5)) != list(embedded_documents(20, seed=6))
    meta = build_embedded_dataset(tmp_path / "emb", 100)
    dataset = PackedDataset(tmp_path / "emb")
    assert meta["vocab_size"] == 257 and meta["eos_id"] == 256
    first = dataset.tokens[dataset.doc_offsets[0] : dataset.doc_offsets[1]].tolist()
    assert first[-1] == 256
    assert ByteTokenizer().decode(first) == next(embedded_documents(1))


def test_prepare_data_from_jsonl_and_text_with_bytes(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "first doc"}) + "\n\n" + json.dumps({"text": "héllo"}) + "\n")
    (tmp_path / "b.txt").write_text("para one\n\npara two\n")
    assert prepare_data_main([
        "--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--tokenizer", "bytes",
        "--output", str(tmp_path / "out"), "--txt-split", "blank-line",
    ]) == 0
    dataset = PackedDataset(tmp_path / "out")
    tokenizer = ByteTokenizer()
    docs = [dataset.tokens[a:b].tolist() for a, b in zip(dataset.doc_offsets[:-1], dataset.doc_offsets[1:])]
    assert [tokenizer.decode(d) for d in docs] == ["first doc", "héllo", "para one", "para two\n"]
    assert all(d[-1] == tokenizer.eos_id for d in docs)


def test_prepare_data_errors_name_the_argument(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="has no key 'text'"):
        prepare_data_main(["--input", str(tmp_path / "a.jsonl"), "--tokenizer", "bytes", "--output", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--input .* does not exist"):
        prepare_data_main(["--input", str(tmp_path / "missing.txt"), "--tokenizer", "bytes", "--output", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--tokenizer='/nonexistent' is not a directory"):
        prepare_data_main(["--input", str(tmp_path / "a.jsonl"), "--tokenizer", "/nonexistent", "--output", str(tmp_path / "o")])


def test_prepare_data_with_a_local_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    hf.save_pretrained(tmp_path / "tok")
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["hello world", "world x"]) + "\n")
    prepare_data_main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                       "--output", str(tmp_path / "out")])
    dataset = PackedDataset(tmp_path / "out")
    assert dataset.tokens.tolist() == [2, 3, 1, 3, 0, 1]
    assert dataset.meta["eos_id"] == 1 and dataset.vocab_size == 4


def _word_level_tokenizer(directory, vocab):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("contents", ["config.json", "nothing"])
def test_prepare_data_refuses_a_directory_without_tokenizer_files(tmp_path, contents):
    tokenizer_dir = tmp_path / "hf_final"
    tokenizer_dir.mkdir()
    if contents == "config.json":  # what a run's HF export holds: weights, no tokenizer
        (tokenizer_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "vocab_size": 256}))
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    output = tmp_path / "out"
    expected = (rf"--tokenizer='{re.escape(str(tokenizer_dir))}': directory .*hf_final has no tokenizer files"
                r".*expected tokenizer\.json and tokenizer_config\.json")
    with pytest.raises(ValueError, match=expected):
        prepare_data_main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tokenizer_dir), "--output", str(output)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_final", "in.jsonl"]  # nothing written


def test_prepare_data_refuses_degenerate_results(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    one_token = _word_level_tokenizer(tmp_path / "one", {"<eos>": 0})
    with pytest.raises(ValueError, match=r"--tokenizer=.*vocabulary size 1; expected .*at least 2"):
        prepare_data_main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(one_token), "--output", str(tmp_path / "o")])
    # whitespace only: the tokenizer yields nothing but the end-of-document tokens
    (tmp_path / "blank.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["  ", "\t"]) + "\n")
    words = _word_level_tokenizer(tmp_path / "words", {"<eos>": 0, "hello": 1})
    with pytest.raises(ValueError, match=r"turned all 2 documents into no tokens"):
        prepare_data_main(["--input", str(tmp_path / "blank.jsonl"), "--tokenizer", str(words), "--output", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.partial-*"))
