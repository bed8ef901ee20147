"""The project's warning and exception types, and torch's messages that we raise in torch's
words.

Users filter our warnings (`warnings.filterwarnings("error", category=ShardScaleWarning)`)
and catch our distributed failures without catching every `RuntimeError` torch raises, so both
get types of their own.
"""

from __future__ import annotations


def no_scale_message(funcname: str) -> str:
    """torch's call-order error for a scaler that never scaled a loss, in torch's words (users'
    `match=` strings keep working)."""
    return (
        f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
        "scaler.scale(loss or outputs) earlier in the iteration."
    )


def no_inf_checks_message(world_size: int) -> str:
    """torch's error for an optimizer none of whose parameters holds a gradient, in torch's
    words, then the rule: on no rank of the group."""
    return (
        "No inf checks were recorded for this optimizer: none of its parameters has a gradient "
        f"on any of the {world_size} rank(s). Call scaler.scale(loss).backward() before step()."
    )


# torch's FutureWarning, word for word, for optimizers whose step() takes `grad_scaler`.
GRAD_SCALER_WARNING = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed "
    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly."
)


class ShardScaleWarning(UserWarning):
    """Something is wrong with the training run, but the scaler can carry on.

    For example: an overflow at `min_scale`, where backing off further is impossible, or a long
    streak of non-finite losses.
    """


class ShardScaleDistributedError(RuntimeError):
    """The ranks of the process group cannot agree.

    For example, a rank never arrived at the agreement collective, or no rank had a gradient
    to check. The message names the step, the process group's size and what was awaited.
    """


class ShardScaleMismatchError(ShardScaleDistributedError):
    """The ranks met in the scaler's collective with different calls or different states.

    For example, one rank clipped and another stepped, or one rank loaded a checkpoint the
    others did not. Every rank finds it in the same collective and raises it there, naming each
    rank's call and state, without `TORCH_DISTRIBUTED_DEBUG` (the ballot carries an identity:
    docs/reliability.md). Nothing of that step was applied.
    """


class ShardScaleCheckpointError(RuntimeError):
    """A checkpoint could not be loaded, and nothing was: what was passed is as it was.

    Raised by [`load_whole()`][shardscale.load_whole] on every rank together; the
    message names the checkpoint, the file and the entry (its metadata unreadable, a file
    missing or cut short, an entry that does not read, or the scaler's entry refused), and
    what DCP raised. A `RuntimeError`, so `except Exception` catches it (DCP's own
    `CheckpointException` is a `BaseException`, which it does not).
    """


class ShardScaleSkipError(RuntimeError):
    """More consecutive steps were skipped than `max_consecutive_skips` allows.

    Raised on every rank together (the counters agree); the message names the step and the scale.
    """


class ShardScaleNonFiniteError(ShardScaleSkipError):
    """Gradients stayed non-finite where overflow no longer explains them.

    `max_overflows_at_floor` consecutive steps overflowed with the scale at `min_scale` (or
    fixed, `dynamic=False`). Raised by `update()` on every rank together, at the same step,
    before anything was written into the weights; the message names the parameters (and ranks)
    holding the non-finite values, says NaN or inf, and what that means. A
    [`ShardScaleSkipError`][shardscale.ShardScaleSkipError], so code that catches skipped-step
    errors catches it too.
    """
