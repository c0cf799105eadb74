"""The benchmarks' charts (`bench memory`, `bench vae`), drawn with Pillow.

Pillow is already a dependency (the pipelines return PIL images); a dozen rectangles do not justify
adding matplotlib and its own dependencies for every user, so the chart is drawn by hand.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PANEL_W, PANEL_H = 300, 420
MARGIN_TOP, MARGIN_BOTTOM, AXIS_LEFT = 100, 40, 48
COLORS = {"stock": (214, 122, 61), "ours": (52, 110, 190), "limit": (20, 20, 20), "grid": (225, 225, 225)}


def _font(size: int):
    return ImageFont.load_default(size=size)


def _tick_step(top: float) -> float:
    """A 1/2/5 x 10^k step giving at most six gridlines up to `top`."""
    scale = 1.0
    while top / scale > 60:
        scale *= 10
    while top / scale < 6:
        scale /= 10
    return next(step * scale for step in (1, 2, 5, 10) if top / (step * scale) <= 6)


def _panel(draw: ImageDraw.ImageDraw, x0: int, rows: list[dict]) -> None:
    """One family: a group of (stock, ours) bars per TP degree, a black dash at total/N."""
    top = max(max(r["total_gib"], r["stock_gib"] or 0, r["ours_gib"] or 0) for r in rows) * 1.08
    plot_top, plot_bottom = MARGIN_TOP, PANEL_H - MARGIN_BOTTOM
    left, right = x0 + AXIS_LEFT, x0 + PANEL_W - 12

    def y(gib: float) -> float:
        return plot_bottom - gib / top * (plot_bottom - plot_top)

    step = _tick_step(top)
    tick = 0.0
    while tick <= top:
        draw.line([(left, y(tick)), (right, y(tick))], fill=COLORS["grid"])
        draw.text((left - 6, y(tick)), f"{tick:g}", fill="black", font=_font(12), anchor="rm")
        tick += step
    first = rows[0]
    stock_label = "" if first["stock_has_plan"] else " (stock: no plan)"
    draw.text(((left + right) / 2, plot_top - 28), f"{first['name']}{stock_label}", fill="black", font=_font(15),
              anchor="mm")
    draw.text(((left + right) / 2, plot_top - 10), f"{first['total_gib']:.1f} GiB bf16 in all", fill="black",
              font=_font(12), anchor="mm")

    group_w = (right - left) / len(rows)
    bar_w = group_w * 0.32
    for i, row in enumerate(rows):
        center = left + group_w * (i + 0.5)
        for offset, key in ((-1, "stock"), (0, "ours")):
            gib = row[f"{key}_gib"]
            if gib is not None:
                bx = center + offset * bar_w
                draw.rectangle([bx, y(gib), bx + bar_w, plot_bottom], fill=COLORS[key])
        limit_y = y(row["limit_gib"])
        draw.line([(center - bar_w * 1.3, limit_y), (center + bar_w * 1.3, limit_y)], fill=COLORS["limit"], width=3)
        draw.text((center, plot_bottom + 14), f"TP={row['tp']}", fill="black", font=_font(12), anchor="mm")
    draw.line([(left, plot_bottom), (right, plot_bottom)], fill="black")
    draw.line([(left, plot_top), (left, plot_bottom)], fill="black")


def _legend(draw: ImageDraw.ImageDraw) -> None:
    draw.text((12, 8), "Per-rank weights (GiB, bf16) at tensor-parallel degree N", fill="black", font=_font(16))
    x, y = 12, 40
    for key, label in (("stock", "stock plan"), ("ours", "our plan")):
        draw.rectangle([x, y - 7, x + 16, y + 7], fill=COLORS[key])
        draw.text((x + 22, y), label, fill="black", font=_font(13), anchor="lm")
        x += 110
    draw.line([(x, y), (x + 22, y)], fill=COLORS["limit"], width=3)
    draw.text((x + 28, y), "limit: total / N", fill="black", font=_font(13), anchor="lm")


def grouped_bars(rows: list[dict], path: Path) -> None:
    """Write a PNG with one panel per family (rows as `bench_memory.measure` returns them)."""
    families = list(dict.fromkeys(row["family"] for row in rows))
    image = Image.new("RGB", (PANEL_W * len(families), PANEL_H), "white")
    draw = ImageDraw.Draw(image)
    for i, family in enumerate(families):
        _panel(draw, i * PANEL_W, [row for row in rows if row["family"] == family])
    _legend(draw)
    image.save(path)


PAIR_COLORS = (COLORS["stock"], COLORS["ours"])


def _pair_panel(draw: ImageDraw.ImageDraw, x0: int, panel: dict) -> None:
    """One quantity: a pair of bars per group (`panel["groups"]`: (label, (first, second))), each bar labelled."""
    values = [value for _, pair in panel["groups"] for value in pair]
    top = max(values) * 1.12
    plot_top, plot_bottom = MARGIN_TOP, PANEL_H - MARGIN_BOTTOM
    left, right = x0 + AXIS_LEFT, x0 + PANEL_W - 12

    def y(value: float) -> float:
        return plot_bottom - value / top * (plot_bottom - plot_top)

    step, tick = _tick_step(top), 0.0
    while tick <= top:
        draw.line([(left, y(tick)), (right, y(tick))], fill=COLORS["grid"])
        draw.text((left - 6, y(tick)), f"{tick:g}", fill="black", font=_font(12), anchor="rm")
        tick += step
    draw.text(((left + right) / 2, plot_top - 28), panel["title"], fill="black", font=_font(15), anchor="mm")
    draw.text(((left + right) / 2, plot_top - 10), panel["unit"], fill="black", font=_font(12), anchor="mm")
    group_w = (right - left) / len(panel["groups"])
    bar_w = group_w * 0.36
    for i, (label, pair) in enumerate(panel["groups"]):
        center = left + group_w * (i + 0.5)
        for offset, value, color in zip((-1, 0), pair, PAIR_COLORS, strict=True):
            bx = center + offset * bar_w
            draw.rectangle([bx, y(value), bx + bar_w, plot_bottom], fill=color)
            draw.text((bx + bar_w / 2, y(value) - 2), f"{value:.0f}" if value >= 100 else f"{value:.3g}", fill="black",
                      font=_font(10), anchor="mb")
        if draw.textlength(label, font=_font(12)) > group_w - 4 and "-" in label:  # "Qwen-Image-2.1": two lines
            label = label.replace("-", "-\n", 1)
        draw.multiline_text((center, plot_bottom + 6), label, fill="black", font=_font(12), anchor="ma",
                            align="center")
    draw.line([(left, plot_bottom), (right, plot_bottom)], fill="black")
    draw.line([(left, plot_top), (left, plot_bottom)], fill="black")


def paired_bars(panels: list[dict], series: tuple[str, str], title: str, path: Path) -> None:
    """Write a PNG with one panel per quantity, each comparing two `series` (e.g. one rank, N ranks) per group.

    A panel is {"title", "unit", "groups": [(label, (first, second)), ...]}.
    """
    image = Image.new("RGB", (PANEL_W * len(panels), PANEL_H), "white")
    draw = ImageDraw.Draw(image)
    for i, panel in enumerate(panels):
        _pair_panel(draw, i * PANEL_W, panel)
    draw.text((12, 8), title, fill="black", font=_font(16))
    x, y = 12, 40
    for label, color in zip(series, PAIR_COLORS, strict=True):
        draw.rectangle([x, y - 7, x + 16, y + 7], fill=color)
        draw.text((x + 22, y), label, fill="black", font=_font(13), anchor="lm")
        x += 22 + int(draw.textlength(label, font=_font(13))) + 24
    image.save(path)
