"""The DiLoCo worker on several devices of one site: a ``torch.distributed`` DDP group per message.

:func:`make_distributed_train_handler` is a ClientApp ``@app.train()`` handler that, for each
train message, starts ``world_size`` processes (start method ``spawn``; one per device), joins
them in a process group and runs the unchanged one-process handler
(:func:`~flwr_isoloco.clients.diloco_worker.make_diloco_train_handler`) in each, with two
substitutions:

- **data**: rank ``r`` of ``W`` sees rows ``[r B/W, (r+1) B/W)`` of every batch the one-process
  worker would draw (same seed, same order, same data cursor), so the group's global batch at
  each inner step is the one-process batch;
- **loss**: the model is wrapped in ``DistributedDataParallel`` (gradients averaged over ranks in
  the backward pass) and rank ``r``'s mean loss ``L_r`` over its ``n_r`` predicted tokens is
  weighted so that the averaged gradient is the gradient of the whole batch's token mean::

      N = sum_r n_r,   L = sum_r n_r L_r / N,
      rank r back-propagates  (W n_r / N) L_r,   DDP averages:  (1/W) sum_r W n_r grad L_r / N = grad L

  (``N`` and ``L`` come from one all-reduce of two numbers per forward pass). With equal token
  counts the weight is 1 (plain DDP); with masked or padded tokens it is what keeps the step
  equal to the one-process step. The loss the worker sees has the value ``L`` on every rank, so
  a non-finite loss stops every rank at the same step.

Every rank then clips and steps AdamW on identical gradients from identical weights and state,
so the ranks stay identical; rank 0's reply and ``context.state`` (AdamW moments, data cursor,
error-feedback residual) come back to the parent, which replies as the one-process handler would.
The reply equals the one-process reply up to fp32 summation order (the all-reduce and the split
forward pass add the same numbers in another order).

The ranks rendezvous through a ``TCPStore`` the parent serves on a free loopback port (port 0:
the kernel picks it; no race with other jobs). The message and the node's state reach the ranks
through a pickle in a private temporary folder (written once by the parent, read by each rank);
rank 0's result comes back the same way. A rank that raises or is killed ends the group: the
other ranks are terminated and the parent raises :class:`DistributedWorkerError` naming the rank
that failed first (its traceback, or its signal); collectives time out after ``timeout_s`` and
the parent gives up on the whole group after ``timeout_s`` too, so nothing hangs.

Dropout: rank 0 keeps the seed the handler sets; rank ``r > 0`` offsets it, so ranks draw
independent masks (the one-process masks cannot be reproduced on a split batch; the reply then
matches in distribution only). Without dropout the reply matches to fp32 rounding.

Not implemented: FSDP2 (``fully_shard``), for models whose fp32 weights, gradients and AdamW
moments (16 bytes per parameter) do not fit one device; the worker's reply and AdamW state are
written from full (unsharded) tensors by name, which a sharded model would first have to gather.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from logging import INFO
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from flwr.app import Context, Message, RecordDict
from flwr.common.logger import log

from flwr_isoloco.merging.device import parse_device
from flwr_isoloco.settings_tools import renamed_fields

from .diloco_worker import (
    MOVED_KEYWORDS,
    DataFn,
    LossFn,
    ModelFn,
    make_diloco_train_handler,
    next_token_loss,
)
from .worker_settings import Runtime, TrainSettings

__all__ = [
    "DistributedWorkerError",
    "make_distributed_train_handler",
    "slice_batch",
    "token_weighted_loss",
]

_LOOPBACK = "127.0.0.1"
_RESULT = "rank0-result.pkl"
_INPUTS = "inputs.pkl"


class DistributedWorkerError(RuntimeError):
    """A rank of the distributed DiLoCo worker failed (its traceback is in the message)."""


def slice_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rows ``[r B/W, (r+1) B/W)`` of a batch (a tensor, or a tuple/list/dict of tensors with
    the same number of rows ``B``); ``B`` must be a multiple of ``W`` so that every rank runs the
    same number of forward passes (micro-batches included) and the collectives line up."""
    if isinstance(batch, torch.Tensor):
        rows = batch.size(0) if batch.dim() > 0 else 0
        if rows == 0 or rows % world_size:
            raise ValueError(
                f"distributed worker: a batch of {rows} rows does not split into world_size="
                f"{world_size} equal slices; make the batch size a multiple of world_size"
            )
        step = rows // world_size
        return batch[rank * step : (rank + 1) * step]
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, rank, world_size) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(v, rank, world_size) for v in batch)
    raise ValueError(
        "distributed worker: batches must be tensors (or tuples/lists/dicts of tensors) to be "
        f"split between ranks, got {type(batch).__name__}"
    )


def token_weighted_loss(
    loss: torch.Tensor, n: int, loss_sum: float, total: int, world_size: int
) -> tuple[torch.Tensor, int]:
    """Rank ``r``'s loss for DDP's gradient average: value ``L = loss_sum / N``, gradient
    ``(W n_r / N) grad L_r`` (``loss = L_r``, ``n = n_r``, ``loss_sum = sum_r n_r L_r``,
    ``total = N``), so the average over ranks is ``grad L``; returns ``(that tensor, N)``."""
    if total <= 0:
        raise ValueError(f"distributed worker: a global batch with {total} predicted tokens")
    scaled = loss * (world_size * n / total)
    mean = torch.as_tensor(loss_sum / total, dtype=loss.dtype, device=loss.device)
    return scaled + (mean - scaled).detach(), total


class _SlicedSequence(Sequence):
    """This rank's slice of every batch of a sequence (same length: same seeded order)."""

    def __init__(self, data: Sequence, rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return slice_batch(self.data[index], self.rank, self.world_size)


class _SlicedData:
    """``data_fn`` whose batches are this rank's slices (callable or sequence data)."""

    def __init__(self, data_fn: DataFn, rank: int, world_size: int) -> None:
        self.data_fn, self.rank, self.world_size = data_fn, rank, world_size

    def __call__(self, context: Context) -> Any:
        data = self.data_fn(context)
        if callable(data):
            return lambda index: slice_batch(data(index), self.rank, self.world_size)
        if isinstance(data, Sequence):
            return _SlicedSequence(data, self.rank, self.world_size)
        return data  # the one-process handler raises its own error for anything else


class _DDPLoss:
    """``loss_fn`` run through a DDP wrapper of the worker's model, token-weighted
    (:func:`token_weighted_loss`); the wrapper is built on the first call of the message."""

    def __init__(self, loss_fn: LossFn, rank: int, world_size: int, device: torch.device):
        self.loss_fn, self.rank, self.world_size, self.device = loss_fn, rank, world_size, device
        self.model: torch.nn.Module | None = None
        self.ddp: torch.nn.Module | None = None

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.model is not model:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            self.model = model
            if self.rank > 0:  # independent dropout masks per rank (module docstring)
                torch.manual_seed(torch.initial_seed() + 1_000_033 * self.rank)
        return self.ddp

    def __call__(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        loss, n = self.loss_fn(self._wrap(model), batch)
        sums = torch.tensor([float(loss.detach()) * int(n), float(n)], dtype=torch.float64)
        sums = sums.to(loss.device)
        dist.all_reduce(sums)
        return token_weighted_loss(loss, int(n), float(sums[0]), int(sums[1]), self.world_size)


def _resolve_devices(world_size: int, backend: str | None, devices) -> tuple[list, str]:
    """The ranks' devices and the backend: ``devices`` as given (one per rank), else
    ``cuda:0 .. cuda:W-1`` where GPUs are visible (refused if fewer than ``W``), else the CPU;
    ``nccl`` for CUDA, ``gloo`` for the CPU unless ``backend`` says otherwise."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if devices is None:
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < seen < world_size:
            raise ValueError(
                f"world_size={world_size} needs one GPU per rank but this process sees {seen} "
                "(CUDA_VISIBLE_DEVICES; in a simulation --federation-config "
                '"client-resources-num-gpus=N"); give the node more GPUs, lower world_size, '
                "or pass devices="
            )
        devices = [f"cuda:{i}" for i in range(world_size)] if seen else ["cpu"] * world_size
    devs = [torch.device(d) for d in devices]
    if len(devs) != world_size:
        raise ValueError(f"devices lists {len(devs)} devices for world_size={world_size}")
    kinds = {d.type for d in devs}
    if len(kinds) != 1 or kinds - {"cpu", "cuda"}:
        raise ValueError(f"devices must be all 'cpu' or all 'cuda:<i>', got {devices!r}")
    if "cuda" in kinds:
        devs = [torch.device("cuda", d.index if d.index is not None else 0) for d in devs]
        if len(set(devs)) != world_size:
            raise ValueError(
                f"devices: one GPU per rank (NCCL refuses two ranks on one GPU), got {devices!r}"
            )
        if not torch.cuda.is_available() or max(d.index for d in devs) >= torch.cuda.device_count():
            raise ValueError(
                f"devices {devices!r}: only {torch.cuda.device_count()} CUDA devices are visible "
                "(CUDA_VISIBLE_DEVICES, or the node's num-gpus); pass devices= the node owns"
            )
    backend = backend or ("nccl" if "cuda" in kinds else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and "cuda" not in kinds:
        raise ValueError("backend='nccl' needs CUDA devices; use backend='gloo' on the CPU")
    return [str(d) for d in devs], backend


def _rank_main(rank: int, job: dict) -> None:
    """One rank (a spawned process): join the group and train. A failure is written, timed, to
    ``rank<r>.error`` before the group is left, so that the parent can name the rank that
    failed first (the others then fail on the broken group). The process ends with
    ``os._exit``: the interpreter's teardown with torch and gloo loaded took seconds here."""
    code = 1
    try:
        device = torch.device(job["devices"][rank])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world_size"]))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(job["threads"])
        timeout = timedelta(seconds=job["timeout_s"])
        store = dist.TCPStore(_LOOPBACK, job["port"], is_master=False, timeout=timeout)
        dist.init_process_group(
            job["backend"], store=store, rank=rank, world_size=job["world_size"], timeout=timeout
        )
        _train_rank(rank, job, device)
        code = 0
    except BaseException:
        with open(Path(job["dir"]) / f"rank{rank}.error", "w") as f:
            f.write(f"{time.monotonic()!r}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _train_rank(rank: int, job: dict, device: torch.device) -> None:
    """The one-process handler on this rank's slices; rank 0 writes the reply's content and
    the node's state for the parent."""
    with open(Path(job["dir"]) / _INPUTS, "rb") as f:
        msg, context = pickle.load(f)  # written by the parent, in its private temp dir
    handler = make_diloco_train_handler(
        job["model_fn"],
        _SlicedData(job["data_fn"], rank, job["world_size"]),
        loss_fn=_DDPLoss(job["loss_fn"], rank, job["world_size"], device),
        runtime=replace(job["runtime"], device=device),
        **job["kwargs"],
    )
    reply = handler(msg, context)
    if rank == 0:
        tmp = Path(job["dir"]) / (_RESULT + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump((reply.content, context.state), f)
        tmp.rename(Path(job["dir"]) / _RESULT)


def _group_error(job: dict, killed: dict[int, int]) -> DistributedWorkerError:
    """The failure of the group, first cause first: the ranks that died without an error file
    (``killed``: rank -> exit code; a signal, the out-of-memory killer), then the ranks' own
    errors in the order of the times in their error files; the others fail on the broken group
    and are named after it by their last line."""
    found = [
        (-1.0, r, f"exited with code {code}{_signal_name(code)} (killed, out of memory?)\n")
        for r, code in sorted(killed.items())
    ]
    for path in Path(job["dir"]).glob("rank*.error"):
        when, _, tb = path.read_text().partition("\n")
        found.append((float(when), int(path.stem[4:]), tb))
    found.sort()
    _, rank, text = found[0]
    later = "".join(
        f"\n(then rank {r}: {t.strip().splitlines()[-1]})" for _, r, t in found[1:] if t.strip()
    )
    return DistributedWorkerError(
        f"distributed DiLoCo worker: rank {rank} of {job['world_size']} failed:\n{text}{later}"
    )


def _signal_name(code: int) -> str:
    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


def _run_group(job: dict, timeout_s: float) -> None:
    """Start the ranks and wait for all to end; :class:`DistributedWorkerError` when one exits
    with an error or time runs out. The ranks still running then are terminated."""
    procs = mp.start_processes(
        _rank_main, args=(job,), nprocs=job["world_size"], join=False, start_method="spawn"
    ).processes
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
            if any(codes.values()):
                time.sleep(0.5)  # let the ranks that fail on the broken group write their error
                errors = {int(f.stem[4:]) for f in Path(job["dir"]).glob("rank*.error")}
                killed = {r: c for r, c in codes.items() if c and r not in errors}
                raise _group_error(job, killed)
            if len(codes) == len(procs):
                return
            if time.monotonic() > deadline:
                raise DistributedWorkerError(
                    f"distributed DiLoCo worker: no result after timeout_s={timeout_s:g} s; "
                    "the ranks were terminated"
                )
            mp_connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _replace_state(state: RecordDict, new: RecordDict) -> None:
    """``state`` made equal to ``new`` in place (wrappers such as ``with_node_state`` hold it)."""
    for key in list(state.keys()):
        if key not in new:
            del state[key]
    for key, record in new.items():
        state[key] = record


def _check_picklable(**fns: Any) -> None:
    """``ValueError`` naming the first function a spawned rank could not receive."""
    for name, fn in fns.items():
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means the same fix
            raise ValueError(
                f"distributed worker: {name} must be picklable to reach the spawned ranks "
                f"({exc}); define it at module level (or as functools.partial of one)"
            ) from None


@renamed_fields(**{k: v for k, v in MOVED_KEYWORDS.items() if k != "device"})
def make_distributed_train_handler(
    model_fn: ModelFn,
    data_fn: DataFn,
    *,
    world_size: int,
    backend: str | None = None,
    devices: Sequence[str | torch.device] | None = None,
    loss_fn: LossFn = next_token_loss,
    train: TrainSettings = TrainSettings(),  # noqa: B008 (frozen)
    runtime: Runtime = Runtime(),  # noqa: B008 (frozen)
    timeout_s: float = 1800.0,
    **handler_kwargs: Any,
) -> Callable[[Message, Context], Message]:
    """A ClientApp ``@app.train()`` handler: the DiLoCo worker on ``world_size`` devices (DDP).

    Parameters
    ----------
    model_fn, data_fn, loss_fn :
        As for :func:`~flwr_isoloco.clients.diloco_worker.make_diloco_train_handler`; they
        must be picklable (module-level functions), as each rank is a fresh process. Every batch
        is split by rows between the ranks: its row count must be a multiple of ``world_size``.
    world_size, devices, backend :
        Ranks, one device each (``["cuda:0", "cuda:1"]``; default ``cuda:0 .. cuda:W-1`` of the
        GPUs this process sees, refused if it sees fewer than ``W``; the CPU where it sees
        none); ``"nccl"`` (CUDA) or ``"gloo"`` (CPU; also CUDA), default by device.
    train, runtime :
        The one-process handler's settings, the same in every rank; ``runtime.device`` stays
        ``"auto"`` (``devices`` places the ranks) and ``runtime.cache_nodes`` is 0 in the ranks
        (a rank's process ends with its message).
    timeout_s :
        Limit for one message's group (start, H inner steps, reply) and for every collective.
    handler_kwargs :
        The one-process handler's other arguments (``payload``, ``seed``, the record keys,
        ``pace``), passed to it unchanged in every rank.
    """
    if "device" in handler_kwargs or parse_device(getattr(runtime, "device", None)) is not None:
        raise ValueError(
            "distributed worker: pass devices=[...] (one per rank), not device= or "
            "Runtime(device=...)"
        )
    devs, backend = _resolve_devices(world_size, backend, devices)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    # the one-process handler checks its arguments here, before any message (on the CPU: the
    # ClientApp's own process touches no GPU; each rank takes its device)
    handler_kwargs = dict(handler_kwargs, train=train)
    cpu = replace(runtime, device="cpu")
    make_diloco_train_handler(model_fn, data_fn, loss_fn=loss_fn, runtime=cpu, **handler_kwargs)
    runtime = replace(runtime, cache_nodes=0)  # a rank's process ends with its message
    _check_picklable(model_fn=model_fn, data_fn=data_fn, loss_fn=loss_fn)
    threads = max(1, torch.get_num_threads() // world_size)
    logged: list[bool] = []

    def train(msg: Message, context: Context) -> Message:
        if not logged:
            log(INFO, "DiLoCo worker: %d ranks (%s) on %s", world_size, backend, ", ".join(devs))
            logged.append(True)
        store = dist.TCPStore(_LOOPBACK, 0, is_master=True, wait_for_workers=False)
        with tempfile.TemporaryDirectory(prefix="isoloco-ddp-") as tmp:
            with open(Path(tmp) / _INPUTS, "wb") as f:
                pickle.dump((msg, context), f)
            job = dict(
                world_size=world_size, devices=devs, backend=backend, port=store.port,
                dir=tmp, timeout_s=float(timeout_s), threads=threads, model_fn=model_fn,
                data_fn=data_fn, loss_fn=loss_fn, runtime=runtime, kwargs=handler_kwargs,
            )  # fmt: skip
            _run_group(job, float(timeout_s))
            result = Path(tmp) / _RESULT
            if not result.exists():
                raise DistributedWorkerError("distributed DiLoCo worker: rank 0 wrote no reply")
            with open(result, "rb") as f:
                content, state = pickle.load(f)
        del store
        _replace_state(context.state, state)
        return Message(content, reply_to=msg)

    return train
