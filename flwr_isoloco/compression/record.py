"""Self-describing compressed ArrayRecords: ``compress(tensors, codec, **options)`` and
``decompress(record)``.

Layout of a compressed record (every value a 1-D numpy array, so it travels in a Flower
``ArrayRecord``):

- ``HEADER_KEY`` (``"__codec__"``): uint8 UTF-8 JSON ``{"format", "version", "codec",
  "options", "tensors": {name: {"shape", "dtype", "enc"}}}``;
- for each tensor ``name``, parts ``"<name>/<p>"``: ``enc="raw"``: ``v`` (fp32 for floating
  tensors, else the tensor's own dtype); ``int8``: ``q`` int8 (n), ``s`` fp32 (ceil(n/B));
  ``fp8``: ``q`` uint8 e4m3 bit patterns (n), ``s``; ``topk``: ``i`` int32 (k) and ``v`` fp32
  (k) or ``q`` int8 (k) + ``s`` (ceil(k/B)); ``int4``: ``q`` uint8 (ceil(n/2), two nibbles
  per byte), ``s``; ``sparseloco``: ``i`` uint8 (packed tile-local indices), ``q`` uint8
  (packed codes), ``t`` fp32 (2^bits table) -- see :mod:`flwr_isoloco.compression.lowbit`.

Floating tensors with at least ``min_dims`` dimensions (default 2) use the codec; the others
travel raw, and so do sparseloco tensors whose tiles are too small for its density (see
:mod:`~flwr_isoloco.compression.lowbit`, "Tiles and small tensors"). The header alone tells a
server how to decode (no side information).

Every record is treated as hostile: :func:`decompress` bounds the header's size, the number of
tensors and their total entries (``max_entries``) and checks each part's dtype and length (from
the Array's metadata, then from the npy blob's own header, which is parsed by hand instead of
``np.load``) *before* allocating anything; unknown codecs,
bad options, indices out of range or unsorted, non-finite / negative scales, fp8 NaN codes,
int4 codes of -8, non-finite sparseloco tables, stray padding bits, missing or extra parts all
raise ``ValueError`` naming the tensor.

``ef_decay`` (every codec but ``none``) is an option of the sender's error feedback
(:mod:`flwr_isoloco.compression.feedback`), validated here but not written into the header.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from numpy.lib import format as npy

from flwr_isoloco.compression import codecs as C
from flwr_isoloco.compression import lowbit as L

HEADER_KEY = "__codec__"
FORMAT, VERSION = "flwr-isoloco-compressed", 1
CODECS = ("none", "int8", "fp8", "topk", "int4", "sparseloco")
TOPK_VALUES = ("fp32", "int8")
MAX_HEADER_BYTES = 8 << 20
MAX_TENSORS = 100_000
MAX_DIMS = 8
MAX_ENTRIES = 1 << 31  # total decoded entries of one record (8 GiB as fp32)
_NPY_SLACK = 4096  # npy header bytes allowed above a part's payload

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "none": {},
    "int8": {"block_size": 256, "min_dims": 2},
    "fp8": {"block_size": 256, "min_dims": 2},
    "topk": {"fraction": 0.01, "values": "fp32", "block_size": 256, "min_dims": 2},
    "int4": {"block_size": 256, "min_dims": 2},
    "sparseloco": {"chunk": 4096, "k": 64, "bits": 2, "min_dims": 2},
}
# Error-feedback decay per codec (feedback.py): 1.0 keeps every residual (the telescoping sum);
# sparseloco follows SparseLoCo's 0.95 (templar's hparams ``momentum_decay``).
EF_DECAY_DEFAULTS = {"int8": 1.0, "fp8": 1.0, "topk": 1.0, "int4": 1.0, "sparseloco": 0.95}


def _int_in(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"codec option {name!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def normalize_options(codec: Any, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The codec's full option dict (defaults filled in); ValueError on unknown codec/options."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    opts = dict(_DEFAULTS[codec])
    if codec in EF_DECAY_DEFAULTS:
        opts["ef_decay"] = EF_DECAY_DEFAULTS[codec]
    for k, v in (options or {}).items():
        if k not in opts:
            raise ValueError(f"codec {codec!r} takes options {sorted(opts)}, got {k!r}")
        opts[k] = v
    if "block_size" in opts:
        _int_in("block_size", opts["block_size"], 1, 1 << 20)
    if "min_dims" in opts:
        _int_in("min_dims", opts["min_dims"], 0, MAX_DIMS)
    if codec == "topk":
        f = opts["fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"codec option 'fraction' must be a number in (0, 1], got {f!r}")
        opts["fraction"] = float(f)
        if opts["values"] not in TOPK_VALUES:
            raise ValueError(f"codec option 'values' must be one of {TOPK_VALUES}")
    if codec == "sparseloco":
        _check_sparseloco_options(opts)
    if "ef_decay" in opts:
        d = opts["ef_decay"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise ValueError(f"codec option 'ef_decay' must be a number in [0, 1], got {d!r}")
        opts["ef_decay"] = float(d)
    return opts


def _check_sparseloco_options(opts: dict[str, Any]) -> None:
    """``chunk`` a square in [4, 2^20] (tiles of isqrt(chunk)^2), ``k`` in [1, chunk], ``bits``."""
    chunk = _int_in("chunk", opts["chunk"], 4, 1 << 20)
    if math.isqrt(chunk) ** 2 != chunk:
        raise ValueError(f"codec option 'chunk' must be a square (tiles side^2), got {chunk}")
    _int_in("k", opts["k"], 1, chunk)
    if isinstance(opts["bits"], bool) or opts["bits"] not in L.SPARSELOCO_BITS:
        raise ValueError(f"codec option 'bits' must be one of {L.SPARSELOCO_BITS}")


def encoding(t: torch.Tensor, codec: str, options: Mapping[str, Any]) -> str:
    """``codec`` for a floating tensor with >= ``min_dims`` dims and entries, else ``"raw"``;
    also ``"raw"`` for a sparseloco tensor whose tiles are too small for the density ``k /
    chunk`` (:func:`~flwr_isoloco.compression.lowbit.sparse_refusal`)."""
    if codec == "none" or not t.is_floating_point() or t.numel() == 0:
        return "raw"
    if t.dim() < options["min_dims"]:
        return "raw"
    if codec == "sparseloco" and L.sparse_refusal(tuple(t.shape), options["chunk"], options["k"]):
        return "raw"
    return codec


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype {t.dtype} cannot be compressed")
    return name


def _encode(t: torch.Tensor, enc: str, o: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if enc == "raw":
        return {"v": t.reshape(-1).float() if t.is_floating_point() else t.reshape(-1)}
    x = t.detach().reshape(-1).float()
    if enc == "int8":
        return C.encode_int8(x, o["block_size"])
    if enc == "fp8":
        return C.encode_fp8(x, o["block_size"])
    if enc == "int4":
        return L.encode_int4(x, o["block_size"])
    if enc == "sparseloco":
        return L.encode_sparseloco(x, tuple(t.shape), o["chunk"], o["k"], o["bits"])
    return C.encode_topk(x, o["fraction"], o["values"], o["block_size"])


def compress(tensors: Mapping[str, torch.Tensor], codec: str, **options: Any) -> ArrayRecord:
    """Encode ``tensors`` with ``codec`` into a self-describing ArrayRecord (see module doc).

    Part names ``<name>/<one letter>`` are unambiguous for any tensor names. Raises ValueError
    for an unknown codec/option or a tensor with non-finite entries (naming it).
    """
    opts = normalize_options(codec, options)
    header: dict[str, Any] = {}
    arrays: dict[str, Array] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().cpu()
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"tensor {name!r} has non-finite entries; refusing to compress")
        enc = encoding(t, codec, opts)
        header[name] = {"shape": list(t.shape), "dtype": _dtype_name(t), "enc": enc}
        for part, p in _encode(t, enc, opts).items():
            arrays[f"{name}/{part}"] = Array(np.ascontiguousarray(p.numpy()))
    wire = {k: v for k, v in opts.items() if k != "ef_decay"}  # the sender's business
    meta = {"format": FORMAT, "version": VERSION, "codec": codec, "options": wire}
    return ArrayRecord({HEADER_KEY: json_array({**meta, "tensors": header}), **arrays})


def is_compressed(record: ArrayRecord) -> bool:
    """Whether ``record`` carries a compression header."""
    return HEADER_KEY in record


def payload_nbytes(record: ArrayRecord) -> int:
    """Bytes on the wire: sum over the record's arrays of ``nbytes`` (itemsize x entries).

    Read from each Array's metadata (nothing is decoded); an Array whose metadata does not
    parse counts its serialised length.
    """
    total = 0
    for arr in record.values():
        try:
            total += np.dtype(arr.dtype).itemsize * math.prod(int(d) for d in arr.shape)
        except (TypeError, ValueError):
            total += len(arr.data)
    return total


def json_header(record: ArrayRecord, key: str, limit: int = MAX_HEADER_BYTES) -> Any:
    """The JSON value of ``record[key]``, a 1-D uint8 array of at most ``limit`` bytes of UTF-8
    JSON, read as hostile input (sizes checked before anything is decoded); ValueError naming
    ``key``."""
    arr = record[key]
    if (
        str(arr.dtype) != "uint8"
        or len(arr.shape) != 1
        or not isinstance(arr.shape[0], int)
        or len(arr.data) > limit + _NPY_SLACK
        or arr.shape[0] > limit
    ):
        raise ValueError(f"{key!r}: header must be a 1-D uint8 array of <= {limit} bytes")
    blob = npy_1d(arr.data, "uint8", arr.shape[0])
    if isinstance(blob, str):
        raise ValueError(f"{key!r}: header {blob}")
    try:
        return json.loads(blob.tobytes().decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key!r}: header is not UTF-8 JSON ({exc})") from None


def json_array(value: Any) -> Array:
    """``value`` as the compact UTF-8 JSON uint8 array :func:`json_header` reads."""
    blob = json.dumps(value, separators=(",", ":")).encode()
    return Array(np.frombuffer(blob, dtype=np.uint8).copy())


def nest(records: list[ArrayRecord], letter: str) -> dict[str, Array]:
    """Several records in one: record ``i``'s array ``k`` under ``"<letter><i>:<k>"``."""
    return {f"{letter}{i}:{k}": v for i, rec in enumerate(records) for k, v in rec.items()}


def unnest(record: ArrayRecord, letter: str, n: int, skip: set[str]) -> list[ArrayRecord]:
    """The ``n`` records :func:`nest` put in ``record`` (arrays in ``skip`` left out); an array
    of any other name, or of a number outside ``[0, n)``, is refused (ValueError)."""
    parts: list[dict[str, Array]] = [{} for _ in range(n)]
    for key, arr in record.items():
        if key in skip:
            continue
        head, sep, rest = key.partition(":")
        i = int(head[1:]) if head[:1] == letter and head[1:].isdigit() else -1
        if not sep or not 0 <= i < n:
            raise ValueError(f"nested record: unexpected array {key[:80]!r}")
        parts[i][rest] = arr
    return [ArrayRecord(p) for p in parts]


def _parse_header(record: ArrayRecord) -> dict[str, Any]:
    head = json_header(record, HEADER_KEY)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"{HEADER_KEY!r}: not a {FORMAT} header")
    if head.get("version") != VERSION:
        raise ValueError(f"{HEADER_KEY!r}: unsupported version {head.get('version')!r}")
    opts = head.get("options")
    if not isinstance(opts, dict):
        raise ValueError(f"{HEADER_KEY!r}: options must be an object")
    try:
        head["options"] = normalize_options(head.get("codec"), opts)
    except ValueError as exc:
        raise ValueError(f"{HEADER_KEY!r}: {exc}") from None
    tensors = head.get("tensors")
    if not isinstance(tensors, dict) or len(tensors) > MAX_TENSORS:
        raise ValueError(f"{HEADER_KEY!r}: 'tensors' must be an object of <= {MAX_TENSORS}")
    return head


def _tensor_spec(name: str, spec: Any, codec: str) -> tuple[tuple[int, ...], str, str, int]:
    if not isinstance(spec, dict):
        raise ValueError(f"tensor {name!r}: header entry is not an object")
    shape, dtype, enc = spec.get("shape"), spec.get("dtype"), spec.get("enc")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape)
    ):
        raise ValueError(f"tensor {name!r}: bad shape {str(shape)[:80]}")
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {name!r}: unsupported dtype {str(dtype)[:40]!r}")
    if enc not in ("raw", codec) or enc == "none":
        raise ValueError(f"tensor {name!r}: encoding {str(enc)[:40]!r} is not raw or {codec!r}")
    if enc != "raw" and not _DTYPES[dtype].is_floating_point:
        raise ValueError(f"tensor {name!r}: encoding {enc!r} needs a floating dtype")
    return tuple(shape), dtype, enc, math.prod(shape)


def _part_layout(
    shape: tuple[int, ...], n: int, dtype: str, enc: str, o: Mapping[str, Any]
) -> dict[str, tuple[str, int]]:
    """Expected ``part -> (numpy dtype, length)`` of one tensor of ``shape`` (``n`` entries)."""
    if enc == "raw":
        return {"v": ("float32" if _DTYPES[dtype].is_floating_point else dtype, n)}
    if enc == "sparseloco":
        return L.sparseloco_layout(shape, o)
    b = o["block_size"]
    if enc == "int4":
        return L.int4_layout(n, b)
    if enc in ("int8", "fp8"):
        return {"q": ("int8" if enc == "int8" else "uint8", n), "s": ("float32", C.n_blocks(n, b))}
    k = C.topk_count(n, o["fraction"])
    if o["values"] == "int8":
        return {"i": ("int32", k), "q": ("int8", k), "s": ("float32", C.n_blocks(k, b))}
    return {"i": ("int32", k), "v": ("float32", k)}


def npy_1d(data: bytes, dtype: str, n: int) -> np.ndarray | str:
    """The 1-D array of an npy blob, checked against ``(dtype, n)`` from its header *before*
    any allocation (``np.load`` would allocate whatever the blob's own header claims)."""
    bio = io.BytesIO(data)
    try:
        version = npy.read_magic(bio)
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran, dt = read(bio, max_header_size=_NPY_SLACK)
    except (ValueError, TypeError, OSError, SyntaxError) as exc:
        return f"is not a valid npy blob ({type(exc).__name__})"
    if dt != np.dtype(dtype) or tuple(shape) != (n,) or fortran:
        return f"holds {dt}{tuple(shape)}, expected {dtype}({n},)"
    offset = bio.tell()
    if len(data) - offset != n * dt.itemsize:
        return f"has {len(data) - offset} data bytes, expected {n * dt.itemsize}"
    return np.frombuffer(data, dtype=dt, count=n, offset=offset).copy()


def _load_part(record: ArrayRecord, name: str, part: str, dtype: str, n: int) -> torch.Tensor:
    key = f"{name}/{part}"
    arr = record[key]
    nbytes = n * np.dtype(dtype).itemsize
    if (
        arr.stype != "numpy.ndarray"
        or str(arr.dtype) != dtype
        or tuple(arr.shape) != (n,)
        or len(arr.data) > nbytes + _NPY_SLACK
    ):
        raise ValueError(
            f"tensor {name!r}: part {key!r} is {arr.dtype}{tuple(arr.shape)}, expected {dtype}({n},)"
        )
    nd = npy_1d(arr.data, dtype, n)
    if isinstance(nd, str):
        raise ValueError(f"tensor {name!r}: part {key!r} {nd}")
    return torch.from_numpy(nd)


def _decode_one(parts: dict[str, torch.Tensor], shape, n: int, enc: str, o: Mapping[str, Any]):
    """Flat fp32 (or raw) reconstruction, or a string saying why the parts are bad."""
    if enc == "raw":
        return parts["v"]
    if enc == "sparseloco":
        return L.decode_sparseloco(parts, shape, o)
    if enc == "int4":
        return L.decode_int4(parts["q"], parts["s"], n, o["block_size"])
    if "s" in parts and (why := C.check_scales(parts["s"])):
        return why
    if enc == "int8":
        return C.decode_int8(parts["q"], parts["s"], o["block_size"])
    if enc == "fp8":
        if bad := C.fp8_nan_count(parts["q"]):
            return f"has {bad} fp8 NaN codes"
        return C.decode_fp8(parts["q"], parts["s"], o["block_size"])
    if why := C.check_sorted_indices(parts["i"], n):
        return why
    if o["values"] == "int8":
        vals = C.decode_int8(parts["q"], parts["s"], o["block_size"])
    else:
        vals = parts["v"]
    return C.decode_topk(n, parts["i"], vals)


class RecordReader:
    """A :func:`compress` record checked once (header, names, shapes, parts' dtypes and lengths,
    ``max_entries``), then decoded tensor by tensor with :meth:`tensor`, so a caller combining
    several records holds one decoded tensor of each at a time (:func:`decompress` decodes all).

    ``shapes`` (e.g. the server's model) must match the header exactly (same names and shapes),
    checked before anything is allocated. Raises ValueError naming the bad key."""

    def __init__(
        self,
        record: ArrayRecord,
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        if not is_compressed(record):
            raise ValueError(f"record has no {HEADER_KEY!r} header (not compressed)")
        head = _parse_header(record)
        codec, self.options = head["codec"], head["options"]
        specs = {name: _tensor_spec(name, s, codec) for name, s in head["tensors"].items()}
        if shapes is not None:
            _check_names(specs, shapes)
        total = sum(s[3] for s in specs.values())
        if total > max_entries:
            raise ValueError(f"{HEADER_KEY!r}: header claims {total} entries > max {max_entries}")
        o = self.options
        layouts = {}
        for name, s in specs.items():
            try:  # sparseloco refuses a shape its encoder sends raw (tiles too small)
                layouts[name] = _part_layout(s[0], s[3], s[1], s[2], o)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
        wanted = {f"{name}/{p}" for name, lay in layouts.items() for p in lay}
        present = set(record.keys()) - {HEADER_KEY}
        if present != wanted:
            miss, extra = sorted(wanted - present), sorted(present - wanted)
            raise ValueError(
                f"record parts differ from its header: missing {miss[:5]}, extra {extra[:5]}"
            )
        self.record, self.specs, self.layouts = record, specs, layouts

    @property
    def names(self) -> list[str]:
        """The tensors' names, in the record's order."""
        return list(self.specs)

    def encoding(self, name: str) -> str:
        """How tensor ``name`` travels: ``"raw"`` or the codec's name."""
        return self.specs[name][2]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` decoded (the header's shape and dtype); ValueError if its parts are
        bad."""
        shape, dtype, enc, n = self.specs[name]
        lay = self.layouts[name]
        parts = {p: _load_part(self.record, name, p, d, k) for p, (d, k) in lay.items()}
        flat = _decode_one(parts, shape, n, enc, self.options)
        if isinstance(flat, str):
            raise ValueError(f"tensor {name!r}: {flat}")
        return flat.reshape(shape).to(_DTYPES[dtype])


def _check_names(specs: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    missing = sorted(set(shapes) - set(specs))
    extra = sorted(set(specs) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"tensor keys differ from the model: missing {missing[:5]}, extra {extra[:5]}"
        )
    for name, (shape, *_rest) in specs.items():
        if shape != tuple(shapes[name]):
            raise ValueError(f"tensor {name!r}: shape {shape}, expected {tuple(shapes[name])}")


def decompress(
    record: ArrayRecord,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_entries: int = MAX_ENTRIES,
) -> dict[str, torch.Tensor]:
    """Decode a :func:`compress` record into ``{name: tensor}`` (the dtypes of the header),
    checked as :class:`RecordReader` checks it."""
    reader = RecordReader(record, shapes=shapes, max_entries=max_entries)
    return {name: reader.tensor(name) for name in reader.names}


def header(record: ArrayRecord) -> dict[str, Any]:
    """The validated header of a compressed record (codec, options, tensors)."""
    return _parse_header(record)
