"""One backoff rule for every retry loop of the engine and the ingress (a group's restart, the stats channel's
ingest, the step loop's pause while nothing moves, a re-sent request, the stats mirror's upstream call): each
loop keeps its own first pause and ceiling, named where it is, and counts its tries in a row."""


def backoff_s(tries: int, first_s: float, max_s: float) -> float:
    """The pause before try `tries` in a row (1, 2, ...): `first_s`, doubling, at most `max_s`."""
    return min(max_s, first_s * 2.0 ** min(max(0, tries - 1), 64))
