"""flwr_isoloco.graphs.walk: the live-graph walk with relays across dead vertices, and the back-off."""

import json

import networkx as nx
import numpy as np
import pytest

from flwr_isoloco.graphs import (
    LiveTransitions,
    RandomWalk,
    VertexHealth,
    build_graph,
    live_transition,
    relay_graph,
    reroute_exclusions,
    stationary_distribution,
    total_variation,
    transition_matrix,
)

# 7 vertices, degrees 4 2 2 2 3 2 1: hub 0 is a cut vertex ({1, 2} | {3, 4, 5, 6}); the simple
# walk gives it d_0 / 2|E| = 4/16 = 25% of the visits where uniform is 1/7 = 14.3%; pendant 6
# hangs on vertex 5 only.
IRREG = "0-1,0-2,0-3,0-4,1-2,3-4,4-5,5-6"


def _visits(P, steps, seed, start):
    walk = RandomWalk(P, seed=seed, start=start)
    path = []
    for _ in range(steps):
        path.append(walk.step())
    return np.bincount(path, minlength=P.shape[0])


def test_metropolis_gives_uniform_visits_where_simple_over_visits_the_hub():
    """Task: the paper's walk. 20k seeded steps: MH hub share 0.138 (TV 0.014 from uniform),
    simple 0.247 (exact 0.25, TV 0.149). Bound 0.04 on the MH TV: ~3x the spread over seeds."""
    G = build_graph(IRREG)
    mh = transition_matrix(G, "metropolis")
    simple = transition_matrix(G, "simple")
    uniform = np.full(7, 1 / 7)
    np.testing.assert_allclose(stationary_distribution(mh), uniform, atol=1e-12)
    assert stationary_distribution(simple)[0] == pytest.approx(0.25)
    c_mh, c_simple = _visits(mh, 20_000, 0, None), _visits(simple, 20_000, 0, None)
    assert total_variation(c_mh, uniform) < 0.04
    assert abs(c_mh[0] / 20_000 - 1 / 7) < 0.02
    assert c_simple[0] / 20_000 > 0.23 and total_variation(c_simple, uniform) > 0.1


def test_relay_graph_joins_the_live_neighbours_of_a_dead_cut_vertex():
    G = build_graph(IRREG)
    H, relays = relay_graph(G, [0])
    assert nx.is_connected(H) and 0 not in H
    assert relays == {frozenset(e) for e in [(1, 3), (1, 4), (2, 3), (2, 4)]}  # 1-2, 3-4 exist
    H, relays = relay_graph(G, [5])  # pendant 6 stranded: relayed to 5's other neighbour 4
    assert relays == {frozenset((4, 6))}
    H, relays = relay_graph(G, [1])  # live graph still connected: no relay at all
    assert relays == set() and set(H.edges) == set(G.subgraph([0, 2, 3, 4, 5, 6]).edges)
    # a chain of dead vertices 1-2-3 on the path 0..4: one relay 0-4 across the component
    H, relays = relay_graph(build_graph("0-1,1-2,2-3,3-4"), [1, 2, 3])
    assert relays == {frozenset((0, 4))}
    with pytest.raises(ValueError, match="every vertex"):
        relay_graph(G, range(7))


def test_stranded_pendant_moves_by_relay_where_the_old_walk_was_stuck():
    G = build_graph(IRREG)
    simple = transition_matrix(G, "simple")
    assert RandomWalk(simple, seed=0, start=6).draw(exclude=[5]) is None  # the bug
    lm = live_transition(G, [5], "simple")
    walk = RandomWalk(lm.P, seed=0, start=6)
    v = walk.step()
    assert v == 4 and lm.is_relay(6, 4) and not lm.is_relay(4, 3)
    assert lm.P[:, 5].sum() == 0  # never enters the dead vertex


@pytest.mark.parametrize("dead", [[0], [5], [1]])
def test_stationary_law_on_the_live_graph_is_the_target_restricted(dead):
    """Exact: pi(P_live) = target restricted to the live vertices, renormalised (uniform and
    data sizes). Seeded: 20k steps, TV 0.005-0.030 over seeds 0..7; bound 0.06 (2x the max),
    while the old renormalised-exclusion walk with the hub dead never leaves one side."""
    G = build_graph(IRREG)
    live = [v for v in range(7) if v not in dead]
    sizes = [5, 1, 2, 3, 4, 6, 7]
    for target in (None, sizes):
        lm = live_transition(G, dead, "metropolis", target)
        want = np.zeros(7)
        want[live] = 1.0 if target is None else np.array(sizes)[live]
        want /= want.sum()
        np.testing.assert_allclose(stationary_distribution(lm.P), want, atol=1e-12)
        np.testing.assert_allclose(lm.pi, want, atol=1e-12)
    lm = live_transition(G, dead, "metropolis")
    counts = _visits(lm.P, 20_000, 1, live[-1])
    assert counts[dead].sum() == 0
    assert total_variation(counts[live], np.full(len(live), 1 / len(live))) < 0.06


def test_dead_hub_for_good_both_sides_still_visited():
    G = build_graph(IRREG)
    walk = RandomWalk(transition_matrix(G, "metropolis"), seed=2, start=6)
    stuck = {walk.step(exclude=[0]) for _ in range(5000)}
    assert stuck <= {3, 4, 5, 6}  # before: renormalising around the hub never crosses it
    lm = live_transition(G, [0], "metropolis")
    walk = RandomWalk(lm.P, seed=2, start=6)
    relays, seen = 0, set()
    for _ in range(5000):
        u = walk.position
        v = walk.step()
        relays += lm.is_relay(u, v)
        seen.add(v)
    assert seen == {1, 2, 3, 4, 5, 6} and relays > 500


def test_dead_row_of_the_token_holder_goes_to_the_live_boundary():
    G = build_graph(IRREG)
    lm = live_transition(G, [0, 1], "metropolis")  # dead component {0, 1}: boundary 2, 3, 4
    row = lm.P[0]
    assert set(np.flatnonzero(row)) == {2, 3, 4} and row.sum() == pytest.approx(1)
    np.testing.assert_allclose(lm.P[1], row)
    assert lm.is_relay(0, 3) and lm.is_relay(1, 2)


def test_no_dead_vertex_is_the_plain_matrix_and_cache_returns_the_same_object():
    G = build_graph("erdos_renyi:p=0.4", n=8, seed=1)
    lt = LiveTransitions(G, "metropolis", None, lazy=True)
    assert np.array_equal(lt.get(()).P, transition_matrix(G, "metropolis", lazy=True))
    assert lt.get([3]) is lt.get({3}) and lt.get([3]) is not lt.get([4])


def test_reroute_exclusions_drop_the_self_loop_and_failed():
    assert reroute_exclusions(2, [5], [7]) == {2, 5, 7}
    assert reroute_exclusions(None, [5]) == {5}


def test_back_off_doubles_up_to_the_cap_and_success_forgives():
    h = VertexHealth(dead_after=2, backoff=3, backoff_max=10)
    assert h.record_failure("a", 1) is None and h.dead(1) == set()
    assert h.record_failure("a", 2) == 3 and h.dead(2) == h.dead(5) == {"a"}
    assert h.dead(6) == set()  # back after 3 rounds
    assert h.record_failure("a", 6) == 6  # one failure on probation: dead again, twice as long
    assert h.dead(12) == {"a"} and h.dead(13) == set()
    assert h.record_failure("a", 13) == 10  # 12 capped at 10
    state = json.loads(json.dumps(h.state_dict()))
    h2 = VertexHealth(2, 3, 10)
    h2.load_state_dict(state, ["a", "b"])
    assert h2.dead(23) == {"a"} and h2.record_failure("a", 24) == 10
    h.record_success("a")
    assert h.dead(14) == set() and h.record_failure("a", 14) is None  # streak reset too
    assert VertexHealth(dead_after=0).record_failure("a", 1) is None  # off
    with pytest.raises(ValueError, match="bad state"):
        h2.load_state_dict({**state, "streak": [["zz", 1]]}, ["a"])
    with pytest.raises(ValueError, match="backoff_max"):
        VertexHealth(2, 8, 4)
    with pytest.raises(ValueError, match="dead_after"):
        VertexHealth(-1)
