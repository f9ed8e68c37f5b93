"""A trajectory as an item of the replay store (`arpo.buffer.Item`), and back.

    item = to_item(traj)        # ingest: what `store.put(task, item)` keeps
    traj = from_item(item)      # learner: the record again, as views into the item's memory

Layout: `tokens` is the training sequence (prompt_0, response_0, prompt_1, ...), `offsets`
the per-turn lengths [n_prompt_0, n_response_0, n_prompt_1, ...], `logprobs` the behaviour
log-probs of the response tokens in order, `rewards` [reward, checker_score, format_reward],
`version` the oldest turn's policy version, `blobs` the PNGs (kept by reference, without a
copy when they are bytes or views of received frames), `metadata` the trajectory's wire
header (`arpo.wire.pack_trajectory_header`), so an item decodes with the wire's checks and
raises `WireError` when it does not hold together.

The store itself (the package `arpo_buffer`, re-exported as `arpo.buffer`) knows nothing of
trajectories: it needs only numpy, and other RL loops embed it with layouts of their own
(`examples/embed_store.py`, `examples/embed_gymnasium.py`).
"""

from __future__ import annotations

import sys

import numpy as np

from arpo.buffer import Item
from arpo.errors import WireError
from arpo.record import Bytes, Trajectory
from arpo.wire import assemble_trajectory, pack_trajectory_header, unpack_trajectory_header


def to_item(traj: Trajectory) -> Item:
    """The trajectory as a store item (the layout above)."""
    ids: list[np.ndarray] = []
    offsets: list[int] = []
    for t in traj.turns:
        ids += [t.prompt_ids, t.response_ids]
        offsets += [len(t.prompt_ids), len(t.response_ids)]
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    lps = [t.logprobs for t in traj.turns]
    return Item(
        tokens.astype(np.int32, copy=False),
        np.concatenate(lps).astype(np.float32, copy=False) if lps else np.zeros(0, np.float32),
        np.asarray(offsets, dtype=np.int32),
        np.asarray([traj.reward, traj.checker_score, traj.format_reward], dtype=np.float32),
        max(traj.min_version, 0),
        blobs=[_as_blob(t.screenshot) for t in traj.turns],
        metadata=pack_trajectory_header(traj),
    )


def _as_blob(buf: Bytes) -> bytes | memoryview:
    """The PNG as a blob the store keeps by reference (see `arpo.buffer`), without a copy
    when it is bytes or a view of bytes or of a zmq.Frame: frames received with
    `recv_multipart(copy=True)` are bytes, with `copy=False` zmq.Frames, and decode's
    memoryviews point at them (a view of a frame is passed read-only: the store rejects
    writable views). Anything else (a bytearray, a view of writable memory) is copied."""
    if isinstance(buf, bytes):
        return buf
    if isinstance(buf, memoryview) and buf.c_contiguous:
        if isinstance(buf.obj, bytes):
            return buf.obj if buf.nbytes == len(buf.obj) else buf
        zmq = sys.modules.get("zmq")  # frames exist only once pyzmq is imported
        if zmq is not None and isinstance(buf.obj, zmq.Frame):
            return buf.toreadonly()
    return bytes(buf)


def from_item(item: Item) -> Trajectory:
    """The trajectory stored as `item` (see `to_item`), as views into the item's memory."""
    header = unpack_trajectory_header(item.metadata)
    specs = header["turns"]
    offsets = item.offsets
    if len(offsets) != 2 * len(specs) or len(item.blobs) != len(specs):
        raise WireError(
            f"store item does not match its header: {len(specs)} turns, "
            f"{len(offsets)} offsets, {len(item.blobs)} blobs"
        )
    tokens, logprobs = item.tokens, item.logprobs
    prompts, responses, lps = [], [], []
    pos = lpos = 0
    for i, (n_p, n_r, *_) in enumerate(specs):
        if offsets[2 * i] != n_p or offsets[2 * i + 1] != n_r:
            raise WireError(f"store item offsets disagree with the header at turn {i}")
        prompts.append(tokens[pos : pos + n_p])
        responses.append(tokens[pos + n_p : pos + n_p + n_r])
        lps.append(logprobs[lpos : lpos + n_r])
        pos += n_p + n_r
        lpos += n_r
    if pos != len(tokens) or lpos != len(logprobs):
        raise WireError("store item token or log-prob count disagrees with its header")
    return assemble_trajectory(
        header, prompts, responses, lps, logprobs, [memoryview(b) for b in item.blobs]
    )
