"""One line per run-config key of this app: what the key means.

The defaults are in ``pyproject.toml`` (``[tool.flwr.app.config]``) and :data:`.task.DEFAULTS`;
the checks in :data:`.task.VALIDATORS`. docs/user-guide.md's "Run-config keys" table is
generated from this mapping and the declared defaults (``python scripts/runconfig_docs.py``);
``tests/test_runconfig_docs.py`` fails when a key is missing here or the table is stale.
"""

from __future__ import annotations

KEY_DOCS: dict[str, str] = {
    "num-server-rounds": "total outer rounds (also the length of the inner learning-rate schedule)",
    "rounds-this-run": "stop after this many rounds (0 = all); continue later with `resume-from`",
    "seed": "seeds model init, node batches, node sampling and DARE masks; an int in [0, 2^32 - 1]",
    "output-dir": "absolute folder for `results.json`, the checkpoint, the plot and `model/`; "
    "empty = `~/flwr_isoloco_runs/isoloco_lm/<UTC time>-run<run id>`",
    "resume-from": "absolute path of a `checkpoint.safetensors` to continue from (empty = a "
    "fresh run)",
    "round-timeout": "seconds a round waits for replies (and for `strategy.min-nodes` nodes); "
    "replies not in by then count as missing",
    "checkpoint": "write the checkpoint and node-state files every round (false: no checkpoint; "
    "the nodes' AdamW state goes to a private per-run temp folder, removed at the end)",
    "torch-threads": "torch threads in the ServerApp and each ClientApp; in [1, 256]",
    "strategy.name": "`isoloco`, `diloco`, or `fedavg` (= DiLoCo with the mean, outer lr 1, "
    "momentum 0)",
    "strategy.merge": "merge rule: `mean`, `iso_c`, `iso_c_matched`, `iso_c_ns`, `iso_cts`, "
    "`tsv_m`, `ties`, `dare`, `sparseloco`; empty = the strategy's (IsoLoCo `iso_c`, DiLoCo and FedAvg `mean`)",
    "strategy.outer-lr": "outer learning rate; -1 = the merge rule's tuned value (iso_c 1.8, "
    'mean 0.25, ties / dare 0.7, tsv_m 5.66, iso_cts 8; FedAvg 1): strategies.md, "Per-rule '
    'defaults in the LM app"',
    "strategy.outer-momentum": "outer momentum (0 = off); -1 = the merge rule's tuned value "
    "(iso_c and mean 0.8, the others 0)",
    "strategy.nesterov": "Nesterov momentum (false: heavy-ball) when the outer momentum is > 0",
    "strategy.fast": "IsoLoCo only: Iso-C by Newton-Schulz (`iso_c_ns`) instead of the SVD",
    "strategy.orthogonalize": "`gradient`: the rule merges the pseudo-gradients; `update`: their "
    "mean, then Iso-C of the outer update after momentum",
    "strategy.min-nodes": "wait for this many nodes (and until their number is stable for 2 s); "
    "the minimum per round, waited for at most `round-timeout`, then a `strategy.quorum` of "
    "them or the run ends `failed` (deployment.md, section 7)",
    "strategy.min-train-nodes": "FedAvg's minimum sample per round; -1 = `strategy.min-nodes`",
    "strategy.min-available-nodes": "FedAvg's minimum of connected nodes; -1 = "
    "`strategy.min-nodes`",
    "strategy.secagg": "train rounds under Flower's SecAgg+ (the server sees only the mean); "
    'needs `strategy.weighting = "uniform"` or `strategy.max-weight-ratio = 0`; privacy.md, '
    '"Secure aggregation"',
    "strategy.secagg-num-shares": "SecAgg+ shares per node (<= 1: a fraction of the nodes, "
    "> 1: a count)",
    "strategy.secagg-reconstruction-threshold": "SecAgg+ shares needed to unmask a dropped node "
    "(<= 1: a fraction, > 1: a count)",
    "strategy.secagg-clipping-range": "SecAgg+ clips each pseudo-gradient entry to +- this",
    "strategy.secagg-quantization-range": "SecAgg+ quantisation levels per entry (step 2 x "
    "clipping range / levels)",
    "strategy.secagg-max-weight": "SecAgg+'s largest reply weight (0 = 1 with uniform "
    "weighting, else local-steps x batch-size x seq-len)",
    "strategy.fraction-train": "fraction of the connected nodes sampled each round",
    "strategy.max-update-norm": "drop a reply whose pseudo-gradient L2 norm is above this "
    "(0 = off)",
    "strategy.max-norm-ratio": "drop a reply above this multiple of the other replies' median "
    "norm (0 = off)",
    "strategy.max-weight-ratio": "clip each reply's weight to this multiple of the median weight "
    "(0 = off; strategies.md threat model)",
    "strategy.max-empty-rounds": "end the run (status `failed`) after this many consecutive "
    "rounds that used no reply (0 = never)",
    "strategy.weighting": "`examples`: a reply weighs its `num-examples`; `uniform`: 1 each",
    "strategy.payload": "what replies hold: `weights` (the trained model, as FedAvg) or "
    "`delta` (the pseudo-gradient)",
    "strategy.dtype-policy": "a reply array of another float dtype is cast (`cast`) or the reply "
    "dropped (`reject`)",
    "strategy.prune-fraction": "TIES: fraction of each pseudo-gradient's entries pruned "
    "(-1 = the rule's default, 0.1)",
    "strategy.drop-rate": "DARE: fraction of entries dropped (-1 = the rule's default, 0.1)",
    "strategy.common-fraction": "Iso-CTS: share of each matrix's rank given to the common "
    "subspace (-1 = the rule's default, 0.8)",
    "strategy.ns-steps": "`iso_c_ns`: Newton-Schulz steps (-1 = adaptive, the rule's default)",
    "strategy.spectral-pattern": "regex of the 2-D tensor names the spectral rules change, the "
    "others take the mean (empty = every 2-D tensor)",
    "strategy.upload-codec": "compress the workers' uploads: `none` or a codec of "
    "docs/compression.md (`int8`, `fp8`, `topk`, `int4`, `sparseloco`)",
    "strategy.download-codec": "compress the server's downloads to an update of the broadcast "
    "model (server-side error feedback; `none` = the full model each round; `exact` = the "
    "step as the round's sparse uploads, with merge `mean` / `sparseloco` and outer momentum "
    "0; docs/compression.md)",
    "strategy.download-nodes-hold-initial": "with a download codec: every node builds the "
    "initial model itself (same seed / checkpoint), so round 1 sends no arrays",
    "strategy.codec-block-size": "entries per fp32 scale (int8, fp8, top-k with int8 values)",
    "strategy.codec-fraction": "top-k: fraction of each tensor's entries sent",
    "strategy.codec-values": "top-k values: `fp32` or `int8`",
    "strategy.codec-min-dims": "tensors with fewer dimensions travel as fp32",
    "strategy.codec-chunk": "sparseloco: entries per chunk, a square (64 x 64 tiles for 2-D)",
    "strategy.codec-k": "sparseloco: entries sent per chunk (<= codec-chunk; a smaller tile "
    "keeps the same share)",
    "strategy.codec-bits": "sparseloco: bits per sent value, 2 or 4 (lookup table of bin means)",
    "strategy.codec-ef-decay": "error feedback decay beta of `e <- beta e + delta - sent` "
    "(-1 = the codec's default: 0.95 sparseloco, 1.0 the others)",
    "strategy.error-feedback": "workers carry what compression lost into their next upload",
    "strategy.on-divergence": "divergence guard: a round whose val loss is non-finite or jumps "
    "is logged (`warn`), undone (`skip`) or ends the run `failed` (`stop`); strategies.md, "
    '"Divergence guard"',
    "strategy.divergence-factor": "a val loss above this x the previous round's is a divergence "
    "(0 = non-finite only)",
    "strategy.quorum": "close a round once this many replies are in: a fraction in (0, 1] of the "
    "nodes it was sent to, rounded up, or a count (> 1); 1.0 = all; also lets a round start "
    "without a site that is down",
    "strategy.grace-s": "once the quorum is in, wait at most this many seconds for the rest "
    "(`round-timeout` stays the cap); later replies are discarded",
    "strategy.merge-device": "where the server merge and the server's validation compute: `auto` "
    "(CUDA if the server sees one, else the CPU), `cpu`, `cuda`, `cuda:<index>`; resolved by the "
    "ServerApp only (nodes check its spelling)",
    "strategy.buffers": "tensors merged as FedAvg does, outside the outer step (BatchNorm "
    "running statistics): `auto`, `none` or a regex of names",
    "strategy.dp-noise-multiplier": "differential privacy: noise std as a multiple of the "
    "clipping norm (0 = off); privacy.md",
    "strategy.dp-clipping-norm": "differential privacy: clip each site's update to this L2 norm "
    "(0 = off); epsilon per round is `results.json`'s `dp-epsilon`",
    "strategy.dp-delta": "the delta at which epsilon is reported",
    "strategy.dp-max-epsilon": "end the run (status `failed`) before a round that would pass "
    "this epsilon (0 = no cap)",
    "strategy.dp-mode": "`central`: the server clips and adds the noise; `local`: each node does "
    "before uploading",
    "strategy.dp-adaptive-quantile": "adaptive clipping: the clipping norm follows this quantile "
    'of the update norms (0 = a fixed norm); privacy.md, "Adaptive clipping"',
    "strategy.dp-clip-lr": "adaptive clipping: the step of the norm's geometric update",
    "strategy.dp-clip-count-std": "adaptive clipping: noise std of the released unclipped count "
    "(required with adaptive clipping, > noise multiplier / 2)",
    "strategy.robust": "robust aggregation before the merge rule and outer step: `none`, "
    "`median`, `trimmed-mean`, `krum`, `multikrum`, `norm-clip`, `distance-filter`",
    "strategy.robust-trim": "`trimmed-mean`: fraction trimmed at each end, in [0, 0.5) (-1 = 0.25)",
    "strategy.robust-f": "`krum` / `multikrum`: attackers assumed (-1 = from the round's number "
    "of replies)",
    "strategy.robust-select": "`multikrum`: updates kept (-1 = from the round's number of replies)",
    "strategy.robust-factor": "`distance-filter`: drop updates farther than this x the median "
    "distance (-1 = 2.0)",
    "strategy.asynchronous": "asynchronous rounds: each node gets new work as soon as its reply "
    "is in, a round is one outer step of `strategy.async-replies-per-step` replies "
    "(docs/strategies.md)",
    "strategy.async-replies-per-step": "asynchronous rounds: accepted replies per outer step "
    "(K, FedBuff's buffer size; 0 = the number of nodes training)",
    "strategy.max-staleness": "asynchronous rounds: drop a reply trained from a model more than "
    "this many outer steps old",
    "strategy.async-staleness": "asynchronous rounds: a reply `tau` steps old weighs "
    "`(1 + tau)^-a` (0 = no discount, 0.5 = FedBuff's)",
    "strategy.momentum-every": "asynchronous rounds: the outer momentum moves once every this "
    "many outer steps, plain steps in between (delayed Nesterov)",
    "strategy.async-hold": "asynchronous rounds: a node whose reply is in waits for the step's "
    "new model if the step is predicted to close within this fraction of its task time (0 = "
    "never wait; equal speeds then cost nothing)",
    "train.local-steps": "H, inner AdamW steps per round",
    "train.lr": "peak inner learning rate",
    "train.warmup-steps": "linear warm-up in inner steps; at most `num-server-rounds` x "
    "`train.local-steps`",
    "train.min-lr-ratio": "floor of the cosine schedule, as a fraction of `train.lr`",
    "train.weight-decay": "AdamW weight decay",
    "train.clip-norm": "gradient clipping norm (0 = off)",
    "train.batch-size": "sequences per inner step",
    "train.seq-len": "tokens per sequence (a pretrained model's `max_position_embeddings` must be "
    "at least this)",
    "train.micro-batch": "rows per forward/backward piece, gradients accumulated (0 = the whole "
    "batch; less activation memory)",
    "train.gradient-checkpointing": "recompute activations in the backward pass "
    "(`gradient_checkpointing_enable()`)",
    "train.device": "where each node trains: `auto` (the GPU its process sees, else the CPU; in a "
    "simulation a node sees a GPU only with `client-resources-num-gpus` > 0), `cpu`, `cuda`, "
    "`cuda:<index>`; `cuda` on a node without a visible GPU is refused with the fix",
    "train.precision": "`fp32`, `bf16` or `fp16`: the forward and loss under autocast, the "
    "weights, gradients, AdamW moments and pseudo-gradient in fp32 (fp16: with a gradient "
    "scaler); `bf16` also runs on the CPU",
    "train.compile": "`torch.compile` the model once per node process, reused across rounds",
    "train.time-budget-s": "speed-scaled local steps: each node runs inner steps until this many "
    "seconds are spent (at least 1, at most `train.local-steps`) and is weighted by the tokens "
    "it trained; the step count depends on wall time (0 = off: every node runs all steps)",
    "train.slowdown-spread": "emulated unequal sites (studies on one machine): node `p` of `N` "
    "runs `1 + (s - 1) p / (N - 1)` times slower, each inner step padded with a sleep (a node's "
    "`node_config` key `slowdown` overrides its factor; 1 = off)",
    "train.emulated-step-s": "with emulated speeds: every inner step padded to its node's factor "
    "x this many seconds, so a shared machine's load does not change the speeds (0 = pad by the "
    "factor x the step's own compute)",
    "model.hidden": "built-in LLaMA: hidden size",
    "model.layers": "built-in LLaMA: decoder layers",
    "model.heads": "built-in LLaMA: attention heads",
    "model.kv-heads": "grouped-query attention heads (0 = `model.heads`)",
    "model.intermediate": "MLP width (0 = LLaMA's rule: 8/3 x hidden, rounded up to 8)",
    "model.vocab-size": "byte-level BPE vocabulary size",
    "model.name-or-path": "a pretrained causal LM instead of the built-in one: a local Hugging "
    "Face folder, a `.gguf` file, `smollm2` or a Hub name (empty = the built-in LLaMA)",
    "model.gguf-file": "the GGUF file name inside the folder `model.name-or-path`",
    "model.tokenizer": "another tokenizer (folder or Hub name); empty = the model's own",
    "model.dtype": "dtype a pretrained model trains in: `float32`, `bfloat16`, `float16` (bf16 "
    "travels as fp32)",
    "data.corpus": "`shakespeare`, an absolute path to a `.txt`/`.md` file or folder, or a "
    "Hugging Face Hub data set with a `text` column (needs the network)",
    "data.val-fraction": "held-out tail of the text (the validation split)",
    "data.val-tokens": "validation tokens evaluated each round",
    "data.cache-dir": "tokenizer and token cache (empty: `$FLWR_ISOLOCO_CACHE` or "
    "`~/.cache/flwr_isoloco`)",
}
