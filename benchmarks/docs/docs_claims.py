"""Sentences in README.md and docs/results-lm.md that quote measurements, generated from records.

Each block sits between ``<!-- docs_claims:<name>:begin ... -->`` and
``<!-- docs_claims:<name>:end -->`` and is written from one file of ``benchmarks/results/``:

- ``demo-time`` (README.md) and ``demo-time-lm`` (docs/results-lm.md): the last run in
  ``demo_wall_time.json`` (``benchmarks/docs/demo_wall_time.py``);
- ``bigram`` (README.md): ``swap_fedavg_bigram.json`` (``benchmarks/dropin/swap_fedavg_bigram.py``);
- ``paper-digits`` (README.md): ``sweep`` in ``isoloco_dropin.json``
  (``benchmarks/dropin/isoloco_dropin.py --sweep``).

    .venv/bin/python benchmarks/docs/docs_claims.py            # rewrite the blocks
    .venv/bin/python benchmarks/docs/docs_claims.py --check    # exit 1 if a block is stale

``tests/test_docs_numbers.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = common.REPO
RESULTS = common.RESULTS


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _demo_run() -> dict:
    return _load("demo_wall_time.json")["runs"][-1]


def demo_time() -> str:
    r = _demo_run()
    return (
        f"On a {r['cpus']}-core machine at load average {r['load-avg-1min-before']:.2f} when it "
        f"started it took {r['wall-time-s']:.0f} s end to end "
        f"(`benchmarks/results/demo_wall_time.json`, {r['date'][:10]}); on a machine busy with "
        "other work it takes several times longer (docs/results-lm.md)."
    )


def demo_time_lm() -> str:
    r = _demo_run()
    loaded = _load("lm_experiments.json")["runs"]["isoloco-M4"]["final-val-loss"]
    same = f"{loaded:.3f}" == f"{r['final-val-loss']:.3f}"
    return (
        f"At load average {r['load-avg-1min-before']:.2f} at the start ({r['cpus']} cores, "
        f"{r['date'][:10]}), `bash scripts/demo.sh` took **{r['wall-time-s']:.0f} s** end to end, "
        f"validation loss {r['initial-val-loss']:.3f} -> {r['final-val-loss']:.3f} (perplexity "
        f"{r['final-val-ppl']:.1f}), "
        + (
            "the same final loss as the loaded run"
            if same
            else f"against {loaded:.3f} in the loaded run"
        )
        + " (`benchmarks/results/demo_wall_time.json`, written by `benchmarks/docs/demo_wall_time.py`)."
    )


def bigram() -> str:
    runs = _load("swap_fedavg_bigram.json")["runs"]
    final = {k: v["val-loss"][-1] for k, v in runs.items()}
    start = runs["FedAvg"]["val-loss"][0]
    iso, fed, dil = final["IsoLoCo()"], final["FedAvg"], final["DiLoCo()"]
    behind = iso > min(fed, dil) + 0.1
    return (
        ("It is not as good as the mean everywhere: on" if behind else "On")
        + " a byte-bigram table trained with Adam (`examples/swap-fedavg`, 3 nodes, 3 rounds) "
        f"the validation loss goes from {start:.3f} to {iso:.3f} with `IsoLoCo()`, to {fed:.3f} "
        f"with FedAvg and to {dil:.3f} with `DiLoCo()` "
        "(`benchmarks/results/swap_fedavg_bigram.json`)"
        + ("; use `DiLoCo()` there." if behind else ".")
    )


def paper_digits() -> str:
    sweep = _load("isoloco_dropin.json")["sweep"]
    paper = "IsoLoCo(preset='isoloco-paper')"
    seeds = sorted(sweep["iid"][paper], key=int)

    def cells(part: str, name: str) -> str:
        return " / ".join(f"{sweep[part][name][s]:.3f}" for s in seeds)

    below = sum(
        sweep[p][paper][s] < sweep[p]["FedAvg"][s] for p in ("iid", "dirichlet") for s in seeds
    )
    return (
        "In an app whose nodes train close to their local optimum each round (SGD on the small "
        "CNN of `examples/digits`, 4 nodes, 10 rounds) its final test accuracy is "
        f"{cells('iid', paper)} on IID shards and {cells('dirichlet', paper)} on Dirichlet(0.5) "
        f"shards (seeds {seeds[0]}-{seeds[-1]}), against FedAvg's {cells('iid', 'FedAvg')} and "
        f"{cells('dirichlet', 'FedAvg')}: below FedAvg in {below} of {2 * len(seeds)} runs "
        "(`sweep` in `benchmarks/results/isoloco_dropin.json`)."
    )


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "demo-time": ("README.md", demo_time),
    "bigram": ("README.md", bigram),
    "paper-digits": ("README.md", paper_digits),
    "demo-time-lm": ("docs/results-lm.md", demo_time_lm),
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- docs_claims:{re.escape(name)}:begin[^\n]*-->\n)(.*?)(<!-- docs_claims:{re.escape(name)}:end -->)",
        re.S,
    )


def render(text: str, name: str, body: str) -> str:
    """``text`` with block ``name`` replaced by ``body`` (``ValueError`` if the block is missing)."""
    pat = _pattern(name)
    if not pat.search(text):
        raise ValueError(f"no docs_claims:{name} block")
    return pat.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(3), text, count=1)


def stale() -> list[str]:
    """``file: block`` for every block whose text differs from what its record gives."""
    out = []
    for name, (rel, fn) in BLOCKS.items():
        text = (REPO / rel).read_text()
        if render(text, name, fn()) != text:
            out.append(f"{rel}: {name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = ap.parse_args()
    if args.check:
        bad = stale()
        print("stale: " + ", ".join(bad) if bad else "all docs_claims blocks up to date")
        sys.exit(1 if bad else 0)
    for name, (rel, fn) in BLOCKS.items():
        path = REPO / rel
        text = path.read_text()
        new = render(text, name, fn())
        if new != text:
            path.write_text(new)
            print(f"updated {rel}: {name}")


if __name__ == "__main__":
    main()
