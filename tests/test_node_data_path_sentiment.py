"""Node-config ``data-path``: a site trains the sentiment LoRA client on its own labelled file."""

import re

import datasets
import pytest
import torch
from fakegrid import FakeGrid
from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict

from flwr_isoloco.clients.lora_client import LoRAClient, LoRAClientConfig
from flwr_isoloco.data import sentiment
from flwr_isoloco.models import classifier

torch.set_num_threads(1)

CFG = LoRAClientConfig(max_examples=48, batch_size=4, local_steps=2, max_length=24, test_size=500)


# ----------------------------------------------------------------------------- the loader
def test_loads_tsv_rows_exactly_in_file_order(tmp_path):
    f = tmp_path / "reviews.tsv"
    f.write_text("id\ttext\tlabel\n7\tgood film, truly\t1\n8\tbad film\t0\n9\tit's fine\t1\n")
    ds = sentiment.load_local_sentences(str(f))
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == ["text", "label"]  # extra columns dropped, like a partition
    assert list(ds["text"]) == ["good film, truly", "bad film", "it's fine"]
    assert list(ds["label"]) == [1, 0, 1]
    part = sentiment.load_partition(0, 8, max_examples=5)
    assert ds.features["label"].dtype == part.features["label"].dtype == "int64"
    assert ds.features["text"].dtype == part.features["text"].dtype == "string"


def test_loads_csv_rows_exactly(tmp_path):
    f = tmp_path / "reviews.csv"
    f.write_text('label,text\n0,"dull, slow"\n1,lovely\n0,meh\n1,superb acting\n')
    ds = sentiment.load_local_sentences(str(f))
    assert list(ds["text"]) == ["dull, slow", "lovely", "meh", "superb acting"]
    assert list(ds["label"]) == [0, 1, 0, 1]


def _write(tmp_path, name, data):
    f = tmp_path / name
    if isinstance(data, bytes):
        f.write_bytes(data)
    else:
        f.write_text(data)
    return str(f)


@pytest.mark.parametrize(
    "name, data, problem",
    [
        ("r.tsv", "text\tscore\ngood\t1\n", "missing column(s) ['label']"),
        ("r.csv", "sentence,label\ngood,1\n", "missing column(s) ['text']"),
        ("r.csv", "text,label\ngood,1\nbad,pos\nok,2\n", "2 row(s) are not, first data row 2 "),
        ("r.tsv", "text\tlabel\ngood\t1\nbad\t\n", "labels must be 0 or 1"),
        ("r.csv", "text,label\ngood,1\n,0\n", "data row 2 has no text"),
        ("r.csv", "", "the file is empty"),
        ("r.csv", "text,label\n", "no rows (a header only)"),
        ("r.csv", b"text,label\n\xff\xfe,1\n", "cannot be read as csv (UnicodeDecodeError"),
        ("r.txt", "text,label\ngood,1\n", "unsupported extension '.txt'"),
    ],
)
def test_bad_file_error_names_path_and_problem(tmp_path, name, data, problem):
    path = _write(tmp_path, name, data)
    with pytest.raises(ValueError) as err:
        sentiment.load_local_sentences(path)
    assert repr(path) in str(err.value) and problem in str(err.value), str(err.value)


def test_missing_or_relative_path_is_named(tmp_path):
    missing = str(tmp_path / "nope.tsv")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{missing!r} does not exist")):
        sentiment.load_local_sentences(missing)
    with pytest.raises(ValueError, match="'site/reviews.tsv' is not an absolute path"):
        sentiment.load_local_sentences("site/reviews.tsv")


# ----------------------------------------------------------------------------- the client
SITE_ROWS = [(f"site {i} review: {'wonderful' if i % 2 else 'dreadful'}", i % 2) for i in range(20)]


def _site_file(tmp_path):
    f = tmp_path / "site" / "reviews.tsv"
    f.parent.mkdir()
    f.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in SITE_ROWS))
    return str(f)


def _send(grid, node, mtype, content):
    msg = grid.create_message(content, mtype, grid.node_ids[node], "1")
    (reply,) = grid.send_and_receive([msg])
    return reply


def _train_content(adapter):
    return RecordDict({"arrays": ArrayRecord(adapter), "config": ConfigRecord({})})


def test_node_with_data_path_trains_on_its_file(tmp_path, monkeypatch):
    path = _site_file(tmp_path)
    client = LoRAClient(CFG)
    handlers = {"train": client.train, "evaluate": client.evaluate, "query": client.query}
    # node 0: the site file; node 1: data-path="" = its partition, as without the key
    paths = {0: path, 1: ""}
    grid = FakeGrid(handlers, num_nodes=2, node_config_fn=lambda i: {"data-path": paths[i]})
    plain = FakeGrid(handlers, num_nodes=2)
    init = classifier.initial_adapter(CFG.lora)

    seen: list[str] = []
    encode = classifier.encode

    def recording_encode(tokenizer, texts, max_length):
        seen.extend(texts)
        return encode(tokenizer, texts, max_length)

    monkeypatch.setattr(classifier, "encode", recording_encode)
    site = _send(grid, 0, MessageType.TRAIN, _train_content(init))
    assert not site.has_error(), site.error
    m = site.content["metrics"]
    assert m["num-examples"] == 20 - int(20 * CFG.val_fraction) == 18
    assert m["partition-id"] == 0 and m["examples-seen"] == 2 * 4
    site_texts = {t for t, _ in SITE_ROWS}
    assert len(seen) == 8 and set(seen) <= site_texts  # every batch row is from the file

    seen.clear()
    other = _send(grid, 1, MessageType.TRAIN, _train_content(init))
    assert other.content["metrics"]["num-examples"] == 48 - int(48 * 0.1)
    assert len(seen) == 8 and not set(seen) & site_texts
    # data-path "" behaves exactly like a node config without the key
    ref = _send(plain, 1, MessageType.TRAIN, _train_content(init))
    a, b = (r.content["arrays"].to_torch_state_dict() for r in (other, ref))
    assert all(torch.equal(a[k], b[k]) for k in a)

    # evaluation uses the file's validation tail; the query reports the file's size
    seen.clear()
    ev = _send(grid, 0, MessageType.EVALUATE, RecordDict({"arrays": ArrayRecord(init)}))
    assert ev.content["metrics"]["num-examples"] == 2 and set(seen) <= site_texts
    q = _send(grid, 0, MessageType.QUERY, RecordDict())
    assert q.content["config"]["partition-id"] == 0
    assert q.content["metrics"]["num-examples"] == 18


def test_bad_data_path_gives_error_reply_naming_it(tmp_path):
    bad = tmp_path / "reviews.csv"
    bad.write_text("text,stars\ngood,5\n")
    client = LoRAClient(CFG)
    handlers = {"train": client.train, "evaluate": client.evaluate, "query": client.query}
    grid = FakeGrid(handlers, num_nodes=2, node_config_fn=lambda i: {"data-path": str(bad)})
    reply = _send(grid, 0, MessageType.TRAIN, _train_content(classifier.initial_adapter(CFG.lora)))
    assert reply.has_error()
    assert (
        repr(str(bad)) in reply.error.reason and "missing column(s) ['label']" in reply.error.reason
    )
    # the node still answers who it is (the strategy maps vertices before training)
    q = _send(grid, 1, MessageType.QUERY, RecordDict())
    assert q.content["config"]["partition-id"] == 1 and "metrics" in q.content
