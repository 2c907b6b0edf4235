"""A batch whose requests all got no drafts rests: the controller is asked again after 1, 2, 4,
... at most REST_MAX steps; drafts chosen, a request joining or leaving, or a lone request end
the rest at once."""

from types import SimpleNamespace

from specdec.engine.speculator import REST_MAX, Speculator


def _speculator() -> Speculator:
    spec = Speculator.__new__(Speculator)  # NOTE: only the rest's own state
    spec._rest_batch, spec._rest_left, spec._rest_len = (), 0, 0
    return spec


def _reqs(*ids: str) -> list:
    return [SimpleNamespace(req_id=i) for i in ids]


def _asked(spec: Speculator, reqs: list, steps: int, drafted: bool = False) -> list[int]:
    """The steps (of ``steps``) at which the controller was asked."""
    asked = []
    for step in range(steps):
        if not spec._resting(reqs):
            asked.append(step)
            spec._rest_after(reqs, drafted)
    return asked


def test_an_idle_batch_is_asked_ever_less_often_up_to_the_cap() -> None:
    spec, batch = _speculator(), _reqs("a", "b", "c")
    asked = _asked(spec, batch, 60)
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:4] == [2, 3, 5, 9] and set(gaps[4:]) == {REST_MAX + 1}


def test_drafts_a_new_batch_or_a_lone_request_end_the_rest() -> None:
    spec, batch = _speculator(), _reqs("a", "b")
    _asked(spec, batch, 30)  # resting now
    assert spec._rest_len == REST_MAX
    asked = _asked(spec, batch, 20, drafted=True)  # the drafts chosen at the next asking
    assert asked[0] <= REST_MAX and asked == list(range(asked[0], 20))  # then every step
    _asked(spec, batch, 30)  # resting again
    assert _asked(spec, _reqs("a", "b", "c"), 1) == [0]  # a request joined: asked at once
    assert _asked(spec, _reqs("a"), 4) == [0, 1, 2, 3]  # alone: asked every step
