"""The mask plan as a picture: a ranks x units grid, rank and unit names, owner counts in the title.

Drawn with Pillow (which torchvision already needs), not matplotlib: importing and drawing with
matplotlib cost rank 0 about 0.43 s of CPU at the start of every run, inside the first step every
other rank waits for (measured, one process, one thread); Pillow draws the same grid in about 15 ms.
TensorBoard shows it as an image (``plan/ownership``); ``subnetdp plan --png`` writes it to a file.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

CELL = 14  # pixels of one (rank, unit) cell
PAD = 6
EMPTY, OWNED, GRID = np.array([247, 251, 255]), np.array([8, 48, 107]), (200, 200, 200)  # matplotlib's "Blues" ends


def plan_picture(owned_image: np.ndarray, unit_names: Sequence[str], counts: Sequence[int]) -> Any:
    """A ranks x units heat map of the mask plan (``MaskPlan.as_image()``), as a ``PIL.Image`` (RGB)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    ranks, units = owned_image.shape
    row_names = [f"rank {r}" for r in range(ranks)]
    title = f"mask plan (owners per unit: {min(counts)}..{max(counts)})"

    def width(text: str) -> int:
        left, _, right, _ = font.getbbox(text)
        return int(right - left) + 1

    text_h = max(font.getbbox("Ag")[3] - font.getbbox("Ag")[1], 8) + 2
    left = max(width(n) for n in row_names) + 2 * PAD
    top = text_h + 2 * PAD
    below = max((width(n) for n in unit_names), default=0) + 2 * PAD
    w = max(left + units * CELL + PAD, width(title) + 2 * PAD)
    img = Image.new("RGB", (w, top + ranks * CELL + below), "white")
    draw = ImageDraw.Draw(img)
    draw.text((PAD, PAD), title, fill="black", font=font)
    shade = (EMPTY + np.clip(owned_image, 0, 1)[..., None] * (OWNED - EMPTY)).round().astype(np.uint8)
    cells = np.repeat(np.repeat(shade, CELL, axis=0), CELL, axis=1)
    img.paste(Image.fromarray(cells, "RGB"), (left, top))
    for r in range(ranks + 1):
        draw.line([(left, top + r * CELL), (left + units * CELL, top + r * CELL)], fill=GRID)
    for u in range(units + 1):
        draw.line([(left + u * CELL, top), (left + u * CELL, top + ranks * CELL)], fill=GRID)
    for r, name in enumerate(row_names):
        draw.text((PAD, top + r * CELL + (CELL - text_h) // 2), name, fill="black", font=font)
    for u, name in enumerate(unit_names):  # each unit's name reads upwards below its column
        label = Image.new("RGB", (width(name), text_h), "white")
        ImageDraw.Draw(label).text((0, 0), name, fill="black", font=font)
        turned = label.rotate(90, expand=True)
        img.paste(turned, (left + u * CELL + (CELL - turned.width) // 2, top + ranks * CELL + PAD))
    return img
