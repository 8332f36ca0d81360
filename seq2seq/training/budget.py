"""The updates a run plans, known once the data is prepared, and the settings that do not fit them.

A config's defaults are written for a corpus like Multi30k (29,000 pairs); on a user's own corpus the
same warm-up, epoch limit or vocabulary can be far off, and nothing else would say so before the run ends.
"""

from __future__ import annotations

from seq2seq.config import TrainConfig


def planned_updates(t: TrainConfig, per_epoch: int) -> int:
    """Updates until train.max_steps or the end of train.max_epochs, whichever comes first; 0: no such limit."""
    return min((n for n in (t.max_steps, t.max_epochs * per_epoch) if n), default=0)


def plan_warnings(t: TrainConfig, pairs: int, per_epoch: int, warmup_steps: int = 0) -> list[str]:
    """One line for each limit that cuts the run short of another, or leaves the schedule in warm-up."""
    out = []
    epochs_end = t.max_epochs * per_epoch
    if t.max_epochs and t.max_steps and epochs_end < t.max_steps:
        out.append(
            f"train.max_epochs={t.max_epochs} stops the run after about {epochs_end} updates ({per_epoch} an epoch), "
            f"before train.max_steps={t.max_steps}; train.max_epochs=0 is no epoch limit"
        )
    planned = planned_updates(t, per_epoch)
    if planned and warmup_steps > planned / 2:
        out.append(
            f"optim.warmup_steps={warmup_steps} is more than half of the {planned} planned updates ({pairs} pairs, "
            f"{per_epoch} updates an epoch at train.max_tokens={t.max_tokens}): the learning rate spends the run "
            "warming up"
        )
    return out
