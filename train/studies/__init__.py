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
