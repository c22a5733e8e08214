"""The autoscaling load report's demand: tokens arriving a second over a sliding window, bounded by it."""

from engine.request_times import ArrivalRate


def test_the_rate_counts_the_windows_arrivals_only():
    rate = ArrivalRate(10.0)
    rate.add(500, now=0.0)
    rate.add(1500, now=4.0)
    assert rate.per_s(now=5.0) == 200.0  # 2,000 tokens over 10 s
    assert rate.per_s(now=12.0) == 150.0  # the first left the window
    assert rate.per_s(now=30.0) == 0.0


def test_arrivals_nobody_reads_do_not_pile_up():
    """A fixed fleet's engine never reports its load: adding alone must keep only the window's arrivals."""
    rate = ArrivalRate(10.0)
    for i in range(10_000):
        rate.add(1, now=float(i))  # one a second for almost three hours
    assert len(rate) == 11
    assert rate.per_s(now=9_999.0) == 1.1
