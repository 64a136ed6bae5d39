"""The one median-ratio outlier test of an update norm (merging.weights.norm_outlier).

Every strategy drops a reply through it: DiLoCo/IsoLoCo's validator and gossip against the
other replies of the round, RW-LoRA against its last accepted updates. The reasons are part of
the log and of RW-LoRA's failure log, so their texts are pinned here.
"""

import pytest

from flwr_isoloco.merging.weights import norm_outlier


def test_reason_text_against_the_others():
    # median of (1, 2, 4) is 2; 10 > 4 x 2
    assert norm_outlier(10.0, [1.0, 2.0, 4.0], 4.0) == (
        "update norm 10 > max_norm_ratio 4 x median of the others 2"
    )


def test_reason_text_against_recent_updates():
    recent = [1.0, 3.0, 2.0, 2.5]
    why = norm_outlier(
        123.456, recent, 10.0, min_reference=3, reference="the last 4 accepted updates"
    )
    assert why == (
        "update norm 123.5 > max_norm_ratio 10 x median of the last 4 accepted updates 2.25"
    )


@pytest.mark.parametrize(
    ("norm", "refs", "ratio", "outlier"),
    [
        (8.0, [1.0, 2.0, 3.0], 4.0, False),  # exactly r x median: kept (strict >)
        (8.000001, [1.0, 2.0, 3.0], 4.0, True),
        (1e9, [1.0, 1.0], None, False),  # off
        (1e9, [1.0, 1.0], 0.0, False),  # off
        (0.0, [0.0, 0.0], 1.0, False),  # all-zero round: nothing is an outlier
        (1e-30, [0.0, 0.0, 1.0], 5.0, True),  # median 0: any positive norm is one
    ],
)
def test_threshold_is_ratio_times_median(norm, refs, ratio, outlier):
    assert (norm_outlier(norm, refs, ratio) is not None) is outlier


def test_too_few_reference_norms_means_no_test():
    assert norm_outlier(1e9, [1.0], 2.0) is None  # default min_reference 2
    assert norm_outlier(1e9, [1.0, 1.0], 2.0) is not None
    assert norm_outlier(1e9, [1.0, 1.0], 2.0, min_reference=3) is None
    assert norm_outlier(1e9, [1.0, 1.0, 1.0], 2.0, min_reference=3) is not None
    assert norm_outlier(1e9, (n for n in [1.0, 1.0]), 2.0) is not None  # any iterable
