"""Keep the ranks of a group in step and agreeing, so a bad request, a missing rank or a NaN is an error, not a hang.

A group of ranks runs one collective program: if one rank raises where its peers do not, or skips a call its peers
make, every later collective pairs with the wrong partner and the group is dead (the last rank waits the whole
collective timeout). Three mechanisms keep it in step:

- `CallEntry`: every `generate` starts with an entry handshake through the process group's key-value store, keyed by
  a per-group call counter. A rank that does not enter within a short timeout is named on the ranks that did, and
  ranks that enter with different arguments all fail alike. It uses the store, not a collective, because a store
  wait has its own timeout and leaves nothing pending behind when it expires (a timed-out gloo collective leaves the
  group unusable; NCCL and Neuron collectives cannot be given a shorter timeout per call), and the store is the
  same TCP store under gloo, NCCL and Neuron.
- `agree`: what can fail on one rank only (the leader encodes, decodes and saves) is caught on every rank and
  exchanged, so every rank raises the same exception and the group stays usable for the next request.
- `LatentAgreement`: ranks that denoise different latents (silently wrong image), or latents that are NaN or
  infinite (a black image), raise on every rank at the step where it happened.

Under context parallelism the group is the whole image group (TP x ring x Ulysses ranks): the transformer's output
is gathered along the sequence, so each of them holds all latents.
"""

from __future__ import annotations

import hashlib
import pickle
from datetime import timedelta

import PIL.Image
import torch
import torch.distributed as dist

from .distributed import default_store, wait_keys

#: Seconds a rank waits in `CallEntry.enter` for the rest of its group: far below the collective timeout, far above
#: the skew between ranks' calls (`generate` returns on every rank of a group together).
ENTRY_TIMEOUT_S = 60.0

_STARTED, _ABANDONED = b"started", b"abandoned"
#: Calls made so far per group (the name of a `CallEntry`), shared by every `CallEntry` of this process, and the
#: last call this process saw started.
_calls: dict[str, int] = {}
_started: dict[str, int] = {}


class LatentsDivergedError(RuntimeError):
    """Ranks of one tensor-parallel group (or of one CFG pair) hold different latents."""


class NonFiniteLatentsError(RuntimeError):
    """Some rank's latents hold NaN or infinite values: the image would come out black or as noise."""


class GroupOutOfStepError(RuntimeError):
    """Ranks of one group did not make the same call: one did not enter it in time, or they passed other arguments."""


def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(sum, sum of |x|, position-weighted sum) over `tensors`, in float32 on their device.

    The weighted sum tells apart latents that hold the same values in a different order; any NaN or infinite value
    makes the checksum non-finite.
    """
    parts = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).float()
        weights = torch.linspace(-1.0, 1.0, flat.numel(), device=flat.device)
        parts.append(torch.stack([flat.sum(), flat.abs().sum(), (flat * weights).sum()]))
    return torch.stack(parts).sum(0)


def fingerprint(value):
    """A picklable, comparable description of call arguments: tensors by shape, dtype and checksum; PIL images by
    size, mode and a hash of their pixels; plain data as itself; other objects (a pipeline's KV cache container,
    ...) by type, since each rank holds its own."""
    if isinstance(value, PIL.Image.Image):  # image inputs: the same picture on every rank, whatever object holds it
        return ("image", value.size, value.mode, hashlib.sha256(value.tobytes()).hexdigest()[:16])
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), checksum([value]).tolist() if value.numel() else [])
    if isinstance(value, dict):
        return {str(key): fingerprint(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [fingerprint(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _group_ranks(group) -> list[int]:
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


class CallEntry:
    """Every rank of `ranks` enters call number n of this group together and with the same arguments, or all fail.

    Each rank posts its arguments' fingerprint under `<group>/<n>/<rank>` and waits for the others' with
    `timeout_s`. Whoever first sees all of them marks call n *started*; a rank whose wait expires marks it
    *abandoned* and raises, naming the ranks that did not come. A rank arriving at an abandoned call skips to n + 1,
    so the group pairs up again at the next call instead of staying one call apart for good.
    """

    def __init__(self, ranks: list[int], what: str, timeout_s: float | None = ENTRY_TIMEOUT_S):
        """`timeout_s=None`: the store's own timeout, the one the process group was started with."""
        self.ranks = sorted(ranks)
        self.what = what
        self.name = f"neuron_diffusers/{what}/{','.join(map(str, self.ranks))}"
        self.timeout_s = timeout_s

    def enter(self, arguments) -> None:
        """Wait for the group's other ranks to enter this call with the same `arguments` (see `fingerprint`)."""
        if len(self.ranks) < 2:
            return
        store, me = default_store(), dist.get_rank()
        timeout = store.timeout if self.timeout_s is None else timedelta(seconds=self.timeout_s)
        mine = hashlib.sha256(repr(fingerprint(arguments)).encode()).hexdigest()[:16]
        while True:
            number = _calls[self.name] = _calls.get(self.name, 0) + 1
            keys = [f"{self.name}/{number}/{rank}" for rank in self.ranks]
            state = f"{self.name}/{number}/state"
            if store.check([state]) and store.get(state) == _ABANDONED:
                continue  # the others gave up on this call before this rank came: pair up at the next one
            store.set(keys[self.ranks.index(me)], mine)
            arrived = wait_keys(store, keys, timeout.total_seconds())
            outcome = store.compare_set(state, "", _STARTED if arrived else _ABANDONED)
            if outcome == _STARTED:
                break
            if not arrived:
                missing = [rank for rank, key in zip(self.ranks, keys, strict=True) if not store.check([key])]
                raise GroupOutOfStepError(
                    f"Rank(s) {missing} did not enter `{self.what}` within {timeout.total_seconds():g} s, so rank "
                    f"{me} gave up on this call: every rank of the group (ranks {self.ranks}) must make the same "
                    f"`{self.what}` call. A rank that raised before the call, or skipped it, leaves its peers waiting. "
                    "The group stays usable: the next call pairs the ranks up again."
                )
        seen = [value.decode() for value in store.multi_get(keys)]
        self._forget(store, number, me)
        if len(set(seen)) > 1:
            listed = ", ".join(f"rank {rank}: {value}" for rank, value in zip(self.ranks, seen, strict=True))
            raise GroupOutOfStepError(
                f"The ranks of the group called `{self.what}` with different arguments (fingerprints {listed}): every "
                "rank must pass the same prompts, seed and options, otherwise their collectives do different work."
            )

    def _forget(self, store, number: int, me: int) -> None:
        """Every rank of the group has entered call `number`, so all are done reading the previous call's keys: drop
        this rank's, and (the lowest rank) the previous call's state if this rank saw it started. An abandoned call
        keeps its state, so a rank arriving there late still learns to skip it."""
        store.delete_key(f"{self.name}/{number - 1}/{me}")
        if me == self.ranks[0] and _started.get(self.name) == number - 1:
            store.delete_key(f"{self.name}/{number - 1}/state")
        _started[self.name] = number


def shareable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, so every rank can raise the very same exception; else a `RuntimeError` with
    its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # an exception whose state does not pickle: its text still travels
        pass
    return RuntimeError(f"{type(error).__name__}: {error}")


class GroupLostError(dist.DistError):
    """The exchange `agree` makes failed: a peer is gone (or hung past the collective timeout), so the group is dead.

    gloo reports a lost peer as a plain `RuntimeError` ("Connection reset by peer"), which would pass for one call's
    own failure; raised as a `DistError`, it ends the job or the server (`except dist.DistError`) instead.
    """


def agree(error: BaseException | None, *groups) -> BaseException | None:
    """The error every rank of `groups` ends up with: the first one in rank order, or None if no rank failed.

    Every rank calls this with what it caught (or None). With two groups (a TP group, then the CFG pair of each of its
    ranks) the decision hops across both, so a whole replica agrees. The rank the error came from keeps its own
    exception (with its traceback); the others get an equal copy. Raises `GroupLostError` when the exchange itself
    fails: nothing is left to agree with.
    """
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        gathered = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(gathered, None if error is None else shareable(error), group=group)
        except dist.DistError:
            raise
        except RuntimeError as lost:  # only the transport can fail here: what travels was made picklable above
            raise GroupLostError(f"a peer of this rank's group is gone: {lost}") from lost
        first = next((i for i, e in enumerate(gathered) if e is not None), None)
        if first is None:
            error = None
        elif first != dist.get_rank(group):
            error = gathered[first]
    return error


def raise_agreed(error: BaseException | None, *groups) -> None:
    """`agree`, then raise the agreed error on every rank (nothing happens when no rank failed)."""
    agreed = agree(error, *groups)
    if agreed is not None:
        raise agreed


class LatentAgreement:
    """Compares the latents of every rank of `group` at chosen steps; raises `LatentsDivergedError` (different
    latents) or `NonFiniteLatentsError` (NaN or infinite values on some rank, also without a group) on all of them.

    `rtol` is relative to the sum of |latents|: identical latents give identical checksums up to the order of
    float32 additions, while different noise moves them by a large fraction.
    """

    def __init__(self, group, every: int | None = None, rtol: float = 1e-4, cfg_group=None,
                 group_name: str | None = None):
        self.groups = [(group, group_name or "tensor-parallel group")] + (
            [(cfg_group, "CFG pair")] if cfg_group is not None else [])
        self.every = every
        self.rtol = rtol
        self._calls = 0

    def check(self, tensors: list[torch.Tensor], where: str) -> None:
        local = checksum(tensors)
        compared = False
        for group, name in self.groups:
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            if size == 1:
                continue
            gathered = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(gathered, local, group=group)
            _check_finite(gathered, _group_ranks(group), where)
            reference = gathered[0]
            scale = self.rtol * reference[1].abs().clamp_min(1.0)
            for index, other in enumerate(gathered[1:], start=1):
                if ((other - reference).abs() > scale).any():
                    raise LatentsDivergedError(
                        f"Latents differ across the {name} at {where}: rank "
                        f"{dist.get_global_rank(group, index)} holds latents with checksum {other.tolist()}, rank "
                        f"{dist.get_global_rank(group, 0)} holds {reference.tolist()}. Every rank of the {name} must "
                        "denoise the same noise, otherwise the image comes out silently wrong. Give every rank the "
                        "same `seed` (`generate` seeds a CPU generator with seed + index) and do not pass per-rank "
                        "`generator` or `latents`."
                    )
            compared = True
        if not compared:
            _check_finite([local], [dist.get_rank() if dist.is_initialized() else 0], where)

    def _due(self, step: int, last: bool) -> bool:
        return step == 0 or last or bool(self.every and step % self.every == 0)

    def step_end(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        """A stock `callback_on_step_end`: checks the latents the step produced."""
        if self._due(step, last=step == pipe.num_timesteps - 1):
            self.check([callback_kwargs["latents"]], f"step {step}")
        return {}

    def pre_hook(self, module, args, kwargs) -> None:
        """A transformer forward pre-hook, for pipelines without step callbacks: checks the call's float inputs."""
        if self._due(self._calls, last=False):
            inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.check(inputs, f"transformer call {self._calls}")
        self._calls += 1


def _check_finite(checksums: list[torch.Tensor], ranks: list[int], where: str) -> None:
    bad = [rank for rank, value in zip(ranks, checksums, strict=True) if not torch.isfinite(value).all()]
    if bad:
        raise NonFiniteLatentsError(
            f"The latents of rank(s) {bad} hold NaN or infinite values at {where}: the image would come out black or "
            "as noise. Usual causes: a NaN or infinite option (guidance, true_cfg_scale), a checkpoint with NaN or "
            "infinite weights (download or save it again), or float16 overflow (use bfloat16 or float32)."
        )
