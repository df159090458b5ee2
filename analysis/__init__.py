"""analysis: read-only audits and reports over a store (it never samples or trains).

The public entry points, importable from here (``from analysis import ranking_audit``);
each is resolved lazily from the module path in ``_WHERE``, so ``import analysis`` loads
nothing else and a module that moves needs only its line here changed. The audit of
stored credits against Mean@K references is ``ranking_audit`` (references are sampled by
``train.collect_references``; ``train.ranking_job`` runs both and writes the report).
"""

from __future__ import annotations

from rollout_store.lazy import lazy_face

_WHERE = {
    "analysis.ranking": ("RankingConfig", "RankingError", "RankingResult", "ranking_audit"),
    "analysis.ranking_report": ("build_ranking_reports", "write_ranking_report"),
    "analysis.stats": ("Estimate", "MethodStatistics", "RankingStatistics"),
    "analysis.tree_plot": ("draw_tree",),
    "analysis.viewer": ("ViewerData", "ViewerServer", "serve", "start"),
}
__getattr__, __all__ = lazy_face("analysis", _WHERE)
