"""Tier 1: the routings' expert shares and counts (moe_sim/routing.py), one list the benches
impose and the simulator prices: Zipf's ratio of top to bottom expert and its seed, hot-expert's
arithmetic, the committed replay records, the cap at 1 / top_k, the old name's fix."""
import pytest

from moe_sim.routing import (RECORDED_ROUTINGS, REPOSITORY, check_routing, expert_shares, hot_expert_fraction,
                             load_routing, pair_counts, renamed, routing_load, zipf_shares)

ROUTINGS = ("uniform", "zipf:1.2", "hot-expert", "hot:0.4", "replay:early", "replay:late")


@pytest.mark.parametrize("spec", ROUTINGS)
def test_every_routings_counts_deal_every_pair_once_and_its_load_sums_to_one(spec):
    shares = expert_shares(spec, 64, 2, seed=3)
    assert len(shares) == 64 and sum(shares) == pytest.approx(1.0) and max(shares) <= 0.5 + 1e-12
    counts = pair_counts(shares, 1000, 2)
    assert sum(counts) == 2000 and max(counts) <= 1000 and min(counts) >= 0
    # the simulator prices the shares the counts are dealt from: within one pair per expert
    assert routing_load(spec, 64, 2, seed=3) == shares
    assert all(abs(c - 2000 * s) < 1 for c, s in zip(counts, shares))


def test_zipf_ranks_follow_one_over_rank_to_the_s_and_the_seed_picks_which_expert_holds_each():
    shares = zipf_shares(16, 1.2, seed=0)
    assert max(shares) / min(shares) == pytest.approx(16 ** 1.2)  # rank 1 against rank 16
    ranked = sorted(shares, reverse=True)
    assert all(ranked[r] / ranked[r + 1] == pytest.approx(((r + 2) / (r + 1)) ** 1.2) for r in range(15))
    assert zipf_shares(16, 1.2, seed=0) == shares                 # the same under the same seed
    other = zipf_shares(16, 1.2, seed=1)
    assert other != shares and sorted(other) == pytest.approx(sorted(shares))  # another expert order
    assert zipf_shares(8, 0.0, seed=5) == pytest.approx([1 / 8] * 8)           # zipf:0 is uniform
    # the counts a rank deals: the hottest expert's against the coldest's, near the shares' ratio
    counts = pair_counts(expert_shares("zipf:1.2", 16, 2, seed=0), 8192, 2)
    assert max(counts) / min(counts) == pytest.approx(16 ** 1.2, rel=0.02)
    assert counts == pair_counts(expert_shares("zipf:1.2", 16, 2, seed=0), 8192, 2)


def test_a_share_above_one_over_k_is_capped_and_its_excess_spread():
    shares = expert_shares("zipf:3", 8, 2)  # the top rank asks for 0.83
    assert max(shares) == pytest.approx(0.5) and sum(shares) == pytest.approx(1.0)
    assert pair_counts([0.7, 0.1, 0.1, 0.1], 100, 2) == [100, 34, 33, 33]


def test_hot_expert_puts_half_the_tokens_first_pair_on_expert_zero():
    assert hot_expert_fraction(8, 2) == pytest.approx(1 / 4 + 1 / 16)
    shares = expert_shares("hot-expert", 8, 2)
    assert shares[0] == pytest.approx(0.3125) and shares[1:] == pytest.approx([0.6875 / 7] * 7)
    assert expert_shares("hot:0.4", 4, 2)[0] == pytest.approx(0.4)


def test_replay_early_and_late_are_the_committed_records_of_a_real_run():
    for name, path in RECORDED_ROUTINGS.items():
        record = load_routing(REPOSITORY / path)
        assert record.num_experts == 64 and len(record.layers) == 4
        layer = record.most_imbalanced_layer()
        total = sum(record.layers[layer])
        assert expert_shares(f"replay:{name}", 64, 2) == pytest.approx([c / total for c in record.layers[layer]])
    # early training is the more imbalanced (results/README.md: 9.23 against 4.74)
    early, late = (load_routing(REPOSITORY / RECORDED_ROUTINGS[n]) for n in ("early", "late"))
    assert early.imbalance(early.most_imbalanced_layer()) > late.imbalance(late.most_imbalanced_layer())


def test_names_and_their_errors():
    assert renamed("skewed")[0] == "hot-expert" and "now named hot-expert" in (renamed("skewed")[1] or "")
    assert renamed("zipf:1.2") == ("zipf:1.2", None)
    for spec, message in (("skewed", "is now named hot-expert: give --routing hot-expert"),
                          ("zipf", "is invalid: give zipf:S with S >= 0"), ("hot:2", "0 <= F <= 1"),
                          ("pareto:1", "is unknown: choose from uniform, zipf:S"),
                          ("replay:/nonexistent.json", "no such file")):
        with pytest.raises(ValueError, match=message):
            check_routing(spec)
