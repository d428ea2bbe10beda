"""Icicle flame graphs (root at the top) of bytes per stack, as inline SVG.

Frames are merged by (function, module) along the path from the outermost frame, as in classic
flame graphs; a frame's width is the bytes of all stacks through it.
"""

from __future__ import annotations

import html
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from markupsafe import Markup

from analysis.frames import Stacks
from sampler.units import fmt_bytes

Frame = tuple[str, str]          # (function, or module+address when unsymbolized; module)

ROW = 18                         # px per frame row
CHAR = 6.6                       # px per character of the 11 px monospace labels
MIN_PX = 0.3                     # narrower frames are not drawn (they would only bloat the file)


@dataclass
class Node:
    function: str
    module: str
    value: float = 0.0
    children: dict[Frame, Node] = field(default_factory=dict)


@dataclass
class Rect:
    x: float                     # fraction of the root's width, 0..1
    w: float
    depth: int                   # 0 = root
    node: Node


def build_tree(stacks: Iterable[tuple[list[Frame], float]], root_name: str = "all") -> Node:
    """Merge (frames outermost first, bytes) pairs into a tree; non-positive bytes are left out."""
    root = Node(root_name, "")
    for frames, value in stacks:
        if not value > 0:
            continue
        root.value += value
        node = root
        for fr in frames:
            node = node.children.setdefault(fr, Node(*fr))
            node.value += value
    return root


def layout(root: Node, min_fraction: float = 0.0) -> list[Rect]:
    """Rectangles of the tree, parents before children; children sorted by bytes, left-aligned
    in their parent (the gap on the right is the parent's own bytes)."""
    if root.value <= 0:
        return []
    rects: list[Rect] = []
    todo = [(root, 0.0, 0)]
    while todo:
        node, x, depth = todo.pop()
        w = node.value / root.value
        if w < min_fraction:
            continue
        rects.append(Rect(x, w, depth, node))
        for child in sorted(node.children.values(), key=lambda c: -c.value):
            todo.append((child, x, depth + 1))
            x += child.value / root.value
    rects.sort(key=lambda r: (r.depth, r.x))
    return rects


def frame_key(f: dict[str, Any]) -> Frame:
    """How a frame is named in the graph: its function, else module+address."""
    fn, off, module = f.get("function"), f.get("offset"), str(f.get("module") or "?")
    if isinstance(fn, str) and fn:
        return fn, module
    return (f"{module}+{int(off):#x}" if off is not None else f"{module}+?"), module


def tree_from_values(values: pd.Series, stacks: Stacks, root_name: str) -> Node:
    """Tree of bytes per stack (`values` indexed by stack_id, `stacks` from analysis.frames.stack_frames); stacks
    without frames go under one `[no stack]` frame so that the total stays right."""
    def path(sid: int) -> list[Frame]:
        frames = stacks.get(int(sid))
        return [frame_key(f) for f in reversed(frames)] if frames else [("[no stack]", "")]
    return build_tree(((path(sid), float(v)) for sid, v in values.items()), root_name)


def _color(node: Node, growth: bool) -> str:
    if node.module == "":
        return "#c8c8c8"
    # hue from the module (frames of one library look alike), lightness from the function
    h = zlib.crc32(node.module.encode())
    v = zlib.crc32(node.function.encode())
    hue = h % 30 + (0 if growth else 25)          # reds/oranges for growth, oranges/yellows otherwise
    return f"hsl({hue},{70 + v % 20}%,{58 + (v >> 8) % 14}%)"


def label_for(text: str, width_px: float) -> str:
    """The label that fits in a frame `width_px` wide (JS zoom does the same)."""
    n = int((width_px - 6) / CHAR)
    if n < 3:
        return ""
    return text if len(text) <= n else text[: n - 1] + "…"


def render_svg(root: Node, *, width: int = 1160, growth: bool = False, what: str = "outstanding") -> Markup:
    """The flame graph as an <svg>; click a frame to zoom (script in the report), the root to reset.
    Markup: every text in it is escaped here, so templates insert it as it is."""
    rects = layout(root, MIN_PX / width)
    if not rects:
        return Markup('<p class="empty">nothing to show</p>')
    depth = max(r.depth for r in rects) + 1
    height = depth * ROW + 2
    parts = [f'<svg class="flame" viewBox="0 0 {width} {height}" width="100%" data-w="{width}" '
             f'role="img" aria-label="flame graph of {html.escape(what)} bytes">']
    for r in rects:
        n = r.node
        name = n.function if not n.module else f"{n.function} ({n.module})"
        tip = f"{name}\n{fmt_bytes(n.value)} {what}, {100 * n.value / root.value:.1f}% of {fmt_bytes(root.value)}"
        if r.depth == 0:
            tip = f"{n.function}: {fmt_bytes(n.value)} {what}"
        x, w, y = r.x * width, r.w * width, r.depth * ROW
        parts.append(
            f'<g class="fr" data-x="{x:.2f}" data-w="{w:.2f}" data-d="{r.depth}" data-l="{html.escape(n.function)}">'
            f'<title>{html.escape(tip)}</title>'
            f'<rect x="{x:.2f}" y="{y}" width="{max(w - 0.5, 0.1):.2f}" height="{ROW - 1}" '
            f'fill="{_color(n, growth)}" rx="1.5"/>'
            f'<text x="{x + 3:.2f}" y="{y + ROW - 5}">{html.escape(label_for(n.function, w))}</text></g>')
    parts.append("</svg>")
    return Markup("".join(parts))
