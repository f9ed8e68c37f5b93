"""Trajectory record validation: every inconsistency is a RecordError naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from arpo.errors import RecordError
from arpo.record import PNG_SIGNATURE, Status, Trajectory, Turn

GOOD = {
    "prompt_ids": np.array([1, 2, 3], np.int32),
    "screenshot": PNG_SIGNATURE + b"data",
    "response_ids": np.array([4, 5], np.int32),
    "logprobs": np.array([-0.1, -0.2], np.float32),
    "policy_version": 2,
    "action": "DONE",
    "parsed": True,
}


def test_lists_are_converted_and_arrays_kept() -> None:
    t = Turn(**{**GOOD, "prompt_ids": [1, 2, 3], "logprobs": [-0.5, -1]})
    assert t.prompt_ids.dtype == np.int32 and t.logprobs.dtype == np.float32
    arr = GOOD["response_ids"]
    assert Turn(**GOOD).response_ids is arr  # no copy of a correct array


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_ids": np.array([1, 2], np.int64)}, "turn.prompt_ids must have dtype int32"),
        ({"prompt_ids": np.zeros((2, 2), np.int32)}, "turn.prompt_ids must be 1-D"),
        ({"prompt_ids": [1.5]}, "turn.prompt_ids must contain integers"),
        ({"prompt_ids": [2**40]}, "outside the int32 range"),
        ({"prompt_ids": "abc"}, "turn.prompt_ids must be a 1-D array"),
        ({"response_ids": np.array([4], np.int32)}, "one log-prob per sampled token"),
        ({"logprobs": np.array([-0.1, np.nan], np.float32)}, "turn.logprobs must be finite"),
        ({"logprobs": np.array([-0.1, -0.2])}, "turn.logprobs must have dtype float32"),
        ({"screenshot": "png"}, "turn.screenshot must be PNG bytes"),
        ({"screenshot": b"GIF89a..."}, "not a PNG"),
        ({"policy_version": -1}, "turn.policy_version must be in [0, "),
        ({"policy_version": True}, "turn.policy_version must be an int"),
        ({"action": None}, "turn.action must be a str"),
        ({"parsed": 1}, "turn.parsed must be a bool"),
    ],
)
def test_turn_errors(change: dict, message: str) -> None:
    with pytest.raises(RecordError) as e:
        Turn(**{**GOOD, **change})
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task_id": ""}, "trajectory.task_id must not be empty"),
        ({"task_id": 3}, "trajectory.task_id must be a str"),
        ({"task_id": "a\ud800"}, "not valid unicode"),
        ({"turns": "x"}, "trajectory.turns must be a sequence"),
        ({"turns": (1,)}, "trajectory.turns[0] must be a Turn"),
        ({"checker_score": float("inf")}, "trajectory.checker_score must be finite"),
        ({"reward": "1"}, "trajectory.reward must be a number"),
        ({"status": "great"}, "trajectory.status 'great' is not one of ok, env_error"),
        ({"slot": -1}, "trajectory.slot must be an int in [0, "),
        ({"timings": {"reset": float("nan")}}, "trajectory.timings['reset'] must be finite"),
        ({"timings": [1]}, "trajectory.timings must be a mapping"),
    ],
)
def test_trajectory_errors(change: dict, message: str) -> None:
    kwargs = {"task_id": "t", "turns": (Turn(**GOOD),), "checker_score": 1.0, **change}
    with pytest.raises(RecordError) as e:
        Trajectory(**kwargs)
    assert message in str(e.value)


def test_sequence_and_versions() -> None:
    t = Trajectory(
        task_id="t",
        turns=(Turn(**GOOD), Turn(**{**GOOD, "policy_version": 5})),
        checker_score=1.0,
        status="ok",
    )
    assert t.status is Status.OK and t.min_version == 2 and t.max_version == 5 and t.steps == 2
    ids, mask, lps = t.sequence()
    assert ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]
    assert mask.tolist() == [False] * 3 + [True] * 2 + [False] * 3 + [True] * 2
    assert np.allclose(lps[mask], [-0.1, -0.2, -0.1, -0.2]) and not lps[~mask].any()
    with pytest.raises(AttributeError):
        t.reward = 3.0  # type: ignore[misc]
