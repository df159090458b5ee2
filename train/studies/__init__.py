"""The exact-ground-truth workflow studies: they generate data and nothing else.

Each study runs tabular policies on ``workflow`` tasks (exact values by dynamic
programming, trajectories through the real environment with the continuation
primitive of ``train.sampling.base``) and writes its data into one directory:
``study.json`` (kind, settings, run id, data file names) plus Parquet files and/or
a store. The reports are built from those files by ``analysis`` (``analysis.drift``,
``analysis.gates``, ``analysis.localization``); ``train.jobs`` runs both halves.

* ``drift``: exact credit drift and branch sensitivity across updates (``pairs.parquet``);
* ``gates``: the DSC / Gap / WIS / DR gates with refresh (``instances.parquet``,
  ``routes.parquet``, ``store/``);
* ``localization``: BEL against the exact first irrecoverable step (``store/``);
* ``constructions``: ELPO Fig. 3, trees of every sampler with credits, Mean@k and exact
  references (``store-<env>/``, ``exact-workflow.parquet``);
* ``recovery``: ELPO Fig. 1, recovery after fixing one step (``recovery.parquet``);
* ``sensitivity``, ``workflow_study``, ``estimates``: the shared machinery.

``rtrees study NAME`` (``train.jobs.STUDIES``) runs the seed papers' claims: ``dsc-l1``
(``drift``), ``elpo-fig3`` (``constructions``), ``dsc-table2`` (``gates``), ``elpo-fig1``
(``recovery``).
"""

# Upper bounds (inclusive) of the studies' size settings, by field name, checked in each
# config's ``__post_init__`` (``train.coerce.check_bounds``; a field a config lacks is
# skipped): far above every documented run, low enough that a typo (an extra zero or
# three) is refused at once instead of allocating for hours (issue 21). n_boot is at most
# 100,000 bootstrap resamples (issue 50 item 8). The report checks a study.json's settings
# against the same bounds (``analysis.report.STUDY_FILE_MAXIMA``, kept equal by a test).
STUDY_MAXIMA: dict[str, int] = {
    "n_tasks": 10_000, "calc_tasks": 10_000, "n_dev": 10_000, "n_calib": 10_000,
    "n_eval": 10_000, "n_old": 100_000, "n_boot": 100_000, "k": 10_000, "n_total": 4_096,
    "max_new_tokens": 32_768, "sgls_max_new_tokens": 32_768, "resamples": 10_000,
    "failures_per_task": 1_000, "max_attempts": 100_000, "repeats": 1_000,
    "n_initial": 4_096, "max_probes": 4_096, "cap_steps": 10_000_000, "refresh_batch": 4_096,
    "steps": 1_000_000, "tasks_per_step": 4_096, "heldout_tasks": 10_000,
    "eval_every": 1_000_000}
