"""What the ServerApp logs say each round did with each update (issue 39): the per-round
summary line, the nodes named as dropped or missing, the nodes sent to, and the breaches of the
ledger's rules over a chaos scenario's runs (``chaos_scenario.ChaosRun``)."""

from __future__ import annotations

import re

ROUND_SUMMARY = re.compile(r"\(round (\d+)\): (\d+) replies used, (\d+) rejected, (\d+) missing")
DROPPED = re.compile(r"dropped reply from node (\d+)")
NO_REPLY = re.compile(r"no reply from node (\d+) when the round closed")
SAMPLED = re.compile(r"configure_train: sampled (\d+) nodes")
DUPLICATE = re.compile(r"duplicate reply of node (\d+) for round (\d+)")


def named_losses(log_text: str) -> dict[int, dict]:
    """Per round summary line: the counts it states, the nodes named since the previous
    summary (``dropped reply`` lines for the rejected, ``no reply`` lines for the missing) and
    how many nodes the round was sent to (``configure_train: sampled N nodes``)."""
    out: dict[int, dict] = {}
    dropped: list[int] = []
    missing: list[int] = []
    sampled = -1
    for line in log_text.splitlines():
        if m := SAMPLED.search(line):
            sampled = int(m.group(1))
        elif m := DROPPED.search(line):
            dropped.append(int(m.group(1)))
        elif m := NO_REPLY.search(line):
            missing.append(int(m.group(1)))
        elif m := ROUND_SUMMARY.search(line):
            rnd, used, rej, miss = (int(g) for g in m.groups())
            out[rnd] = {
                "used": used,
                "rejected": rej,
                "missing": miss,
                "dropped-nodes": dropped,
                "missing-nodes": missing,
                "sampled": sampled,
            }
            dropped, missing, sampled = [], [], -1
    return out


def account(chaos) -> tuple[dict[int, dict], list[str], list[int]]:
    """The ledger of the final history: per round what the logs name (``named_losses`` over
    every training run's log, a later run's line replacing an earlier one's) and every breach
    of: the summary's counts are results.json's, each rejected / missing update is named once,
    each node sent to is used, rejected or missing exactly once, no duplicate taken. Also the
    rounds with no summary line that are the last round of a run lost with its coordinator:
    the ServerApp ships its log to the SuperLink every few seconds, so a power loss right after
    a round can take that round's lines with it (its counts are in results.json and the
    checkpoint's history); any other round without one is a breach."""
    lost_tails = set(chaos.restored)
    unlogged: list[int] = []
    named: dict[int, dict] = {}
    for text in chaos.training_logs:
        named.update(named_losses(text))
    problems = []
    for row in chaos.final.get("rounds", []):
        r, n = row["round"], named.get(row["round"])
        if n is None:
            if r in lost_tails:
                unlogged.append(r)
            else:
                problems.append(f"round {r}: no summary line in the logs")
            continue
        counts = (row["replies-used"], row["replies-rejected"], row["replies-missing"])
        if (n["used"], n["rejected"], n["missing"]) != counts:
            problems.append(f"round {r}: log says {n}, results.json {counts}")
        if len(n["dropped-nodes"]) != n["rejected"] or len(n["missing-nodes"]) != n["missing"]:
            problems.append(f"round {r}: {n} names a different number of nodes than it counts")
        nodes = n["dropped-nodes"] + n["missing-nodes"]
        if len(set(nodes)) != len(nodes):
            problems.append(f"round {r}: a node counted twice: {n}")
        if n["used"] + n["rejected"] + n["missing"] != n["sampled"]:
            problems.append(f"round {r}: used + rejected + missing != sent: {n}")
    duplicates = DUPLICATE.findall("\n".join(chaos.training_logs))
    problems += [f"duplicate reply of node {d[0]} for round {d[1]}" for d in duplicates]
    return named, problems, unlogged
