"""RW-LoRA vs gossip LoRA on a pretrained causal LM (default SmolLM2-135M), equal local updates.

Each client holds a private contiguous shard of Shakespeare (flwr-datasets ``IidPartitioner``
over rows of ``seq-len + 1`` tokens of the model's own tokenizer); the last ``val-fraction``
of the text is held out and no client trains on it. Both methods train the same peft LoRA
adapter (``TaskType.CAUSAL_LM``, LoRA on the architecture's default target modules) with the
same client (:class:`flwr_isoloco.clients.LoRAClient` with a
:class:`~flwr_isoloco.clients.lora_causal.CausalLoRAClientConfig`), the same K local AdamW
steps per visit and the same total number of local updates ``U``: RW-LoRA ``U / K`` rounds of
one client, gossip ``U / (n K)`` rounds of all ``n`` clients (complete graph, Metropolis
mixing). The server scores the held-out perplexity ``exp(mean token NLL)`` of the starting
adapter, of the RW-LoRA token and of the gossip vertex average (A and B averaged separately)
and of each gossip vertex's own adapter (their mean), on the first ``eval-tokens`` held-out
tokens.

The run is Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend) with a
ServerApp whose ``main`` starts each method's strategy in turn on the same simulated nodes;
``--engine fake`` runs the same server on the in-process test grid instead.

    nice -n 10 .venv/bin/python benchmarks/rwlora/rwlora_llm.py                     # SmolLM2-135M
    .venv/bin/python benchmarks/rwlora/rwlora_llm.py --model DIR --updates 8 --seq-len 32 ...

Output: ``--out`` (default ``benchmarks/results/rwlora_llm.json``): the settings, and per
method the perplexity before/after, local updates, bytes relayed through the server and as a
peer-to-peer deployment would send them, rounds and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

ROOT = common.REPO
common.on_path("tests", "")
common.offline_env()
# Ray's memory monitor kills a worker when the *machine* passes 95% of its memory, whoever uses
# it; on a shared machine that kills a 2 GB client for other jobs' memory. Off by default here.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
common.export_path("")

METHODS = ("rwlora", "gossip")


def client_config(args):
    from flwr_isoloco.clients.lora_causal import CausalLoRAClientConfig, CausalLoRASpec

    model, gguf = args.model, args.gguf_file
    if not model:  # the installed SmolLM2-135M GGUF
        from flwr_isoloco.models.hf import smollm2_gguf

        model, gguf = smollm2_gguf()
    spec = CausalLoRASpec(
        model=model, gguf_file=gguf, r=args.rank, alpha=2.0 * args.rank, seed=args.seed
    )
    return CausalLoRAClientConfig(
        lora=spec,
        corpus=args.corpus,
        val_fraction=args.val_fraction,
        seq_len=args.seq_len,
        eval_tokens=args.eval_tokens,
        data_seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        local_steps=args.local_steps,
        num_threads=args.threads,
        cache_dir=args.cache_dir,
    )


def rounds_for(method: str, args) -> int:
    per_round = args.local_steps * (1 if method == "rwlora" else args.clients)
    if args.updates % per_round:
        raise SystemExit(
            f"--updates {args.updates} is not a multiple of {method}'s {per_round} per round"
        )
    return args.updates // per_round


def build_strategy(method: str, args):
    from flwr_isoloco.strategies import GossipLoRA, RWLoRA

    common = dict(
        num_vertices=args.clients,
        graph_seed=args.seed,
        local_steps=args.local_steps,
        node_wait_s=args.node_wait_s,
        fraction_evaluate=0.0,  # the server scores the held-out text itself
    )
    if method == "gossip":
        return GossipLoRA(args.graph, **common)
    return RWLoRA(args.graph, seed=args.seed, **common)


def server_main(
    method: str, args, cfg, grid, out: dict[str, Any], scored: dict[str, tuple[float, int]]
) -> None:
    """Run ``method`` on ``grid``: held-out perplexity at round 0 and at the end, the ledger.
    ``scored`` (adapter digest -> (NLL, tokens)) scores equal adapters once (the shared starting adapter,
    gossip's vertices after mixing on a complete graph)."""
    from flwr.app import ArrayRecord, MetricRecord

    from flwr_isoloco.clients.lora_causal import (
        corpus_tokens,
        get_causal_model,
        heldout_nll,
        perplexity,
    )
    from flwr_isoloco.models.classifier import load_adapter_state_dict
    from flwr_isoloco.strategies.core.replies import array_digest

    built = get_causal_model(cfg.lora, slot="server")
    _, val = corpus_tokens(built.tokenizer, cfg.corpus, cfg.val_fraction, cfg.cache_dir or None)
    rounds = rounds_for(method, args)
    strategy = build_strategy(method, args)

    def score(arrays: ArrayRecord) -> float:
        key = array_digest({"a": arrays})
        if key not in scored:
            load_adapter_state_dict(built.model, arrays.to_torch_state_dict())
            scored[key] = heldout_nll(
                built.model, val, cfg.seq_len, cfg.batch_size, cfg.eval_tokens
            )
        out["eval-tokens"] = scored[key][1]
        return scored[key][0]

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
        if rnd not in (0, rounds):
            return None
        nll = score(arrays)
        m = {"heldout-nll": nll, "heldout-ppl": perplexity(nll)}
        if method == "gossip" and rnd:
            own = [score(a) for a in strategy.vertex_adapters().values()]
            m["heldout-ppl-vertex-mean"] = sum(perplexity(x) for x in own) / len(own)
        out["before" if rnd == 0 else "after"] = m
        return MetricRecord(m)

    t0 = time.time()
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(built.initial_adapter),
        num_rounds=rounds,
        timeout=args.round_timeout,
        evaluate_fn=evaluate,
    )
    out.update(
        {
            "rounds": rounds,
            "completed-rounds": int(strategy.completed_rounds),
            "local-updates": int(strategy.local_updates),
            "bytes-relayed": int(strategy.bytes_relayed),
            "bytes-p2p": int(strategy.bytes_p2p),
            "adapter-bytes": sum(t.numel() * 4 for t in built.initial_adapter.values()),
            "adapter-tensors": len(built.initial_adapter),
            "target-modules": list(built.target_modules),
            "server-wall-s": time.time() - t0,
        }
    )


def run_methods(methods: list[str], args) -> dict[str, dict[str, Any]]:
    """The methods one after the other in one federation under ``args.engine`` (one Ray
    start, each client process loads the model once); a result row per method (raises if one
    did not finish). A node's batch stream continues from where the previous method left it:
    every method trains on fresh rows of the same private shards."""
    from flwr_isoloco.clients.lora_client import LoRAClient

    cfg = client_config(args)
    client = LoRAClient(cfg)
    outs: dict[str, dict[str, Any]] = {m: {"method": m} for m in methods}
    scored: dict[str, tuple[float, int]] = {}

    def serve(grid) -> None:
        for m in methods:
            t0 = time.time()
            server_main(m, args, cfg, grid, outs[m], scored)
            outs[m]["wall-s"] = time.time() - t0

    if args.engine == "fake":
        from fakegrid import FakeGrid

        handlers = {"train": client.train, "evaluate": client.evaluate, "query": client.query}
        serve(FakeGrid(handlers, num_nodes=args.clients))
    else:
        from flwr.clientapp import ClientApp
        from flwr.serverapp import ServerApp

        server = ServerApp()

        @server.main()
        def main(grid, context):
            serve(grid)

        capp = ClientApp()
        client.register(capp)
        common.ray_simulation(server, capp, args.clients, init_args={"num_cpus": args.ray_cpus})
    for m, out in outs.items():
        if out.get("completed-rounds") != rounds_for(m, args) or "after" not in out:
            raise RuntimeError(f"{m}: the run did not complete ({out})")
    return outs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder / Hub name ('' = SmolLM2-135M GGUF)")
    ap.add_argument("--gguf-file", default="")
    ap.add_argument("--corpus", default="shakespeare")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--graph", default="complete")
    ap.add_argument("--local-steps", type=int, default=1)
    ap.add_argument("--updates", type=int, default=8, help="local updates per method")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--engine", choices=("ray", "fake"), default="ray")
    ap.add_argument("--ray-cpus", type=int, default=1, help="Ray CPUs (1 = one client actor)")
    ap.add_argument("--node-wait-s", type=float, default=300.0)
    ap.add_argument("--round-timeout", type=float, default=3600.0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--cache-dir", default="")
    ap.add_argument("--out", default=str(common.RESULTS / "rwlora_llm.json"))
    return ap.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not set(methods) <= set(METHODS):
        raise SystemExit(f"--methods must be among {METHODS}, got {methods}")
    for m in methods:
        rounds_for(m, args)  # refuse an unequal budget before anything runs
    t0 = time.time()
    runs = run_methods(methods, args)
    settings = {k.replace("_", "-"): v for k, v in vars(args).items()}
    results = {
        "settings": settings,
        "runs": runs,
        "total-wall-s": time.time() - t0,
        "server-process-peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(runs, indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return results


if __name__ == "__main__":
    main()
