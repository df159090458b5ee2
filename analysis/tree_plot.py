"""Draw one rollout tree: its shape, leaf rewards, per-node credit and BEL's critical step.

``draw_tree`` lays a ``rollout_store.tree.Tree`` out top-down: the root at the top,
depth ``d`` at ``y = -d``; leaves sit at ``x = 0, 1, 2, ...`` in preorder (children by
ascending id) and every inner node is centred over its children,
``x(v) = (min_c x(c) + max_c x(c)) / 2``. Edges go parent -> child. Each leaf is
labelled ``r=<reward>``; with ``credits`` (node id -> value, e.g. a node's advantage)
every node is coloured on a diverging colormap centred at 0 (colorbar beside) and
labelled with its value. The ``critical`` node (a tree's ``critical_node_id``: BEL's
first irrecoverable step, METHODS E1-E2) gets a thick ring.

The drawing is made with ``matplotlib.figure.Figure`` (no pyplot, no display: safe on
the Agg backend and in worker processes); matplotlib is imported when first used, so
``analysis`` imports without it. Artists carry gids for tests and callers: ``nodes``
(one scatter offset per node, in ``Tree.preorder`` order), ``edges``, ``critical``,
and ``leaf-label`` / ``credit-label`` texts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollout_store.tree import Tree

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NO_CREDIT_COLOR = "#d9d9d9"  # nodes without a credit value (or drawn without credits)
CRITICAL_COLOR = "#ff7f0e"


def tree_layout(tree: Tree) -> dict[int, tuple[float, float]]:
    """(x, y) of every node id: ``y = -depth``; leaves at consecutive integers in
    preorder, parents at the midpoint of their outermost children (iterative walk)."""
    kids = tree.children()
    order = list(tree.preorder())
    depth: dict[int, int] = {}
    for n in order:  # preorder: a parent comes before its children
        depth[n.node_id] = 0 if n.parent_id is None else depth[n.parent_id] + 1
    xs: dict[int, float] = {}
    next_leaf = 0
    for n in order:
        if not kids[n.node_id]:
            xs[n.node_id] = float(next_leaf)
            next_leaf += 1
    for n in reversed(order):  # children before parents
        ch = kids[n.node_id]
        if ch:
            xs[n.node_id] = (min(xs[c] for c in ch) + max(xs[c] for c in ch)) / 2.0
    return {nid: (xs[nid], -float(depth[nid])) for nid in xs}


def _fmt(value: float) -> str:
    """3 significant digits; float noise around 0 (|v| < 1e-9, e.g. a centred mean) is 0."""
    if not math.isfinite(value):
        return str(value)
    return "0" if abs(value) < 1e-9 else f"{value:.3g}"


def draw_tree(tree: Tree, credits: Mapping[int, float] | None = None,
              critical: int | None = None, ax: Axes | None = None,
              title: str = "") -> Figure:
    """Draw ``tree`` into ``ax`` (a new figure when None) and return the figure.

    ``credits`` maps node ids to a credit value (missing or NaN: grey, unlabelled);
    the colour scale is symmetric, ``[-m, m]`` with ``m = max |credit|`` (1 when all
    are 0). ``critical`` is a node id to ring; an id not in the tree is a
    ``KeyError`` naming it.
    """
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    pos = tree_layout(tree)
    if critical is not None and critical not in pos:
        raise KeyError(f"tree {tree.tree_id!r} has no node {critical} (critical)")
    order = [n.node_id for n in tree.preorder()]
    kids = tree.children()
    if ax is None:
        n_leaves = sum(1 for nid in order if not kids[nid])
        depth = int(-min(y for _, y in pos.values()))
        fig = Figure(figsize=(min(max(4.0, 0.9 * n_leaves + 2.0), 30.0),
                              min(max(3.0, 0.9 * (depth + 1) + 1.0), 20.0)))
        ax = fig.add_subplot()
    fig_out = ax.get_figure()
    assert isinstance(fig_out, Figure)

    segments = [[pos[n.parent_id], pos[n.node_id]] for n in tree.nodes
                if n.parent_id is not None]
    ax.add_collection(LineCollection(segments, colors="#808080", linewidths=1.0, zorder=1,
                                     gid="edges"))

    values = {nid: float(v) for nid, v in (credits or {}).items()
              if nid in pos and v is not None and math.isfinite(float(v))}
    half = max((abs(v) for v in values.values()), default=0.0) or 1.0
    norm = Normalize(vmin=-half, vmax=half)  # symmetric: 0 is the colormap's centre
    cmap = colormaps["RdBu_r"]
    colors = [cmap(norm(values[nid])) if nid in values else NO_CREDIT_COLOR
              for nid in order]
    ax.scatter([pos[nid][0] for nid in order], [pos[nid][1] for nid in order], s=160,
               c=colors, edgecolors="black", linewidths=0.6, zorder=3, gid="nodes")
    if credits is not None:
        from matplotlib.cm import ScalarMappable

        fig_out.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.8,
                         label="credit")
        for nid in order:
            if nid in values:
                x, y = pos[nid]
                ax.annotate(_fmt(values[nid]), (x, y), xytext=(9, 4),
                            textcoords="offset points", fontsize=7, gid="credit-label")

    by_id = {n.node_id: n for n in tree.nodes}
    for nid in order:
        if kids[nid]:
            continue
        reward = by_id[nid].reward
        x, y = pos[nid]
        ax.annotate("r=?" if reward is None else f"r={_fmt(reward)}", (x, y),
                    xytext=(0, -14), textcoords="offset points", ha="center", va="top",
                    fontsize=8, gid="leaf-label")

    handles = []
    if critical is not None:
        x, y = pos[critical]
        ax.scatter([x], [y], s=420, facecolors="none", edgecolors=CRITICAL_COLOR,
                   linewidths=2.5, zorder=4, gid="critical")
        handles.append(Line2D([], [], marker="o", linestyle="none", markersize=11,
                              markerfacecolor="none", markeredgecolor=CRITICAL_COLOR,
                              markeredgewidth=2.5, label=f"critical step (node {critical})"))
        ax.legend(handles=handles, loc="best", fontsize=7, frameon=False)

    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(min(ys) - 0.9, max(ys) + 0.6)
    ax.set_xticks([])
    ax.set_yticks([-d for d in range(int(-min(ys)) + 1)])
    ax.set_yticklabels([str(d) for d in range(int(-min(ys)) + 1)])
    ax.set_ylabel("depth")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"tree {tree.tree_id}", fontsize=9)
    return fig_out
