"""Retention policies: which committed steps each policy keeps, unions, argument checks."""

import pytest

from checkpointer._manage._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps

STEPS = [0, 100, 200, 300, 400, 500]


# --- KeepLatest --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, expected",
    [(1, {500}), (2, {400, 500}), (3, {300, 400, 500}), (6, set(STEPS)), (100, set(STEPS))],
)
def test_keep_latest(n, expected):
    assert KeepLatest(n).keep(STEPS, {}) == expected


def test_keep_latest_does_not_rely_on_input_order():
    assert KeepLatest(2).keep([300, 100, 500, 200], {}) == {300, 500}


def test_keep_latest_of_nothing():
    assert KeepLatest(3).keep([], {}) == set()


# --- KeepEvery -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, expected",
    [(1, set(STEPS)), (200, {0, 200, 400}), (250, {0, 500}), (1000, {0}), (7, {0})],
)
def test_keep_every(n, expected):
    assert KeepEvery(n).keep(STEPS, {}) == expected


def test_keep_every_without_step_zero():
    assert KeepEvery(3).keep([1, 2, 3, 4, 5, 6, 7, 9], {}) == {3, 6, 9}


# --- KeepBest ------------------------------------------------------------------------------------

LOSS = {
    0: {"loss": 3.0, "acc": 0.1},
    100: {"loss": 1.0, "acc": 0.5},
    200: {"loss": 2.0, "acc": 0.9},
    300: {"loss": 0.5, "acc": 0.7},
    400: {"acc": 0.95},  # no loss
    500: {"loss": 4.0},  # no acc
}


@pytest.mark.parametrize(
    "policy, expected",
    [
        (KeepBest("loss"), {300}),
        (KeepBest("loss", "min", 2), {300, 100}),
        (KeepBest("loss", n=3), {300, 100, 200}),
        (KeepBest("loss", "max"), {500}),
        (KeepBest("loss", "max", 2), {500, 0}),
        (KeepBest("acc", "max"), {400}),
        (KeepBest("acc", "max", 3), {400, 200, 300}),
        (KeepBest("acc", "min"), {0}),
        (KeepBest("loss", n=10), {0, 100, 200, 300, 500}),  # never the step without the metric
    ],
)
def test_keep_best(policy, expected):
    assert policy.keep(STEPS, LOSS) == expected


def test_keep_best_default_mode_is_min_and_n_is_one():
    assert KeepBest("loss") == KeepBest("loss", "min", 1)


def test_keep_best_ignores_missing_metrics_and_missing_steps():
    metrics = {100: {"loss": 5.0}, 200: {}}  # 0 and 300 have no entry at all
    assert KeepBest("loss", n=3).keep([0, 100, 200, 300], metrics) == {100}
    assert KeepBest("loss").keep([0, 200, 300], metrics) == set()


def test_keep_best_ignores_nan():
    metrics = {1: {"loss": float("nan")}, 2: {"loss": 9.0}, 3: {"loss": float("nan")}}
    assert KeepBest("loss").keep([1, 2, 3], metrics) == {2}
    assert KeepBest("loss", "max").keep([1, 2, 3], metrics) == {2}
    assert KeepBest("loss", n=3).keep([1, 2, 3], metrics) == {2}
    assert KeepBest("loss").keep([1, 3], metrics) == set()


def test_keep_best_ignores_non_numbers():
    metrics = {1: {"loss": "low"}, 2: {"loss": None}, 3: {"loss": [0.0]}, 4: {"loss": 7.0}}
    assert KeepBest("loss", n=4).keep([1, 2, 3, 4], metrics) == {4}


def test_keep_best_handles_infinities_and_ints():
    metrics = {1: {"loss": float("inf")}, 2: {"loss": -float("inf")}, 3: {"loss": 0}, 4: {"loss": 2}}
    assert KeepBest("loss").keep([1, 2, 3, 4], metrics) == {2}
    assert KeepBest("loss", "max").keep([1, 2, 3, 4], metrics) == {1}
    assert KeepBest("loss", n=2).keep([1, 2, 3, 4], metrics) == {2, 3}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_ties_go_to_the_newer_step(mode):
    metrics = {10: {"m": 1.0}, 20: {"m": 1.0}, 30: {"m": 1.0}, 40: {"m": 5.0 if mode == "min" else -5.0}}
    assert KeepBest("m", mode).keep([10, 20, 30, 40], metrics) == {30}
    assert KeepBest("m", mode, 2).keep([10, 20, 30, 40], metrics) == {20, 30}
    # Input order does not matter.
    assert KeepBest("m", mode).keep([30, 10, 20, 40], metrics) == {30}


# --- KeepSteps -----------------------------------------------------------------------------------


def test_keep_steps():
    assert KeepSteps([100, 300, 999]).keep(STEPS, {}) == {100, 300}
    assert KeepSteps(range(0, 1000, 200)).keep(STEPS, {}) == {0, 200, 400}
    assert KeepSteps([]).keep(STEPS, {}) == set()


def test_keep_steps_is_immutable_and_comparable():
    p = KeepSteps([3, 1, 3])
    assert p.steps == frozenset({1, 3})
    assert p == KeepSteps({1, 3})
    assert hash(p) == hash(KeepSteps((3, 1)))


# --- unions --------------------------------------------------------------------------------------


def test_union_of_two():
    policy = KeepLatest(1) | KeepEvery(200)
    assert isinstance(policy, KeepAny)
    assert policy.keep(STEPS, {}) == {0, 200, 400, 500}


def test_union_of_three_is_flat():
    a, b, c = KeepLatest(1), KeepEvery(200), KeepBest("loss")
    policy = a | b | c
    assert policy == KeepAny((a, b, c))
    assert policy.keep(STEPS, LOSS) == {0, 200, 400, 500, 300}


def test_union_is_associative_in_effect():
    a, b, c = KeepLatest(2), KeepSteps([100]), KeepBest("acc", "max")
    assert (a | (b | c)).keep(STEPS, LOSS) == ((a | b) | c).keep(STEPS, LOSS) == {400, 500, 100}


def test_union_with_itself_and_disjoint_results():
    assert (KeepLatest(1) | KeepLatest(1)).keep(STEPS, {}) == {500}
    assert (KeepSteps([0]) | KeepSteps([100])).keep(STEPS, {}) == {0, 100}


def test_union_passes_metrics_to_every_member():
    policy = KeepBest("loss") | KeepBest("acc", "max")
    assert policy.keep(STEPS, LOSS) == {300, 400}


def test_base_policy_is_abstract():
    with pytest.raises(NotImplementedError):
        KeepPolicy().keep(STEPS, {})


# --- invalid arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, 1.5, 2.0, "2", None])
@pytest.mark.parametrize("cls", [KeepLatest, KeepEvery])
def test_keep_latest_and_every_reject_bad_n(cls, n):
    with pytest.raises(ValueError, match=cls.__name__):
        cls(n)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="best"),
        dict(mode="MIN"),
        dict(mode=None),
        dict(n=0),
        dict(n=-2),
        dict(n=1.0),
        dict(n="1"),
    ],
)
def test_keep_best_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="KeepBest"):
        KeepBest("loss", **kwargs)


@pytest.mark.parametrize("steps", [["a"], [1, "x"], ["1.5"]])
def test_keep_steps_rejects_non_integers(steps):
    with pytest.raises(ValueError):
        KeepSteps(steps)


def test_keep_steps_rejects_fractional_steps():
    # Like KeepLatest(1.5), a fractional step is an invalid argument; truncating it to
    # step 1 would silently protect a different checkpoint.
    with pytest.raises(ValueError):
        KeepSteps([1.5])


def test_keep_best_ranks_saved_infinities_and_not_bools_as_best_step_does():
    # save(metrics=) stores infinities as "Infinity"/"-Infinity": KeepBest skipped them
    # (a -inf loss was deleted as unranked) and ranked True as 1, where best_step did the
    # opposite, so the step best_step named could be one retention deleted.
    metrics = {1: {"loss": 1.0}, 2: {"loss": "-Infinity"}, 3: {"loss": 0.5}, 4: {"loss": True}, 5: {"loss": "Infinity"}}
    assert KeepBest("loss").keep([1, 2, 3, 4, 5], metrics) == {2}
    assert KeepBest("loss", "max").keep([1, 2, 3, 4, 5], metrics) == {5}
    assert KeepBest("loss", n=5).keep([1, 2, 3, 4, 5], metrics) == {1, 2, 3, 5}
