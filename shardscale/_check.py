"""The check and the agreement: this rank's gradients checked (and unscaled) in one fused pass
per (device, dtype), and ONE collective that agrees on them with every rank, one verdict per
check.

Invariant: every rank of the group sees the same flags for each check before
`optimizer.step()`, after one collective per agreement, however many optimizers, devices and
dtypes hold the gradients; a local check that `unscale_()` makes waits (a [`Check`][] without a
verdict) for the next agreement, whose collective it joins, in a slot of its own.

It works on gradients (the parameters' `.grad`, grouped by `shardscale._grads`, whose
[`Kernels`][shardscale._grads.Kernels] check and unscale; a clip's norms are `shardscale._clip`'s),
never on optimizers: which optimizers a call covers, and what each went through in the
iteration, is the bookkeeping of `shardscale._stepping`, which hands the parameters here, one
[`Check`][] per call (a *unit*: its verdict is that call's optimizers'), and records the verdicts
it gets back. The [`Agreement`][] carries what a rank learns across iterations: its kernels'
constants, its ballots' templates, the fit's and the meter's readers, whether it has agreed
before.

Each rank writes what it saw into ONE float32 tensor, its *ballot*, on the group's
communication device, and the group runs ONE `all_reduce` (a SUM) on it, however many devices,
dtypes and optimizers hold the gradients. Its shape is fixed for the scaler's life (by the world
size alone), whatever the call, the settings or the state, so that ranks whose calls or states
differ meet in a collective of one shape and find out ([`Layout`][]):

```text
[has a scale, identity bits x 32, units x 8 [has gradients, skip, forward overflow, clipped],
 norm share, inf-norm shares x W, fit peaks x W, meter bins x 128]
```

* has a scale: 0 for a rank that never called `scale()` (a pipeline stage before the last),
  until the group has confirmed that some rank does;
* identity: the bits of a hash of what issued the ballot (the call, its place in the iteration,
  how many checks it carries) and of what the scaler holds (its state's origin: the one it was
  built with or the one it loaded; its settings). Every rank writes its own bits, so after the
  SUM a slot is 0 or W where all ranks agree, and anything else means that some rank's call or
  state differs: every rank sees it in the same reduced tensor, and raises the same error
  ([`ShardScaleMismatchError`][shardscale.ShardScaleMismatchError]) at the same collective;
* a unit per check the collective agrees on (the call's own, and those `unscale_()` left
  waiting): has gradients (0 where this rank holds none for it), skip (1 if an inf or NaN is in
  its gradients here), forward overflow (1 if, besides, a loss this rank scaled in the
  iteration was inf or NaN: no scale helps that, the step is skipped with the scale held; a
  non-finite loss that left every gradient finite is no overflow), clipped (in a clip's
  ballot, 1 where a waiting check holds some of the parameters this rank's clip covers: a
  check some rank marks takes the clip's flags with its own, on every rank alike, so that no
  optimizer steps on gradients an overflowing clip left unclipped);
* norm share: this rank's part of a global p-norm (`clip_grad_norm_`), an inf-norm's share in
  this rank's own slot among W (its reduction is a max, taken after the SUM);
* the fit's peaks (one slot per rank: the largest survives the SUM) and the meter's 128 counts
  (`shardscale._bins` makes and reads them; the ballot only carries them).

The flags count ranks after the SUM and are clamped to 1: torch's fused optimizers skip only
when `found_inf == 1.0`, so a summed flag of 2.0 (two ranks overflowed) would make them step
with inf gradients.

On the CPU the host reads the reduced ballot's head at once (it waited for the collective
anyway): a mismatch raises there, on every rank. On an accelerator the host reads only where a
rank lacks something (gradients for a check, or a scale: one synchronisation) or where a plain
step reads its decision anyway; there a mismatch also sets every check's skip and
forward-overflow flags (nothing is written into the weights, the scale is held) and is counted
on the device, and the alarms raise it (`shardscale._report`) at the update that reads the
counters. The collective itself (bounded, its failures named) is `shardscale._exchange`'s;
without a process group, or at world size 1, none is issued.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardscale._bins import BINS, Reading, Readings
from shardscale._config import ScalerConfig
from shardscale._errors import no_scale_message
from shardscale._exchange import Exchange
from shardscale._grads import Flags, GradGroups, Kernels, grad_groups, move
from shardscale._locate import name_mismatch
from shardscale._state import ScaleHome, Verdict

# Checks one ballot carries at most: the call's own and those `unscale_()` left waiting (an
# `unscale_()` that would leave more waiting agrees at once: `shardscale._stepping`).
MAX_CHECKS = 8
# Bits of the identity hash (module docstring).
IDENTITY_BITS = 32
# A check's slots, in its unit.
Unit = IntEnum("Unit", "HAS SKIP FORWARD CLIPPED", start=0)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each part of a ballot travels (module docstring): fixed by the world size alone."""

    world_size: int

    SCALED = 0
    IDENTITY = slice(1, 1 + IDENTITY_BITS)
    UNITS = slice(IDENTITY.stop, IDENTITY.stop + len(Unit) * MAX_CHECKS)
    NORM = UNITS.stop

    @property
    def inf_norms(self) -> slice:
        return slice(self.NORM + 1, self.NORM + 1 + self.world_size)

    @property
    def peaks(self) -> slice:
        return slice(self.inf_norms.stop, self.inf_norms.stop + self.world_size)

    @property
    def bins(self) -> slice:
        return slice(self.peaks.stop, self.peaks.stop + BINS)

    @property
    def size(self) -> int:
        return int(self.bins.stop)


@dataclass(eq=False, slots=True)
class Check:
    """The gradients of one `unscale_()`, `step()` or `clip_grad_norm_()` call, which the group
    decides on together: one unit of a ballot, one [`Verdict`][shardscale._state.Verdict].

    Attributes:
        has_grads: Whether this rank holds a gradient here (an empty shard's counts).
        param_ids: The parameters' ids, where a later clip must know whether it covers them.
        local_flags: What `unscale_()` found here, by device, while the check waits for the
            agreement (None: not checked by `unscale_()`).
        reading: What the fit and the meter read of its gradients, before the unscale.
        verdict: What the group agreed (None: not yet).
    """

    has_grads: bool = False
    param_ids: frozenset[int] = frozenset()
    local_flags: Flags | None = None
    reading: Reading | None = None
    verdict: Verdict | None = None

    def waiting_flags(self) -> Flags | None:
        """What `unscale_()` found here while the check waits for the agreement (None: not
        checked by `unscale_()`, or agreed)."""
        return self.local_flags if self.verdict is None else None


@dataclass(frozen=True, slots=True)
class Ballot:
    """What this rank puts into the collective (see the module).

    Attributes:
        device: The scale's device, where the verdicts are returned (the tensor is on the
            group's communication device).
        units: The checks' slots (a `[MAX_CHECKS, len(Unit)]` view).
        has: Whether this rank holds gradients for each check it carries, in order (what their
            has-gradients slots say, known on the host: a rank without reads the result).
        has_scale: What the has-a-scale slot says (False: a rank that never scaled; it reads
            the result, and modifies nothing before).
        loss_checked: Whether a loss's finiteness went into the forward-overflow slots.
        peak_slot, inf_norm_slot: This rank's slots among the fit's peaks and the inf-norms.
    """

    tensor: torch.Tensor
    layout: Layout
    device: torch.device
    units: torch.Tensor
    has: tuple[bool, ...]
    has_scale: bool
    loss_checked: bool
    peak_slot: torch.Tensor
    inf_norm_slot: torch.Tensor

    @property
    def used(self) -> int:
        """How many checks it carries (its first units)."""
        return len(self.has)

    def skip(self, unit: int = 0) -> torch.Tensor:
        """The skip slot of check `unit` (a view: a local check raises it directly)."""
        return self.units[unit, Unit.SKIP]

    @property
    def norm(self) -> torch.Tensor:
        return self.tensor[Layout.NORM]

    @property
    def peaks(self) -> torch.Tensor:
        return self.tensor[self.layout.peaks]

    @property
    def bins(self) -> torch.Tensor:
        return self.tensor[self.layout.bins]


class Iteration(Protocol):
    """What an agreement reads of the iteration under way
    ([`IterationBook`][shardscale._stepping.IterationBook])."""

    step: int
    collectives: int
    loss_nonfinite: torch.Tensor | None
    losses: list[torch.Tensor]
    fit_readings: list[torch.Tensor]
    peaks: list[torch.Tensor]
    counts: list[torch.Tensor]
    mismatches: list[torch.Tensor]


class Agreement:
    """Checks, unscales and clips this rank's gradients, and agrees with every rank.

    The fit and the meter read the gradients through one seam, [`Readings`][
    shardscale._bins.Readings], called only on the steps they read (the fit's, and the meter's
    every `underflow_every`); a clip agrees through [`ballot()`][ballot] and [`vote()`][vote]
    too (`shardscale._clip`).

    Args:
        exchange: the process group and its collectives.
        home: the scale state, where it lives, and where it came from (its identity).
        config: the scaler's options; read here: `underflow_every` (the meter's steps), and
            those that decide when the scaler communicates (part of the identity).
    """

    def __init__(self, exchange: Exchange, home: ScaleHome, config: ScalerConfig) -> None:
        self.exchange = exchange
        self.home = home
        self.kernels = Kernels()
        self.readings = Readings(config.underflow_every)
        self._settings = zlib.crc32(repr(config.collective_settings()).encode())
        # the ballots' two rows (module docstring), made once per identity and device
        self._templates: dict[tuple[Any, ...], torch.Tensor] = {}
        self.agreed_once = False
        """Whether this scaler has been through an agreement: every rank passes its first at
        the same collective, so "defer unscale_'s agreement" is decided alike everywhere."""

    def agree(
        self,
        book: Iteration,
        scale: torch.Tensor,
        caller: str,
        own: Check | None,
        groups: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], []),
        waiting: Sequence[Check] = (),
    ) -> None:
        """Check the gradients of `own` (`groups`: parameters whose gradients are unscaled,
        and those only checked) and agree on a verdict for it and for each of `waiting`
        (`unscale_()`'s local checks), in one collective; each check takes its verdict.

        On a rank that never called `scale()` (`caller` names the call for the error where no
        rank did) nothing is modified until the group has confirmed that some rank did.
        """
        unscale, check = groups
        checks = list(waiting) if own is None else [own, *waiting]
        with torch.no_grad():
            to_unscale, has_unscaled = grad_groups(unscale)
            to_check, has_checked = grad_groups(check)
            if own is not None:
                own.has_grads = has_unscaled or has_checked
            has_scale = not self.home.unconfirmed
            ballot = self.ballot(book, scale.device, caller, checks, has_scale)
            counting = self.counting(book, scale.device)
            inv = self.kernels.inverse(scale) if unscale else None
            flags: Flags = {ballot.skip().device: ballot.skip()}
            if own is not None:  # unconfirmed: check now, unscale after
                groups_ = (to_unscale, to_check)
                read = (book, groups_, [*unscale, *check], inv if has_scale else None, flags)
                own.reading = self._check_local(*read, counting)
            others = [(0, flag) for device, flag in flags.items() if device != ballot.skip().device]
            others += waiting_votes(checks)
            self.fill(ballot, [check.reading for check in checks], counting)
            verdicts = self.vote(book, ballot, others, caller, None, counting)
            for check_, verdict in zip(checks, verdicts, strict=True):
                check_.verdict = verdict
            if not has_scale and inv is not None:  # the group confirmed a scale: unscale now
                self.kernels.multiply_(to_unscale, inv)

    def check_for_later(
        self, book: Iteration, scale: torch.Tensor, check: Check, params: list[torch.Tensor]
    ) -> None:
        """`unscale_`'s local check of `params`' gradients, unscaling them: `check` keeps its
        flags and readings, and waits for the next agreement."""
        with torch.no_grad():
            groups, has_grads = grad_groups(params)
            # the meter's step: counted now, at the scale the gradients still carry
            counting = self.counting(book, scale.device)
            flags: Flags = {}
            inv = self.kernels.inverse(scale)
            checks: tuple[GradGroups, GradGroups] = (groups, {})
            check.reading = self._check_local(book, checks, params, inv, flags, counting)
        check.has_grads, check.local_flags = has_grads, flags
        check.param_ids = frozenset(map(id, params))

    def _check_local(
        self,
        book: Iteration,
        groups: tuple[GradGroups, GradGroups],
        params: list[torch.Tensor],
        inv_scale: torch.Tensor | None,
        flags: Flags,
        counting: bool,
    ) -> Reading | None:
        """The local check, the same for an agreement and for `unscale_`'s deferred one: what
        the fit and the meter read of the still-scaled gradients (of `params`), where they want
        it; then one fused check per group of the first `groups`, which also multiplies by
        `inv_scale` (if given), and of the second, raising `flags`."""
        unscale, check = groups
        fit, reading = self.home.host.policy.fit, None
        if counting or fit:  # where they read this step (the seam: module docstring)
            device = self.home.require("step").scale.device
            reading = self.readings.read(book, groups, params, device, None, fit, counting)
        self.kernels.check_(unscale, inv_scale, flags)
        if check:
            self.kernels.check_(check, None, flags)
        return reading

    def counting(self, book: Iteration, device: torch.device) -> bool:
        """Whether this step is one of the meter's: every `underflow_every` steps (0: never),
        where its counts can be made on `device` (`shardscale._bins`)."""
        every = self.readings.meter_every
        # `not step % every`: a Python bool even where torch.compile traces the step as a symbol
        if not every or book.step % every:
            return False
        return self.readings.can_count_on(book.step, device)

    def identity(self, book: Iteration, caller: str, checks: int) -> int:
        """The identity hash a ballot carries (module docstring): the call, its place in the
        iteration, how many checks it carries; the state's origin, the policy, the settings
        that decide when the scaler communicates."""
        key = (caller, book.collectives, checks, self.home.origin, self._settings)
        return zlib.crc32(repr((key, self.home.host.policy)).encode())

    def ballot(
        self,
        book: Iteration,
        device: torch.device,
        caller: str,
        checks: Sequence[Check],
        has_scale: bool,
        clipped: tuple[bool, ...] = (),
    ) -> Ballot:
        """This rank's fresh ballot for `checks` (the call's own first, then those waiting), on
        the communication device for `device`, in one kernel (module docstring). Its
        forward-overflow slots start at 1 where some loss of the iteration was inf or NaN, else
        at 0; the local check raises the skip slots itself ([`Ballot.skip`][Ballot.skip]). A
        clip's marks which checks hold some of its parameters here (`clipped`: their clipped
        slots)."""
        if len(checks) > MAX_CHECKS:
            raise RuntimeError(f"a ballot carries at most {MAX_CHECKS} checks, got {len(checks)}")
        book.collectives += 1
        identity = self.identity(book, caller, len(checks))
        layout = Layout(self.exchange.world_size)
        has = tuple(check.has_grads for check in checks)
        templates = self._templates_for(device, layout, identity, has, (has_scale, clipped))
        loss_nonfinite = book.loss_nonfinite
        if loss_nonfinite is None:
            votes = templates[0].clone()
        else:
            votes = torch.where(move(loss_nonfinite, templates.device), templates[1], templates[0])
        own = self.exchange.rank
        return Ballot(
            votes,
            layout,
            device,
            units=votes[Layout.UNITS].view(MAX_CHECKS, len(Unit)),
            has=has,
            has_scale=has_scale,
            loss_checked=loss_nonfinite is not None,
            peak_slot=votes[layout.peaks][own],
            inf_norm_slot=votes[layout.inf_norms][own],
        )

    def _templates_for(
        self,
        device: torch.device,
        layout: Layout,
        identity: int,
        has: tuple[bool, ...],
        marks: tuple[bool, tuple[bool, ...]],
    ) -> torch.Tensor:
        """A ballot's two rows (the second a non-finite loss's), on the communication device for
        `device`: made once per identity, gradients held, has-a-scale and clipped slots
        (`marks`) and device by this agreement, and dying with it; by kernels alone, no copy
        from the host, so that one first made while a CUDA graph captures the step (a meter or
        clip step's shape) is legal there."""
        has_scale, clipped = marks
        key = (device, identity, has, marks)
        templates = self._templates.get(key)
        if templates is None:
            comm = self.exchange.comm_device(device)
            templates = torch.zeros((2, layout.size), dtype=torch.float32, device=comm)
            templates[:, Layout.SCALED].fill_(float(has_scale))
            _fill_bits(templates[:, Layout.IDENTITY], identity)
            units = templates[:, Layout.UNITS].view(2, MAX_CHECKS, len(Unit))
            for unit, held in enumerate(has):
                units[:, unit, Unit.HAS].fill_(float(held))
            for unit, shares in enumerate(clipped):
                units[:, unit, Unit.CLIPPED].fill_(float(shares))
            units[1, : len(has), Unit.FORWARD].fill_(1.0)  # the row of a non-finite loss
            if len(self._templates) > 64:  # identities change with loads and settings
                self._templates.clear()
            self._templates[key] = templates
        return templates

    def fill(self, ballot: Ballot, readings: Iterable[Reading | None], counting: bool) -> None:
        """Write what the fit and the meter read (of a ballot's checks) into it, where they
        read."""
        read = [reading for reading in readings if reading is not None]
        if read:
            self.readings.fill(ballot.peak_slot, ballot.bins, read, counting)

    def vote(
        self,
        book: Iteration,
        ballot: Ballot,
        others: list[tuple[int, torch.Tensor]],
        caller: str,
        norm_type: float | None,
        counting: bool,
    ) -> list[Verdict]:
        """The one collective on `ballot`, with `others` (this rank's flags not raised in the
        ballot itself: those of other devices, and of `unscale_`'s waiting checks, each with
        its unit); then the scale is confirmed where the ballot had none. Returns a verdict per
        check, in the ballot's order; the fit's peak and the meter's counts go to `book`."""
        verdicts = self._reduce(ballot, others, book=book, caller=caller, norm_type=norm_type)
        fit = self.home.host.policy.fit
        if fit or counting:  # what they read, now the group's (the seam: class docstring)
            bins = ballot.bins if counting else None
            self.readings.keep(book, ballot.peaks, bins, ballot.device, fit)
        if not ballot.has_scale:  # the group confirmed that some rank scaled
            self.home.confirm()
        self.agreed_once = True
        return verdicts

    def _reduce(
        self,
        ballot: Ballot,
        others: Iterable[tuple[int, torch.Tensor]],
        *,
        book: Iteration,
        caller: str,
        norm_type: float | None = None,
    ) -> list[Verdict]:
        """Combine this rank's ballot with every other rank's, in one collective, and read what
        the group agreed: a verdict per check.

        Args:
            ballot: from [`_ballot()`][_ballot], its first check's skip slot raised by the
                local check where the gradients are on its device.
            others: `(unit, flag)`: float32 scalar flags of local checks, on any device (1.0:
                an element was non-finite), to raise that unit's skip slot with: those of
                other devices than the ballot's, and of checks made before the ballot
                (`unscale_`).
            book: the iteration under way (its step names it in errors).
            caller: the method being called (`"step"`...), for the error where no rank ever
                called `scale()` (a ballot without a scale asks).
            norm_type: the p of the gradient norm whose share travels in the ballot (or None).
                The share must be non-finite wherever the local check raised the first check's
                slot (the norms' check does); flags from other checks make it inf here, and so
                does any flag under an inf-norm.

        Raises:
            RuntimeError: (a ballot without a scale) no rank ever called `scale()`: every rank
                raises together, torch's words.
            ShardScaleMismatchError: the ranks' calls or scaler states differ (the identity).
            ShardScaleDistributedError: a rank did not arrive within `timeout`, or left.
        """
        votes, units, used, raised = ballot.tensor, ballot.units, ballot.used, False
        for unit, flag in others:  # one kernel per other flag (devices, earlier checks)
            slot = units[unit, Unit.SKIP]
            torch.maximum(slot, move(flag, slot.device), out=slot)
            raised = raised or unit == 0
        if ballot.loss_checked:  # a forward overflow: a non-finite loss, gradients to match
            units[:used, Unit.FORWARD].mul_(units[:used, Unit.SKIP])
        if norm_type is not None and (raised or math.isinf(norm_type)):
            share = ballot.inf_norm_slot if math.isinf(norm_type) else ballot.norm
            share.masked_fill_(units[0, Unit.SKIP] > 0, math.inf)  # the overflow shows there
        flags, head = units[:used, Unit.SKIP : Unit.CLIPPED], None  # [skip, forward]: Flag's
        mismatch = None
        if self.exchange.world_size > 1:
            what = "the overflow flags" + (" and gradient norm" if norm_type is not None else "")
            self.exchange.all_reduce(votes, dist.ReduceOp.SUM, book.step, what)
            flags = flags.clamp(max=1.0)  # counts of ranks: exactly 0/1 after this
            if votes.device.type == "cpu":  # read at once: free, the host waited for it
                head = self._agreed_head(ballot, book, caller)
            else:  # on an accelerator: a mismatch holds every check, raised at the update
                mismatch = self._mismatch_on_device(ballot)
                flags = torch.maximum(flags, mismatch)
        if norm_type is not None and used > 1:  # a clip's, with checks waiting (agreed)
            flags = _sharing_the_clip(flags, units[:used, Unit.CLIPPED])
        has = self._has_grads(ballot, head, caller)
        moved = move(flags, ballot.device)
        if mismatch is not None:
            book.mismatches.append(move(mismatch, ballot.device))
        return [Verdict(flags=moved[i], has_grads=has[i]) for i in range(used)]

    def _agreed_head(self, ballot: Ballot, book: Iteration, caller: str) -> list[float]:
        """The reduced ballot's head (the scale's slot, the identity, the checks), read on the
        host; a mismatch of the identity raises, on every rank (they read the same tensor).

        Raises:
            ShardScaleMismatchError: some rank's call or state differs; every rank's is named
                (one gather, on every rank: each saw the mismatch in this collective).
        """
        head: list[float] = ballot.tensor[: Layout.UNITS.stop].tolist()
        world_size = self.exchange.world_size
        if all(bit in (0.0, world_size) for bit in head[Layout.IDENTITY]):
            return head
        call = f"{caller}() (collective {book.collectives} of step {book.step}, "
        mine = {"call": call + f"{ballot.used} check(s))", "state": self.home.origin_note}
        raise name_mismatch(self.exchange, mine, book.step)

    def _mismatch_on_device(self, ballot: Ballot) -> torch.Tensor:
        """On an accelerator, 1.0 where the reduced identity says some rank differs (a slot
        neither 0 nor W), else 0.0: three kernels, no host read."""
        bits = ballot.tensor[Layout.IDENTITY]
        return torch.remainder(bits, float(self.exchange.world_size)).amax().clamp(max=1.0)

    def _has_grads(self, ballot: Ballot, head: list[float] | None, caller: str) -> list[bool]:
        """Whether some rank holds gradients for each check: known where this rank does; read
        from the reduced ballot (one host read, unless read already) where it does not, or
        where this rank had no scale (then also: did any rank scale?).

        Raises:
            RuntimeError: no rank ever called `scale()` (torch's words, on every rank).
        """
        if ballot.has_scale and all(ballot.has):
            return list(ballot.has)
        if head is None:
            head = ballot.tensor[: Layout.UNITS.stop].tolist()
        if not ballot.has_scale and head[Layout.SCALED] == 0.0:
            self.home.withdraw()
            raise RuntimeError(no_scale_message(caller))
        start = Layout.UNITS.start + Unit.HAS
        return [held or head[start + i * len(Unit)] > 0 for i, held in enumerate(ballot.has)]


def waiting_votes(checks: Sequence[Check]) -> list[tuple[int, torch.Tensor]]:
    """The flags `unscale_()` raised for a ballot's `checks` still waiting, each with its unit
    (the check's place among them)."""
    waiting = enumerate(check.waiting_flags() or {} for check in checks)
    return [(unit, flag) for unit, flags in waiting for flag in flags.values()]


def _sharing_the_clip(flags: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """A clip's ballot's flags (the clip's first), where each check that some rank marked
    clipped (it holds some of the clip's parameters there: `Unit.CLIPPED`, a count after the
    SUM) takes the clip's flags with its own: on the device, the same on every rank."""
    shares = (clipped > 0).unsqueeze(1)  # the clip's own row is never marked: it keeps its own
    return torch.where(shares, torch.maximum(flags, flags[:1]), flags)


def _fill_bits(slots: torch.Tensor, value: int) -> None:
    """Set each of `slots`' columns (rows: the template's two) to a bit of `value`."""
    for bit in range(slots.shape[-1]):
        if value >> bit & 1:
            slots[:, bit].fill_(1.0)
