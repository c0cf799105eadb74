"""Which (dp, cfg, ring, ulysses, tp) layouts can run a model on N ranks: the rules, as plain arithmetic.

One image runs on a group of `tp x ulysses x ring` ranks (two such groups with CFG parallelism, one guidance branch
each), and `dp` copies of that tile the world. The rules are the ones diffusers and our tensor parallelism impose:

- `dp x cfg x ring x ulysses x tp == N`, and `cfg` is 1 or 2 (a CFG pair computes the two guidance branches);
- `tp` divides the attention heads (each rank owns whole heads);
- Ulysses splits the heads each TP rank keeps, so `ulysses` divides `heads / tp`. With `ulysses_anything`, diffusers
  pads the heads instead, but only while the padding stays below the heads each Ulysses rank ends up with;
- ring splits the sequence, not the heads: any degree.

The sequence must also split evenly over `ulysses x ring` in the plain modes; that depends on the request, not on
the layout, so callers check it per request. Plain functions, no torch: both the runtime checks and `plan report`
use them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The dimensions, in the order layouts are written and sorted.
DIMS = ("dp", "cfg", "ring", "ulysses", "tp")


@dataclass(frozen=True, order=True)
class Layout:
    dp: int = 1
    cfg: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1

    @property
    def ranks(self) -> int:
        return self.dp * self.cfg * self.ring * self.ulysses * self.tp

    @property
    def context(self) -> int:
        """How many ways one image's sequence is split (`ulysses x ring`)."""
        return self.ulysses * self.ring

    def __str__(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in DIMS)


def layout_problem(num_heads: int | None, world_size: int, tp: int = 1, ulysses: int = 1, ring: int = 1,
                   ulysses_anything: bool = False, *, cfg: int = 1) -> str | None:
    """Why this layout cannot run a model with `num_heads` heads (None: unknown) on `world_size` ranks, or None."""
    if cfg not in (1, 2):
        return f"cfg={cfg}: a CFG pair splits the two guidance branches, so cfg is 1 or 2"
    group = cfg * tp * ulysses * ring
    if world_size % group:
        what = f"cfg x tp x ulysses x ring = {cfg} x " if cfg > 1 else "tp x ulysses x ring = "
        return f"{what}{tp} x {ulysses} x {ring} = {group} does not divide the world size {world_size}"
    if num_heads is None:
        return None
    if num_heads % tp:
        return f"tp={tp} does not divide the {num_heads} attention heads"
    local = num_heads // tp
    pad = -local % ulysses
    if pad and not ulysses_anything:
        return (f"ulysses={ulysses} does not divide the {local} heads each tensor-parallel rank keeps "
                f"({num_heads} heads / tp={tp})")
    if pad and pad >= (local + pad) // ulysses:
        return (f"ulysses_anything would pad {local} local heads to {local + pad}, as many padding heads as each "
                f"Ulysses rank gets ({(local + pad) // ulysses}), which diffusers refuses")
    return None


def valid_layouts(num_heads: int | None, world_size: int, *, cfg_degrees=(1, 2), tp_degrees=None,
                  ulysses_anything: bool = False) -> list[Layout]:
    """Every layout of exactly `world_size` ranks that fits, sorted by (dp, cfg, ring, ulysses, tp).

    `tp_degrees` narrows TP to the degrees a plan can shard (default: any); `cfg_degrees=(1,)` when the request
    has no second guidance branch.
    """
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    layouts = [Layout(world_size // (cfg * tp * ulysses * ring), cfg, ring, ulysses, tp)
               for cfg in cfg_degrees for tp in sizes for ulysses in sizes for ring in sizes
               if (tp_degrees is None or tp in tp_degrees)
               and layout_problem(num_heads, world_size, tp, ulysses, ring, ulysses_anything, cfg=cfg) is None]
    return sorted(layouts)
