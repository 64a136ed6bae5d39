"""LM text pipeline: corpus, held-out split, deterministic BPE, contiguous disjoint shards."""

import numpy as np
import pytest
import torch

from flwr_isoloco.data.text import (
    eval_batches,
    load_corpus,
    prepare_tokens,
    sample_batch,
    shard_rows,
    shard_tokens,
    split_text,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def plays():
    return load_corpus("shakespeare")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, plays):
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(plays[:3]):
        (d / f"{i}.txt").write_text(text[:60_000], encoding="utf-8")
    return d


def test_shakespeare_offline(plays):
    assert len(plays) == 38
    joined = "".join(plays)
    assert not any(c in joined for c in "*_#")
    assert "Now, fair Hippolyta, our nuptial hour" in joined


def test_split_holds_out_tail(plays):
    train, val = split_text(plays, 0.05)
    joined = "\n".join(plays)
    assert train + val == joined
    assert train.endswith("\n")
    assert abs(len(val) / len(joined) - 0.05) < 0.001
    with pytest.raises(ValueError, match="val_fraction"):
        split_text(plays, 1.0)


def test_tokenizer_deterministic_and_cached(small_corpus, tmp_path):
    train, _ = split_text(load_corpus(str(small_corpus)), 0.1)
    a = train_tokenizer(train, 500, tmp_path / "a")
    b = train_tokenizer(train, 500, tmp_path / "b")
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 500
    files = list((tmp_path / "a").iterdir())
    assert len(files) == 1 and files[0].name.endswith("-v500.json")
    # cached: loading returns the same tokenizer, and byte-level BPE round-trips any text
    c = train_tokenizer(train, 500, tmp_path / "a")
    text = "Wherefore art thou, Ω? 42"
    assert c.decode(c.encode(text).ids) == text


def test_prepare_tokens_val_is_held_out(small_corpus, tmp_path):
    data = prepare_tokens(str(small_corpus), vocab_size=500, val_fraction=0.1, cache_dir=tmp_path)
    train, val = split_text(load_corpus(str(small_corpus)), 0.1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data.tokenizer_path))
    assert tok.decode(data.train.tolist()) == train
    assert tok.decode(data.val.tolist()) == val
    assert data.train.dtype == np.int32 and data.vocab_size == 500
    again = prepare_tokens(str(small_corpus), vocab_size=500, val_fraction=0.1, cache_dir=tmp_path)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)


@pytest.mark.parametrize("rows,parts", [(10, 3), (12, 4), (7, 7), (1000, 8), (5078, 4), (97, 13)])
def test_shard_rows_equal_flwr_datasets_iid_partitioner(rows, parts):
    """The closed form equals flwr-datasets' ``IidPartitioner`` over an unshuffled dataset of
    the row numbers, partition by partition (contiguous rows, the first ``mod`` one longer)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import IidPartitioner

    partitioner = IidPartitioner(num_partitions=parts)
    partitioner.dataset = Dataset.from_dict({"row": np.arange(rows, dtype=np.int64)})
    for p in range(parts):
        got = partitioner.load_partition(p).with_format("numpy")[:]["row"]
        assert shard_rows(rows, p, parts) == (int(got[0]), int(got[-1]) + 1)
        assert int(got[-1]) + 1 - int(got[0]) == len(got)  # contiguous


def test_shards_contiguous_disjoint_cover():
    tokens = np.arange(10_000, dtype=np.int32)
    shards = [shard_tokens(tokens, p, 3, block=256) for p in range(3)]
    joined = np.concatenate(shards)
    usable = (10_000 // 256) * 256
    assert np.array_equal(joined, tokens[:usable])  # in order, no overlap, no gap
    assert {len(s) for s in shards} <= {256 * 13, 256 * 12}
    with pytest.raises(ValueError, match="partition_id 3 out of range"):
        shard_tokens(tokens, 3, 3)
    with pytest.raises(ValueError, match="too few for 100 partitions"):
        shard_tokens(tokens, 0, 100)


def test_batches():
    tokens = np.arange(1000, dtype=np.int32)
    g = torch.Generator().manual_seed(0)
    b = sample_batch(tokens, 4, 16, g)
    assert b.shape == (4, 17) and b.dtype == torch.int64
    assert torch.all(b[:, 1:] - b[:, :-1] == 1)  # windows are contiguous text
    b2 = sample_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(b, b2)
    ev = list(eval_batches(tokens, 8, 16, max_tokens=320))
    flat = torch.cat(ev)
    assert flat.shape == (20, 17)
    assert torch.equal(flat[:, 0], torch.arange(0, 320, 16))


def test_default_cache_dir_ignores_empty_env(monkeypatch, tmp_path):
    from pathlib import Path

    from flwr_isoloco.data.text import default_cache_dir

    monkeypatch.setenv("FLWR_ISOLOCO_CACHE", "")
    assert default_cache_dir() == (Path.home() / ".cache" / "flwr_isoloco").resolve()
    monkeypatch.setenv("FLWR_ISOLOCO_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path.resolve()
