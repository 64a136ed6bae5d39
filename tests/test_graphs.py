"""Graphs, transition matrices and the seeded random walk (flwr_isoloco.graphs)."""

import json
import warnings

import networkx as nx
import numpy as np
import pytest

from flwr_isoloco.graphs import (
    PeriodicWalkWarning,
    RandomWalk,
    build_graph,
    metropolis_mixing_weights,
    restrict_target,
    spectral_gap,
    stationary_distribution,
    subgraph_transition,
    total_variation,
    transition_matrix,
    vertex_list,
)

# ------------------------------------------------------------------ build_graph


@pytest.mark.parametrize(
    "spec, edges",
    [("complete", 28), ("ring", 8), ("star", 7), ("random_regular:d=3", 12)],
)
def test_named_graphs_have_the_right_shape(spec, edges):
    G = build_graph(spec, n=8, seed=3)
    assert vertex_list(G) == list(range(8))
    assert G.number_of_edges() == edges
    assert nx.is_connected(G)


def test_star_centre_is_zero_and_ring_is_a_cycle():
    assert dict(build_graph("star", n=5).degree) == {0: 4, 1: 1, 2: 1, 3: 1, 4: 1}
    assert all(d == 2 for _, d in build_graph("ring", n=6).degree)


def test_erdos_renyi_is_seeded_and_connected():
    a = build_graph("erdos_renyi:p=0.3", n=10, seed=7)
    b = build_graph("erdos_renyi:p=0.3", n=10, seed=7)
    c = build_graph("erdos_renyi:p=0.3", n=10, seed=8)
    assert sorted(a.edges) == sorted(b.edges)
    assert sorted(a.edges) != sorted(c.edges)
    assert nx.is_connected(a) and nx.is_connected(c)


def test_inline_edge_list_file_and_graph_object(tmp_path):
    G = build_graph("0-1, 1-2,2-0")
    assert sorted(G.edges) == [(0, 1), (0, 2), (1, 2)]
    f = tmp_path / "edges.txt"
    f.write_text("# a path\n0 1\n1-2\n\n2 3  # tail\n")
    H = build_graph(str(f), n=4)
    assert sorted(H.edges) == [(0, 1), (1, 2), (2, 3)]
    assert sorted(build_graph(f).edges) == sorted(H.edges)  # a Path object works too
    K = build_graph(nx.path_graph(3))
    assert sorted(K.edges) == [(0, 1), (1, 2)]
    S = build_graph("siteA-siteB,siteB-siteC")
    assert vertex_list(S) == ["siteA", "siteB", "siteC"]


@pytest.mark.parametrize(
    "spec, n, match",
    [
        ("0-1,2-3", None, "disconnected"),
        ("0-1,1-5", 3, "unknown vertex 5"),
        ("0-1,1-2", 4, "vertex 3 has no edge"),
        ("0-1,1-1", None, "self-loop"),
        ("hypercube", 4, "unknown graph spec"),
        ("erdos_renyi", 4, "missing parameter"),
        ("erdos_renyi:p=abc", 4, "not a float"),
        ("erdos_renyi:p=1.5", 4, "0 < p <= 1"),
        ("random_regular:d=3", 5, "n\\*d even"),
        ("ring", None, "needs the number of vertices"),
        ("ring", 2, "n >= 3"),
        ("no/such/file.txt", None, "does not exist"),
    ],
)
def test_bad_graph_specs_raise_naming_the_problem(spec, n, match):
    with pytest.raises(ValueError, match=match):
        build_graph(spec, n=n, seed=0)


def test_bad_graph_objects_raise():
    with pytest.raises(ValueError, match="undirected"):
        build_graph(nx.DiGraph([(0, 1)]))
    with pytest.raises(ValueError, match="disconnected"):
        build_graph(nx.Graph([(0, 1), (2, 3)]))
    with pytest.raises(ValueError, match="int or a str"):
        build_graph(nx.Graph([((0, 1), 2)]))


# ------------------------------------------------------------------ matrices


def test_metropolis_matrix_against_hand_computation():
    # path 0-1-2 plus edge 1-3: degrees d = [1, 3, 1, 1], target pi ∝ [1, 2, 3, 4]
    G = nx.Graph([(0, 1), (1, 2), (1, 3)])
    pi = np.array([1, 2, 3, 4]) / 10
    P = transition_matrix(G, "metropolis", target=[1, 2, 3, 4])
    # P_ij = (1/d_i) min(1, d_i pi_j / (d_j pi_i)), worked out by hand:
    # 0->1: min(1, 1*.2/(3*.1)) = 2/3      1->0: (1/3) min(1, 3*.1/(1*.2)) = 1/3
    # 1->2: (1/3) min(1, 3*.3/.2) = 1/3    2->1: min(1, .2/(3*.3)) = 2/9
    # 1->3: (1/3) min(1, 3*.4/.2) = 1/3    3->1: min(1, .2/(3*.4)) = 1/6
    want = np.array(
        [
            [1 / 3, 2 / 3, 0, 0],
            [1 / 3, 0, 1 / 3, 1 / 3],
            [0, 2 / 9, 7 / 9, 0],
            [0, 1 / 6, 0, 5 / 6],
        ]
    )
    np.testing.assert_allclose(P, want, atol=1e-15)
    np.testing.assert_allclose(stationary_distribution(P), pi, atol=1e-12)
    # detailed balance pi_i P_ij = pi_j P_ji
    np.testing.assert_allclose(pi[:, None] * P, (pi[:, None] * P).T, atol=1e-15)
    # dict weights name vertices; lazy halves the off-diagonal
    Pd = transition_matrix(G, "metropolis", target={0: 1, 1: 2, 2: 3, 3: 4}, lazy=True)
    np.testing.assert_allclose(Pd, 0.5 * (np.eye(4) + want), atol=1e-15)


def test_simple_walk_is_uniform_over_neighbours_with_degree_stationary():
    G = build_graph("star", n=5)
    with pytest.warns(PeriodicWalkWarning):
        P = transition_matrix(G, "simple")
    assert P[0].tolist() == [0, 0.25, 0.25, 0.25, 0.25]
    assert P[3].tolist() == [1, 0, 0, 0, 0]
    np.testing.assert_allclose(stationary_distribution(P), [0.5, 0.125, 0.125, 0.125, 0.125])
    assert spectral_gap(P) == pytest.approx(0.0, abs=1e-12)  # periodic: never mixes


def test_periodic_warning_only_for_bipartite_non_lazy():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transition_matrix(build_graph("ring", n=5), "simple")  # odd ring: aperiodic
        transition_matrix(build_graph("ring", n=6), "simple", lazy=True)
        transition_matrix(build_graph("complete", n=4), "metropolis")
    with pytest.warns(PeriodicWalkWarning):
        transition_matrix(build_graph("ring", n=6), "metropolis")


def test_bad_transition_inputs():
    G = build_graph("ring", n=4)
    with pytest.raises(ValueError, match="unknown transition kind"):
        transition_matrix(G, "uniform")
    with pytest.raises(ValueError, match="vertex 2 has weight 0"):
        transition_matrix(G, "metropolis", target=[1, 1, 0, 1])
    with pytest.raises(ValueError, match="vertex 1 has weight nan"):
        transition_matrix(G, "metropolis", target=[1, float("nan"), 1, 1])
    with pytest.raises(ValueError, match="3 values for 4 vertices"):
        transition_matrix(G, "metropolis", target=[1, 1, 1])
    with pytest.raises(ValueError, match="unknown vertex 9"):
        transition_matrix(G, "metropolis", target={0: 1, 1: 1, 2: 1, 3: 1, 9: 1})
    with pytest.raises(ValueError, match="no weight for vertex 3"):
        transition_matrix(G, "metropolis", target={0: 1, 1: 1, 2: 1})
    with pytest.raises(ValueError, match="kind='metropolis'"):
        transition_matrix(G, "simple", target=[1, 1, 1, 1])
    with pytest.raises(ValueError, match="disconnected"):
        transition_matrix(nx.Graph([(0, 1), (2, 3)]))


def test_spectral_gap_matches_closed_forms():
    # complete graph K_n, simple walk: eigenvalues 1 and -1/(n-1) -> gap 1 - 1/(n-1)
    assert spectral_gap(transition_matrix(build_graph("complete", n=8))) == pytest.approx(6 / 7)
    # lazy ring C_n: eigenvalues (1 + cos(2 pi k / n))/2 -> gap (1 - cos(2 pi / n))/2
    P = transition_matrix(build_graph("ring", n=8), lazy=True)
    assert spectral_gap(P) == pytest.approx((1 - np.cos(2 * np.pi / 8)) / 2)


def test_metropolis_mixing_weights_against_hand_computation():
    # star centre 0 with 3 leaves: W_0j = 1/(1+3) = 1/4, W_00 = 1 - 3/4 = 1/4, W_jj = 3/4
    W = metropolis_mixing_weights(build_graph("star", n=4))
    want = np.array(
        [[0.25, 0.25, 0.25, 0.25], [0.25, 0.75, 0, 0], [0.25, 0, 0.75, 0], [0.25, 0, 0, 0.75]]
    )
    np.testing.assert_allclose(W, want, atol=1e-15)
    W = metropolis_mixing_weights(nx.Graph([(0, 1), (1, 2), (1, 3), (2, 3)]))
    # d = [1, 3, 2, 2]: W01 = 1/4, W12 = W13 = 1/4, W23 = 1/3
    assert W[0, 1] == 0.25 and W[1, 2] == 0.25 and W[2, 3] == pytest.approx(1 / 3)
    np.testing.assert_allclose(np.diag(W), [0.75, 0.25, 1 - 0.25 - 1 / 3, 1 - 0.25 - 1 / 3])
    np.testing.assert_allclose(W, W.T)
    np.testing.assert_allclose(W.sum(axis=0), 1.0)


def test_total_variation():
    assert total_variation([1, 1, 2], [0.25, 0.25, 0.5]) == 0.0
    assert total_variation([1, 0], [0, 1]) == 1.0
    assert total_variation([3, 1], [0.5, 0.5]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="2 frequencies vs 3"):
        total_variation([1, 1], [0.3, 0.3, 0.4])


# ------------------------------------------------------------------ random walk


def _walk(spec, n, lazy, steps=20_000, seed=0, kind="metropolis"):
    G = build_graph(spec, n=n, seed=seed)
    P = transition_matrix(G, kind, lazy=lazy)
    walk = RandomWalk(P, vertex_list(G), seed=seed)
    path = [walk.step() for _ in range(steps)]
    return G, P, path


@pytest.mark.parametrize(
    "spec, n, lazy",
    [("ring", 8, True), ("ring", 7, False), ("star", 8, True), ("complete", 6, True)],
)
def test_walk_moves_only_along_edges_or_stays_when_lazy(spec, n, lazy):
    G, P, path = _walk(spec, n, lazy, steps=3000)
    stays = 0
    for a, b in zip(path, path[1:], strict=False):
        if a == b:
            stays += 1
            assert P[a, a] > 0
        else:
            assert G.has_edge(a, b), (a, b)
    if spec == "ring" and not lazy:
        assert stays == 0  # simple-weight Metropolis on a regular graph has no self-loop
    if lazy:
        # a lazy walk stays with probability >= 1/2 each step: 3000 steps, binomial sd ~27
        assert stays > 0.5 * 3000 - 5 * 28


# TV bound: with T = 20k steps each visit frequency has std about sqrt(pi (1 - pi) tau / T),
# tau ~ 2/gap the integrated autocorrelation time. Measured max TV over seeds 0..9 (mean):
# ring-8 lazy 0.036 (0.022), ring-7 0.011 (0.006), star-8 lazy 0.049 (0.033), ER(10, 0.3)
# 0.029 (0.017), lazy ER 0.050 (0.024). The bounds are ~3x those maxima, while a wrong
# stationary law fails clearly (lazy simple walk on star-8 vs uniform: TV 0.37).
@pytest.mark.parametrize(
    "spec, n, lazy, bound",
    [
        ("ring", 8, True, 0.12),
        ("ring", 7, False, 0.05),
        ("star", 8, True, 0.15),
        ("erdos_renyi:p=0.3", 10, False, 0.10),
        ("erdos_renyi:p=0.3", 10, True, 0.15),
    ],
)
def test_visit_frequencies_converge_to_stationary(spec, n, lazy, bound):
    G, P, path = _walk(spec, n, lazy, steps=20_000, seed=1)
    counts = np.bincount(path, minlength=n)
    pi = stationary_distribution(P)
    np.testing.assert_allclose(pi, 1 / n, atol=1e-9)  # Metropolis, uniform target
    assert total_variation(counts, pi) < bound


def test_visit_frequencies_follow_data_size_target():
    G = build_graph("erdos_renyi:p=0.4", n=6, seed=2)
    sizes = [100, 200, 300, 400, 500, 600]
    P = transition_matrix(G, "metropolis", target=sizes, lazy=True)
    walk = RandomWalk(P, seed=3)
    counts = np.bincount([walk.step() for _ in range(20_000)], minlength=6)
    pi = np.array(sizes) / sum(sizes)
    np.testing.assert_allclose(stationary_distribution(P), pi, atol=1e-12)
    assert total_variation(counts, pi) < 0.08
    # the uniform law is far away from these counts: the test can fail
    assert total_variation(counts, np.full(6, 1 / 6)) > 0.15


def test_periodic_walk_does_not_mix_but_lazy_does():
    with pytest.warns(PeriodicWalkWarning):
        _, _, path = _walk("ring", 8, lazy=False, steps=2000, kind="simple")
    parities = {(v + t) % 2 for t, v in enumerate(path)}
    assert len(parities) == 1  # strictly alternates sides


def test_exclusion_reroutes_renormalised_and_none_when_stuck():
    G = build_graph("star", n=4)
    P = transition_matrix(G, "simple", lazy=True)  # centre row: 1/2 stay, 1/6 each leaf
    walk = RandomWalk(P, seed=0, start=0)
    draws = [walk.draw(exclude=[0, 1]) for _ in range(3000)]
    assert set(draws) == {2, 3}
    assert abs(draws.count(2) / 3000 - 0.5) < 0.05
    assert walk.position == 0  # draw does not move
    leaf = RandomWalk(P, seed=0, start=2)
    assert leaf.draw(exclude=[0, 2]) is None
    with pytest.raises(ValueError, match="not an edge"):
        leaf.move_to(3)
    with pytest.raises(ValueError, match="unknown vertex 9"):
        leaf.draw(exclude=[9])


def test_first_step_follows_initial_distribution():
    P = transition_matrix(build_graph("star", n=4), lazy=True)  # pi = [1/2, 1/6, 1/6, 1/6]
    pi = stationary_distribution(P)
    np.testing.assert_allclose(RandomWalk(P).initial, pi)  # the default initial law
    firsts = [RandomWalk(P, seed=s, initial=pi).step() for s in range(2000)]
    assert total_variation(np.bincount(firsts, minlength=4), pi) < 0.05
    fixed = RandomWalk(P, seed=0, initial=[0, 0, 1, 0])
    assert fixed.step() == 2


def test_walk_state_dict_resumes_exactly_and_is_json():
    G = build_graph("erdos_renyi:p=0.3", n=9, seed=4)
    P = transition_matrix(G, "metropolis", lazy=True)
    a = RandomWalk(P, vertex_list(G), seed=11)
    first = [a.step() for _ in range(50)]
    state = json.loads(json.dumps(a.state_dict()))
    rest = [a.step(exclude=[3]) for _ in range(50)]
    b = RandomWalk(P, vertex_list(G), seed=999)
    b.load_state_dict(state)
    assert b.position == first[-1]
    assert [b.step(exclude=[3]) for _ in range(50)] == rest
    with pytest.raises(ValueError, match="bad state"):
        b.load_state_dict({"position": 1})
    with pytest.raises(ValueError, match="unknown vertex 42"):
        b.load_state_dict({**state, "position": 42})


def test_string_vertices_walk():
    G = build_graph("a-b,b-c,c-a")
    P = transition_matrix(G, lazy=True)
    walk = RandomWalk(P, vertex_list(G), seed=0)
    assert {walk.step() for _ in range(100)} == {"a", "b", "c"}


def test_rerouting_around_a_dead_vertex_follows_the_renormalised_chain():
    """docs/rwlora.md: skipping a dead vertex = renormalising its neighbours' rows, whose
    stationary law under-weights those neighbours (lazy 8-ring, vertex 3 dead: exactly
    1.5/13 = 0.115 for vertices 2 and 4, 2/13 = 0.154 for the others)."""
    P = transition_matrix(build_graph("ring", n=8), "metropolis", lazy=True)
    Q = np.delete(np.delete(P, 3, 0), 3, 1)
    Q = Q / Q.sum(axis=1, keepdims=True)
    exact = stationary_distribution(Q)
    np.testing.assert_allclose(exact, np.array([2, 2, 1.5, 1.5, 2, 2, 2]) / 13, atol=1e-12)
    walk = RandomWalk(P, seed=0, start=0)
    counts = np.bincount([walk.step(exclude=[3]) for _ in range(30_000)], minlength=8)
    assert counts[3] == 0
    # measured over seeds 0..7 with 40k steps: TV 0.009-0.014; neighbour mean 0.112-0.119
    assert total_variation(np.delete(counts, 3), exact) < 0.05
    f = counts / counts.sum()
    assert (f[2] + f[4]) / 2 < 0.13 < 0.145 < np.delete(f, [2, 3, 4]).mean()


# ------------------------------------------------------------------ sub-graph transition


@pytest.mark.parametrize("as_mapping", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("drop", [(), (0,), (2, 5), (1, 3, 6)])
def test_subgraph_transition_has_the_restricted_target_as_stationary_law(drop, lazy, as_mapping):
    """Rows sum to 1, entries >= 0, zero off the sub-graph's edges; pi(P) = target|_S / target(S)."""
    G = build_graph("complete", n=8)
    G.remove_edges_from([(0, 1), (2, 3), (4, 7), (5, 6)])  # not regular: Metropolis matters
    w = np.random.default_rng(7).uniform(0.5, 5.0, size=8)
    target = {v: float(w[v]) for v in G.nodes} if as_mapping else list(w)
    keep = [v for v in vertex_list(G) if v not in drop]
    P = subgraph_transition(G, keep, "metropolis", target, lazy=lazy)
    assert P.shape == (len(keep), len(keep)) and (P >= 0).all()
    np.testing.assert_allclose(P.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    S = G.subgraph(keep)
    for i, u in enumerate(keep):
        for j, v in enumerate(keep):
            if i != j and not S.has_edge(u, v):
                assert P[i, j] == 0.0
    want = w[keep] / w[keep].sum()
    np.testing.assert_allclose(stationary_distribution(P), want, rtol=1e-9, atol=0)
    assert not np.allclose(want, 1 / len(keep))  # the test can tell a uniform law apart


def test_subgraph_transition_of_the_whole_graph_is_transition_matrix():
    G = build_graph("erdos_renyi:p=0.5", n=7, seed=3)
    t = [1, 2, 3, 4, 5, 6, 7]
    assert np.array_equal(
        subgraph_transition(G, G.nodes, "metropolis", t), transition_matrix(G, "metropolis", t)
    )
    P = subgraph_transition(G, [0, 1, 2, 3, 4, 5, 6], "simple")  # pi ∝ degree
    deg = np.array([G.degree(v) for v in vertex_list(G)], float)
    np.testing.assert_allclose(stationary_distribution(P), deg / deg.sum(), rtol=1e-9)


def test_restrict_target_keeps_weights_and_checks_the_whole_target():
    G = build_graph("ring", n=4)
    assert restrict_target(G, None, [0, 1]) is None
    assert restrict_target(G, [1, 2, 3, 4], [3, 1]) == {1: 2.0, 3: 4.0}
    assert restrict_target(G, {0: 1, 1: 2, 2: 3, 3: 4}, [2]) == {2: 3}
    with pytest.raises(ValueError, match="3 values for 4 vertices"):
        restrict_target(G, [1, 2, 3], [0])
    with pytest.raises(ValueError, match="unknown vertex 9"):
        restrict_target(G, {0: 1, 1: 1, 2: 1, 3: 1, 9: 1}, [0])
    with pytest.raises(ValueError, match="vertex 3 has weight 0"):
        restrict_target(G, [1, 1, 1, 0], [0, 1])  # a dropped vertex's weight is checked too
    with pytest.raises(ValueError, match="disconnected"):
        subgraph_transition(G, [0, 2])
