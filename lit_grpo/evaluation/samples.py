"""``samples.jsonl``: a few of each epoch's rollouts, appended to the run's log folder."""

from __future__ import annotations

import json
from pathlib import Path


def append_samples(log_dir: str, epoch: int, samples: list[tuple]) -> None:
    """Append one JSON line per sample to ``log_dir/samples.jsonl``.

    Args:
        log_dir: The run's log folder (created if missing).
        epoch: The epoch the rollouts were sampled in.
        samples: ``(prompt, completion, reward)`` tuples; an episode's carry
            its turns after the final answer as a fourth item.
    """
    path = Path(log_dir) / "samples.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for prompt, completion, reward, *episode in samples:
            record = {"epoch": epoch, "prompt": prompt, "completion": completion, "reward": reward}
            f.write(json.dumps({**record, **({"turns": episode[0]} if episode else {})}) + "\n")
