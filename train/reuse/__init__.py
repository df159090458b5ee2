"""Training from stored plus fresh trees: reuse, transport or refresh historical credit
(issue 12; the method is docs/METHODS.md section 9). One concern per module:

* ``params``: ``ReuseParams`` (nesting the gate's ``DSCGateParams``) and the rule names
  (the only module ``train.config`` imports);
* ``select``: which stored trees an iteration trains on, and why others are skipped;
* ``resolve``: pure comparisons, resolutions and ``RULES``, the registry of named rules;
* ``score``: log pi_prox of stored actions (a no-grad forward, D3);
* ``calibrate``: the D7 calibration of the gate's kappas;
* ``refresh``: refresh draws from stored snapshots and the trees they make;
* ``runfiles``: ``OUT/reuse_params.json`` and ``OUT/reuse.jsonl``;
* ``stage``: ``make_reuse`` / ``ReuseStage``, the one object the trainer calls.

Names are resolved lazily (``from train.reuse import ReuseParams`` loads only the module
that defines it), so importing ``train.reuse.params`` pulls in no torch, store or envs.
"""

from __future__ import annotations

from rollout_store.lazy import lazy_face

_WHERE = {
    ".params": ("CALIB_FRAC", "GATE_FIELDS", "REUSE_MODES", "ReuseError", "ReuseMode",
               "ReuseParams"),
    ".select": ("SKIP_REASONS", "Selection", "check_reuse", "in_calib_split", "policy_step",
               "reuse_filter", "select_stored", "split_hash", "tree_problem"),
    ".resolve": ("DECISIONS", "RULES", "Comparison", "Decision", "Resolution", "Rule",
                "dsc_extras", "get_rule", "resolve_tree", "tool_steps", "with_returns"),
    ".score": ("score_actions",),
    ".calibrate": ("calibrate_gate", "gate_params"),
    ".refresh": ("Refreshed", "engine_for", "has_snapshot", "refresh_routes", "refresh_trees"),
    ".runfiles": ("log_line", "read_record", "write_params"),
    ".stage": ("ReuseStage", "StoredBatch", "StoredStep", "interp_prox", "m2po_mask",
              "make_reuse", "rename_method", "resolve_stored"),
}
__getattr__, __all__ = lazy_face("train.reuse", _WHERE)
