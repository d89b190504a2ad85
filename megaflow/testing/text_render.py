"""Text drawn with Pillow on plain backgrounds: real images for the ``ocr`` reward's tests."""
from __future__ import annotations

from collections.abc import Callable

from PIL import Image, ImageDraw, ImageFont

SYSTEM_FONTS = ("DejaVuSans.ttf", "DejaVuSerif-Bold.ttf")


def text_fonts() -> dict[str, Callable[[int], ImageFont.FreeTypeFont]]:
    """name -> (size -> font): Pillow's built-in scalable font (Pillow >= 10.1), plus each of ``SYSTEM_FONTS``
    that ``ImageFont.truetype`` finds by file name in the system font folders."""
    out = {"pillow-default": lambda size: ImageFont.load_default(size=size)}
    for name in SYSTEM_FONTS:
        try:
            ImageFont.truetype(name, 12)
        except OSError:
            continue
        out[name] = lambda size, name=name: ImageFont.truetype(name, size)
    return out


def render_text(text: str, font, *, side: int = 256, fg=(0, 0, 0), bg=(255, 255, 255)) -> Image.Image:
    """``text`` centred on a plain ``side`` x ``side`` RGB background; ValueError when it does not fit."""
    img = Image.new("RGB", (side, side), bg)
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    if right - left > side - 8 or bottom - top > side - 8:
        raise ValueError(f"{text!r} does not fit in {side} x {side} at this font size")
    draw.text(((side - (right - left)) / 2 - left, (side - (bottom - top)) / 2 - top), text, font=font, fill=fg)
    return img
