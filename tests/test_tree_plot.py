"""``analysis.tree_plot.draw_tree`` on a real hand-made tree: one marker per node, leaf
labels carry the rewards, credits colour the nodes, the critical node is ringed, and
the figure saves as a PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pytest
from credit_helpers import node

from analysis.tree_plot import draw_tree, tree_layout
from rollout_store.tree import Tree

matplotlib.use("Agg")


def _tree() -> Tree:
    """root 0 -> {1, 2}; 1 -> leaves 3 (r=1), 4 (r=0); 2 -> 5 -> leaf 6 (r=0.25);
    node ids listed out of order on purpose."""
    nodes = [node(6, 5, reward=0.25), node(0, None), node(3, 1, reward=1.0), node(1, 0),
             node(4, 1, reward=0.0), node(2, 0), node(5, 2)]
    tree = Tree("t-plot", nodes, task_id="task")
    tree.validate()
    return tree


def _artist(fig: matplotlib.figure.Figure, gid: str) -> list[object]:
    return [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == gid]


def test_layout_centres_parents_over_children() -> None:
    pos = tree_layout(_tree())
    # leaves in preorder: 3, 4, 6 at x = 0, 1, 2; y = -depth
    assert pos[3] == (0.0, -2.0) and pos[4] == (1.0, -2.0) and pos[6] == (2.0, -3.0)
    assert pos[1] == (0.5, -1.0) and pos[5] == (2.0, -2.0) and pos[2] == (2.0, -1.0)
    assert pos[0] == (1.25, 0.0)


def test_draw_tree_markers_labels_critical_png(tmp_path: Path) -> None:
    tree = _tree()
    credits = {0: 0.0, 1: 0.5, 2: -0.5, 3: 1.0, 4: -1.0, 5: -0.5, 6: -0.5}
    fig = draw_tree(tree, credits=credits, critical=2, title="hand tree")

    (nodes,) = _artist(fig, "nodes")
    assert len(nodes.get_offsets()) == len(tree.nodes)  # type: ignore[attr-defined]
    leaf_labels = sorted(t.get_text() for t in _artist(fig, "leaf-label"))  # type: ignore[attr-defined]
    assert leaf_labels == ["r=0", "r=0.25", "r=1"]
    credit_labels = [t.get_text() for t in _artist(fig, "credit-label")]  # type: ignore[attr-defined]
    assert len(credit_labels) == len(tree.nodes) and "-0.5" in credit_labels

    # colours follow the diverging scale: the +1 leaf is red-ish, the -1 leaf blue-ish,
    # the 0 root near white (preorder: 0, 1, 3, 4, 2, 5, 6)
    face = nodes.get_facecolors()  # type: ignore[attr-defined]
    order = [n.node_id for n in tree.preorder()]
    pos_leaf, neg_leaf, root = (face[order.index(i)] for i in (3, 4, 0))
    assert pos_leaf[0] > pos_leaf[2] and neg_leaf[2] > neg_leaf[0]
    assert np.all(root[:3] > 0.9)
    assert len(fig.axes) == 2  # the tree and its colorbar

    (ring,) = _artist(fig, "critical")
    x, y = ring.get_offsets()[0]  # type: ignore[attr-defined]
    assert (float(x), float(y)) == tree_layout(tree)[2]
    assert fig.axes[0].get_title() == "hand tree"

    path = tmp_path / "tree.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_draw_tree_without_credits_into_given_axes() -> None:
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    out = draw_tree(_tree(), ax=ax)
    assert out is fig and len(fig.axes) == 1  # no colorbar without credits
    assert not _artist(fig, "critical") and not _artist(fig, "credit-label")
    assert ax.get_title() == "tree t-plot"


def test_draw_tree_unknown_critical_node() -> None:
    with pytest.raises(KeyError, match="no node 99"):
        draw_tree(_tree(), critical=99)
