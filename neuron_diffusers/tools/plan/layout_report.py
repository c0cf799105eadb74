"""`plan report --cores N`: every valid (dp, cfg, ring, ulysses, tp) layout of N ranks and what it costs each rank.

The rules are `parallel/layouts.py`'s (with TP narrowed to the degrees our plan shards evenly), the weights per rank
come from diffusers' own shard specs on the meta-device model (as `plan report --tp`), the FLOPs and bytes per step
from the model's shapes and a trace of the family's pipeline at the requested size (`costs.py`, `trace.py`), and the
optional step time from a hardware profile (`profiles.py`). Nothing here reads a released weight.
"""

from __future__ import annotations

import dataclasses

from ...distributed import mesh_layout
from ...families import PIPELINE_FAMILIES
from ...parallel.layouts import DIMS, Layout, valid_layouts
from ...parallel.plan_variants import variant_plan
from ...topology import Nodes, crossing_groups, split_dims
from .costs import KINDS, model_shapes, step_costs
from .profiles import profile, step_seconds
from .sharding import BF16_BYTES, GIB, held_params, planned_model, sharded_names, valid_tp_degrees
from .trace import trace

DEFAULT_SIZE = (1024, 1024)
#: Column headers of the traffic kinds (ring: the K/V all-gather diffusers runs; cfg: the prediction exchange).
DIM_HEADERS = {"dp": "dp", "cfg": "cfg", "ring": "ring", "ulysses": "uly", "tp": "tp"}
KIND_HEADERS = {"all_reduce": "all-red", "all_gather": "all-gat", "all_to_all": "all-to-all", "ring": "ring KV",
                "cfg": "cfg"}
NOTES = {
    "pad": "a split length does not divide ulysses x ring: pad it with masked rows or use the *_anything mode",
    "ring+mask": "ring over masked attention: diffusers applies the local mask to every rotated key block, so "
                 "use Ulysses, or ring without padding (ring_anything)",
    "no-fit": "the weights alone exceed the profile's memory per rank",
    "split-node": "a TP or Ulysses group would span nodes: refused unless --cross-node (their collectives run in "
                  "every block)",
    "no-cp-plan": "diffusers 0.42.1 ships no _cp_plan for this class: every sequence Linear is assumed split",
}


#: The traffic kinds each mesh dimension's groups carry (dp carries none per step).
DIM_KINDS = {"dp": (), "cfg": ("cfg",), "ring": ("ring",), "ulysses": ("all_to_all",),
             "tp": ("all_reduce", "all_gather")}


def layouts_report(model: str, cores: int, size: tuple[int, int] = DEFAULT_SIZE, *, plan: str = "default",
                   true_cfg: bool = False, hardware: str | None = None, nodes: int = 1) -> dict:
    """Every valid layout of `cores` ranks for `model` at `size` (width, height), with its per-rank costs.

    `true_cfg` traces a call with true classifier-free guidance (two forwards per step), which adds the cfg=2
    layouts; `hardware` names a profile for the step-time estimate; `nodes` splits the cores over that many nodes
    and says, per layout, which dimensions' collectives cross them (with the mesh order `--mesh-order auto` picks).
    """
    if nodes < 1 or cores % nodes:
        raise ValueError(f"--nodes {nodes} does not divide --cores {cores}: every node runs the same number of ranks.")
    chosen = profile(hardware) if hardware else None
    planned = planned_model(model)
    meta, family = planned.module, planned.family
    if not family.has_tiny:
        raise ValueError(f"{family.display_name} has no pipeline here, so there is no sequence to trace: layouts are "
                         f"reported for the pipeline families only ({', '.join(PIPELINE_FAMILIES)}).")
    rules = variant_plan(family, plan)
    width, height = size
    traced = trace(family, height, width, true_cfg)
    layouts = valid_layouts(meta.config.num_attention_heads, cores,
                            cfg_degrees=(1, 2) if traced.forwards_per_step == 2 else (1,),
                            tp_degrees=valid_tp_degrees(meta, rules))
    shapes = model_shapes(meta, rules)
    sharded = {tp: sharded_names(meta, rules, tp) for tp in sorted({layout.tp for layout in layouts})}
    rows = [_row(layout, shapes, sharded[layout.tp], traced, meta, chosen) for layout in layouts]
    for row, layout in zip(rows, layouts, strict=True):
        row.update(_node_columns(layout, row, Nodes(nodes, cores // nodes)))
    rows.sort(key=lambda row: (row["dp"], row["seconds"]["total"] if chosen else row["tflop"],
                               sum(row["sent_gb"].values())))
    first = traced.step[0]
    return {
        "model": str(model),
        "family": family.name,
        "model_class": type(meta).__name__,
        "config": planned.config,
        "plan": plan,
        "cores": cores,
        "nodes": nodes,
        "size": [width, height],
        "true_cfg": true_cfg,
        "forwards_per_step": traced.forwards_per_step,
        "attention_rows": max(call.key_rows for calls in first.attention.values() for call in calls),
        "split_lengths": list(first.split_lengths),
        "has_cp_plan": traced.has_cp_plan,
        "masked_attention": traced.masked_attention,
        "profile": dataclasses.asdict(chosen) if chosen else None,
        "notes": NOTES,
        "layouts": rows,
    }


def _row(layout: Layout, shapes, sharded: set[str], traced, meta, chosen) -> dict:
    costs = step_costs(shapes, sharded, traced, layout)
    notes = []
    if layout.context > 1 and any(length % layout.context for length in traced.step[0].split_lengths):
        notes.append("pad")
    if layout.ring > 1 and traced.masked_attention:
        notes.append("ring+mask")
    if layout.context > 1 and not traced.has_cp_plan:
        notes.append("no-cp-plan")
    row = {
        **dataclasses.asdict(layout),
        "ranks_per_image": layout.ranks // layout.dp,
        "weights_gib_bf16": held_params(meta, sharded, layout.tp) * BF16_BYTES / GIB,
        "tflop": costs.flops / 1e12,
        "linear_tflop": costs.linear_flops / 1e12,
        "attention_tflop": costs.attention_flops / 1e12,
        "sent_gb": {kind: costs.sent[kind] / 1e9 for kind in KINDS},
        "collectives": dict(costs.collectives),
        "notes": notes,
    }
    if chosen:
        row["seconds"] = step_seconds(costs, chosen)
        if row["weights_gib_bf16"] * GIB > chosen.memory.value:
            notes.append("no-fit")
    return row


def _node_columns(layout: Layout, row: dict, nodes: Nodes) -> dict:
    """The mesh order `--mesh-order auto` takes for `layout` on `nodes`, the dimensions whose groups cross nodes,
    and the GB each rank sends over them per step."""
    names, sizes = mesh_layout(layout.ranks, tp=layout.tp, ulysses=layout.ulysses, ring=layout.ring, cfg=layout.cfg,
                               nodes=nodes)
    crossing = [name for name, count in crossing_groups(sizes, names, nodes).items() if count]
    if split_dims(sizes, names, nodes):
        row["notes"].append("split-node")
    return {"mesh_order": list(names), "crosses_nodes": crossing,
            "inter_node_gb": sum(row["sent_gb"][kind] for name in crossing for kind in DIM_KINDS[name])}


def format_layouts(report: dict) -> str:
    """A table of `layouts_report`'s result, one line per layout, one-image layouts (dp=1) first."""
    width, height = report["size"]
    cfg = ("true CFG: two forwards per step, cfg=2 splits them" if report["true_cfg"]
           else "one forward per step (--true-cfg adds cfg=2 layouts where the family has true CFG)")
    lines = [
        f"{report['model_class']} ({report['model']}, {report['config']} config), {width}x{height}, "
        f"{report['plan']} plan: {len(report['layouts'])} layouts of {report['cores']} ranks",
        f"  attention over {report['attention_rows']} rows; context parallelism splits "
        f"{', '.join(map(str, report['split_lengths']))} rows; {cfg}",
        "  per rank and denoising step: weights (GiB bf16), TFLOP, GB sent by kind (bf16; ring KV = the K/V "
        "all-gather diffusers' ring runs), collectives",
    ]
    if report["profile"]:
        chosen = report["profile"]
        lines.append(f"  est s: {chosen['name']} ({chosen['rank']}), FLOPs at peak + latency and bytes per "
                     "collective, no overlap: see docs/layouts.md before trusting it")
    header = "".join(f"{DIM_HEADERS[d]:>5}" for d in DIMS) + f"{'GiB':>7}{'TFLOP':>8}"
    header += "".join(f"{KIND_HEADERS[kind]:>11}" for kind in KINDS) + f"{'colls':>7}"
    header += f"{'est s':>8}" if report["profile"] else ""
    header += f"{'x-node':>14}{'GB x-node':>10}" if report["nodes"] > 1 else ""
    lines += ["", "  " + header + "  notes"]
    for row in report["layouts"]:
        line = "".join(f"{row[d]:>5}" for d in DIMS) + f"{row['weights_gib_bf16']:>7.2f}{row['tflop']:>8.1f}"
        line += "".join(f"{row['sent_gb'][kind]:>11.3f}" for kind in KINDS)
        line += f"{sum(row['collectives'].values()):>7}"
        line += f"{row['seconds']['total']:>8.3f}" if report["profile"] else ""
        if report["nodes"] > 1:
            line += f"{'+'.join(row['crosses_nodes']) or '-':>14}{row['inter_node_gb']:>10.3f}"
        lines.append(f"  {line}  {', '.join(row['notes'])}".rstrip())
    used = sorted({note for row in report["layouts"] for note in row["notes"]})
    lines += ["", *(f"  {note}: {report['notes'][note]}" for note in used)]
    return "\n".join(lines)
