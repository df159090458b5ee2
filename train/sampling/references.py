"""Mean@K references: the collection job behind the ranking audit (METHODS.md §2.4).

For every child c of a branching node (a node with two or more children) the
reference q(c) is the success rate of k fresh rollouts continued from c. This
job samples them and commits one ``mc_references`` row per child
(``tree_id, node_id, k, successes, policy_version``); ``analysis.ranking`` reads
them, never running anything itself (docs/architecture.md).

One reference, for a child c of a stored tree:

* every rollout is the continuation primitive of ``train.sampling.base``
  (``NodeStart.begin`` / ``Continuing``): the environment is restored from c's
  snapshot (the state right after c's step; ``snapshots`` table, zstd +
  sha256-checked, read by ``load_starts``), once per rollout, and when the
  environment has ``reseed(key)`` it is called before each rollout with a key
  derived from the job's seed and the rollout index, so the k rollouts draw
  independent tool outcomes. [R] The key is salted (``mix_seed(seed,
  "mc-reference", i)``) rather than ``i`` itself, so that reference rollouts
  never replay the outcome streams a sampler used for the tree's own branches;
* the policy continues the transcript of the root-to-c path: the root's
  observation is the prompt, then each node's ``action_text`` and
  ``observation_text`` (``train.policies.base`` turns). Each child is a program
  of the rollout engine (``reference_program``, ``train.sampling.engine``), so the
  decode steps of every child in flight are batched together: the first step of
  its k rollouts is one request with ``n = k`` (a shared prefix), later steps one
  round over its live rollouts in which rollouts with equal transcripts share one
  request with ``n`` = their count (the same i.i.d. draws, the prefix encoded
  once; about half the later rounds' prompt tokens on calc); every request's rows
  draw from streams keyed by (seed, child, round, rollout), so a reference does
  not depend on which children shared its batches;
* a rollout ends when the environment says ``done`` or when the tree's step
  limit is reached (``base.step_limit``: ``max_steps`` (config), else
  ``trees.env_config.max_steps``, else ``horizon`` in the task config, else
  ``DEFAULT_MAX_STEPS``); c's depth counts against it. Success is a final reward
  >= ``success_threshold`` (default 1.0); a cut rollout fails;
* a child that is itself a leaf (it has a reward) needs no rollouts: its k
  rollouts would all end where it ended, so successes = k or 0. A batch of leaf
  children only (a GRPO group logged by a trainer, ``rollout_store.logger``) loads no
  policy and no environment, so trees without a ``policy_ref`` are audited too.

The policy is, per tree, the one that produced it (``trees.policy_ref`` loaded
with ``train.policies.load_policy(ref, env)``; its ``policy_version`` must equal
``trees.policy_version``) unless the caller names another (a ``Policy``, a spec
string, or a factory ``env name -> Policy``). The row's ``policy_version`` is the
version of the policy that sampled it.

Reuse and idempotency: a child is *missing* when no ``mc_references`` row has its
(tree_id, node_id), this k and the target policy version; only missing children
are sampled, so a rerun commits nothing. [R] The table records neither the seed
nor the success threshold, so a rerun with another seed or threshold reuses what
is stored (sample under another k, or another store, to compare thresholds). Children are committed
``commit_children`` at a time under the key ``mcref:<digest of the settings>:
<digest of the (tree, node) ids>``, so a retried commit stores once.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from rollout_store.reader import connect
from rollout_store.schema import MC_REFERENCES
from rollout_store.store import Store, now_utc
from train.envs import Environment, make_env
from train.policies.base import Policy, Rows, SampleConfig, Turn
from train.sampling.base import mix_seed
from train.sampling.collect import PolicySpec, progress_bar, resolve_policy
from train.sampling.continuation import (
    DEFAULT_MAX_STEPS,
    ContinuationError,
    Continuing,
    NodeStart,
    load_starts,
)
from train.sampling.engine import Decode, Engine, Request, Work

if TYPE_CHECKING:
    import duckdb

Start = NodeStart  # the name this module used before the primitive moved out of it


_MASK62 = (1 << 62) - 1


class ReferenceJobError(ContinuationError):
    """References cannot be sampled as asked (no snapshot, no policy, version mismatch)."""


@dataclass(frozen=True)
class ReferenceConfig:
    """How references are sampled."""

    k: int = 32
    """Rollouts per child (``mc_references.k``)."""
    success_threshold: float = 1.0
    """A rollout succeeds when its final reward is >= this."""
    max_steps: int | None = None
    """Step limit of an episode (depth included); None: the tree's recorded limit."""
    max_new_tokens: int = 128
    """Token cap of one agent step (``SampleConfig.max_new_tokens``)."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 samples the policy itself."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 samples the policy itself."""
    max_parallel: int = 512
    """Rollouts stepped together (environment instances held, policy batch size); a
    chunk holds max(1, max_parallel // k) children."""
    commit_children: int = 256
    """Children per commit (an interrupted job resumes after the last commit)."""
    seed: int = 0
    """Seeds the policy's sampling and the environments' outcome streams."""
    run_id: str | None = None
    """``mc_references.run_id``; default ``mcref-k{k}-s{seed}``."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_parallel < 1 or self.commit_children < 1:
            raise ValueError("max_parallel and commit_children must be >= 1")
        SampleConfig(n=self.k, max_new_tokens=self.max_new_tokens,
                     temperature=self.temperature, top_p=self.top_p)  # same checks

    def digest(self) -> str:
        """Hash of every setting that changes the sampled values."""
        keep = {k: v for k, v in asdict(self).items()
                if k not in ("max_parallel", "commit_children", "run_id")}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class ReferenceReport:
    """What a reference job did."""

    k: int
    children: int = 0  # children of branching nodes in scope
    reused: int = 0  # already had a reference at this k and policy version
    sampled: int = 0  # children whose references were sampled now
    leaves: int = 0  # of those, leaf children (no rollouts needed)
    rollouts: int = 0
    env_steps: int = 0
    policy_calls: int = 0
    commits: int = 0
    seconds: float = 0.0
    versions: dict[str, str | None] = field(default_factory=dict)  # env -> policy version

    def summary(self) -> str:
        return (f"references k={self.k}: {self.sampled} children sampled ({self.rollouts:,} "
                f"rollouts, {self.env_steps:,} env steps, {self.leaves} leaf children), "
                f"{self.reused} reused, {self.commits} commits in {self.seconds:.1f} s")


# ----- which children ----------------------------------------------------------------------


def _missing_sql(own: bool, scoped: bool) -> str:
    target = "t.policy_version" if own else "v.version"
    join = "" if own else "JOIN _ref_versions v ON v.env = t.env"
    scope = "SEMI JOIN _ref_scope USING (tree_id)" if scoped else ""
    return f"""
        WITH kids AS (SELECT tree_id, parent_id, node_id FROM nodes WHERE parent_id IS NOT NULL),
        prefixes AS (SELECT tree_id, parent_id FROM kids GROUP BY tree_id, parent_id
                     HAVING count(*) >= 2),
        children AS (
            SELECT k.tree_id, k.node_id, t.env, t.env_config, t.policy_ref,
                   t.policy_version, {target} AS target
            FROM kids k JOIN prefixes USING (tree_id, parent_id)
            JOIN trees t USING (tree_id) {join} {scope})
        SELECT c.*, EXISTS (SELECT 1 FROM mc_references r
                            WHERE r.tree_id = c.tree_id AND r.node_id = c.node_id
                              AND r.k = $k
                              AND r.policy_version IS NOT DISTINCT FROM c.target) AS have
        FROM children c
        ORDER BY c.env, c.policy_ref, c.target, c.tree_id, c.node_id"""


def reference_children(con: duckdb.DuckDBPyConnection, k: int,
                       versions: dict[str, str | None] | None = None,
                       tree_ids: Sequence[str] | None = None) -> pa.Table:
    """Every child of a branching node with its tree's env, policy and target version, and
    ``have`` (a reference exists at ``k`` for the target version). ``versions`` maps env
    names to a named policy's version; None targets each tree's own version."""
    if versions is not None:
        con.register("_ref_versions", pa.table({
            "env": pa.array(list(versions), pa.string()),
            "version": pa.array(list(versions.values()), pa.string())}))
    if tree_ids is not None:
        con.register("_ref_scope", pa.table({"tree_id": pa.array(list(tree_ids), pa.string())}))
    table = con.sql(_missing_sql(versions is None, tree_ids is not None),
                    params={"k": int(k)}).to_arrow_table()
    assert table is not None
    return table


# ----- sampling ----------------------------------------------------------------------------


@dataclass
class _Counters:
    rollouts: int = 0
    env_steps: int = 0
    policy_calls: int = 0


def run_references(policy: Policy, env_factory: Callable[[], Environment],
                   starts: Sequence[NodeStart], config: ReferenceConfig,
                   counters: _Counters | None = None,
                   on_chunk: Callable[[int], None] | None = None) -> list[int]:
    """Successes out of ``config.k`` rollouts from each start (see the module docstring).

    Works with any ``Policy`` and any environment with exact ``restore``; every start
    is a ``reference_program``, and the engine keeps max(1, ``max_parallel`` // k) of
    them in flight (k environments each, from ``env_factory``), with at most
    ``max_parallel`` rows per policy call. ``on_chunk(n)`` is called as ``n`` starts
    are done.
    """
    counters = counters or _Counters()
    k, thr = config.k, config.success_threshold
    successes = [0] * len(starts)
    todo = []
    for i, s in enumerate(starts):
        if s.leaf_reward is not None:
            successes[i] = k if s.leaf_reward >= thr else 0
        elif s.steps_left <= 0:
            successes[i] = 0  # the step limit is already reached: every rollout is cut
        else:
            todo.append(i)
    if len(todo) < len(starts) and on_chunk is not None:
        on_chunk(len(starts) - len(todo))
    # Whole calls, not the continuous decoder: k rollouts of one start advance in
    # lockstep rounds of similar lengths, which whole calls (sorted by prompt length)
    # decode in narrow batches; measured on 12 demo BEL trees (205 children, k 32): 21.5 /
    # 24.4 s whole-call against 26.2 / 29.6 s continuous.
    engine = Engine(policy, max_rows=config.max_parallel,
                    max_programs=max(1, config.max_parallel // k), continuous=False)

    def done(j: int, wins: int) -> None:
        successes[todo[j]] = wins
        if on_chunk is not None:
            on_chunk(1)

    engine.run([partial(reference_program, starts[i], env_factory, config, counters)
                for i in todo], on_done=done)
    return successes


def reference_program(start: NodeStart, env_factory: Callable[[], Environment],
                      config: ReferenceConfig, counters: _Counters
                      ) -> Generator[Request, Any, int]:
    """The k rollouts from one start (a program of ``train.sampling.engine``): the first
    step one request with n = k (a shared prefix), then one round over the live rollouts
    in which rollouts with equal transcripts share one request with n = their count (the
    same i.i.d. draws, the prefix encoded once). Each rollout has its own environment
    (made in the engine's pool, closed at the end). Row seeds are keyed by (job seed,
    start, round, first rollout of the request); returns the successes."""
    k = config.k
    anchor = f"{start.tree_id}/{start.node_id}"
    sample = SampleConfig(max_new_tokens=config.max_new_tokens,
                          temperature=config.temperature, top_p=config.top_p)
    envs: list[Environment] = []
    try:
        def begin() -> list[Continuing]:
            for _ in range(k):
                envs.append(env_factory())
            return [start.begin(env, mix_seed(config.seed, "mc-reference", i))
                    for i, env in enumerate(envs)]

        runs: list[Continuing] = yield Work(begin)
        counters.rollouts += k
        live = list(range(k))
        wins = 0
        step = 0
        while live:
            groups: dict[tuple[Turn, ...], list[int]] = {}
            for r in live:
                groups.setdefault(tuple(runs[r].turns), []).append(r)
            counters.policy_calls += 1
            got = yield Decode([Rows(key, len(rows), mix_seed(
                config.seed, "mc-reference", anchor, step, rows[0]) & _MASK62)
                for key, rows in groups.items()], sample)
            actions = {r: c.text for rows, conts in zip(groups.values(), got, strict=True)
                       for r, c in zip(rows, conts, strict=True)}

            def step_all(live: list[int] = live, actions: dict[int, str] = actions) -> None:
                for r in live:
                    runs[r].step(actions[r])

            yield Work(step_all, lag=sum(runs[r].env.tool_lag for r in live))
            counters.env_steps += len(live)
            still = []
            for r in live:
                if runs[r].done:
                    wins += int(runs[r].reward >= config.success_threshold)
                elif not runs[r].at_limit:  # else: cut at the step limit, a failure
                    still.append(r)
            live = still
            step += 1
        return wins
    finally:
        for env in envs:
            env.close()


# ----- the job -----------------------------------------------------------------------------


def _named_policies(con: duckdb.DuckDBPyConnection, policy: PolicySpec) -> dict[str, Policy]:
    envs = [r[0] for r in con.sql("SELECT DISTINCT env FROM trees ORDER BY env").fetchall()]
    return {env: resolve_policy(policy, env) for env in envs}


def policy_versions(store: Store, policy: PolicySpec) -> dict[str, str]:
    """The version ``policy`` has for each environment of the store's trees (the
    ``mc_references.policy_version`` its references carry)."""
    return {env: str(p.policy_version) for env, p in _named_policies(connect(store),
                                                                      policy).items()}


def _batches(table: pa.Table, size: int) -> Iterator[pa.Table]:
    """Slices of ``table`` of ``size`` rows that never mix (env, policy_ref, target)."""
    if table.num_rows == 0:
        return
    cols = [table.column(c).to_pylist() for c in ("env", "policy_ref", "target")]
    keys = list(zip(*cols, strict=True))
    start = 0
    for i in range(1, table.num_rows + 1):
        if i == table.num_rows or keys[i] != keys[start] or i - start >= size:
            yield table.slice(start, i - start)
            start = i


def commit_key(config: ReferenceConfig, version: str | None, children: pa.Table) -> str:
    """Idempotency key of one commit: the settings, the version, the (tree, node) ids."""
    ids = sorted(f"{t}\t{n}" for t, n in zip(children.column("tree_id").to_pylist(),
                                              children.column("node_id").to_pylist(),
                                              strict=True))
    digest = hashlib.sha256(("\n".join(ids) + f"\n{version}").encode()).hexdigest()[:32]
    return f"mcref:{config.digest()}:{digest}"


def reference_rows(children: pa.Table, successes: Sequence[int], config: ReferenceConfig,
                   version: str | None) -> pa.Table:
    n = children.num_rows
    return pa.table({
        "run_id": pa.array([config.run_id or f"mcref-k{config.k}-s{config.seed}"] * n,
                           pa.string()),
        "tree_id": children.column("tree_id"),
        "node_id": children.column("node_id"),
        "k": pa.array(np.full(n, config.k, np.int32)),
        "successes": pa.array(np.asarray(successes, np.int32)),
        "policy_version": pa.array([version] * n, pa.string()),
        "created_at": pa.array([now_utc()] * n, MC_REFERENCES.field("created_at").type),
    }, schema=MC_REFERENCES)


def _commit_references(store: Store, batch: pa.Table, wins: Sequence[int],
                       config: ReferenceConfig, version: str | None,
                       report: ReferenceReport) -> None:
    """Commit one batch's rows under its idempotent key and count them."""
    store.append_mc_references(reference_rows(batch, wins, config, version),
                               key=commit_key(config, version, batch))
    report.sampled += batch.num_rows
    report.commits += 1


def collect_references(store: Store, config: ReferenceConfig | None = None, *,
                       policy: PolicySpec | None = None,
                       tree_ids: Sequence[str] | None = None,
                       env_kwargs: dict[str, Any] | None = None,
                       progress: bool = True) -> ReferenceReport:
    """Sample and commit the references every branching child lacks (module docstring).

    ``policy``: None for each tree's own policy (``trees.policy_ref``), else a
    ``Policy``, a ``load_policy`` spec or a factory ``env name -> Policy``.
    ``tree_ids`` limits the job to some trees; ``env_kwargs`` go to ``make_env``.
    Returns what was done; ``versions`` maps each env to the reference policy
    version (None in own-policy mode: each tree's).
    """
    config = config or ReferenceConfig()
    started = time.perf_counter()
    report = ReferenceReport(config.k)
    con = connect(store)
    policies: dict[tuple[str, str | None], Policy] = {}
    versions: dict[str, str | None] | None = None
    if policy is not None:
        versions = {}
        for env, p in _named_policies(con, policy).items():
            policies[(env, None)] = p
            versions[env] = str(p.policy_version)
        report.versions = dict(versions)
    children = reference_children(con, config.k, versions, tree_ids)
    have = children.column("have").to_numpy(zero_copy_only=False).astype(bool)
    report.children = children.num_rows
    report.reused = int(have.sum())
    missing = children.filter(pa.array(~have))
    counters = _Counters()
    with progress_bar(progress, missing.num_rows,
                      f"Mean@{config.k} references ({report.reused} reused)",
                      unit="children", transient=True) as advance:
        for batch in _batches(missing, config.commit_children):
            env_name = batch.column("env")[0].as_py()
            ref = batch.column("policy_ref")[0].as_py()
            target = batch.column("target")[0].as_py()
            try:
                starts = load_starts(con, batch, config.max_steps)
            except ContinuationError as exc:
                raise ReferenceJobError(str(exc)) from exc
            if all(s.leaf_reward is not None for s in starts):
                # Leaf children only (e.g. GRPO groups logged by a trainer): successes are
                # k or 0 (module docstring), so no policy or environment is loaded and the
                # rows carry the target version (each tree's own in own-policy mode).
                wins = [config.k if s.leaf_reward >= config.success_threshold else 0
                        for s in starts if s.leaf_reward is not None]
                advance(len(starts))
                if versions is None:
                    report.versions[env_name] = None
                _commit_references(store, batch, wins, config, target, report)
                report.leaves += len(starts)
                continue
            if versions is None:
                tree_version = batch.column("policy_version")[0].as_py()
                pol = policies.get((env_name, ref))
                if pol is None:
                    if ref is None:
                        raise ReferenceJobError(
                            f"tree {batch.column('tree_id')[0].as_py()!r} records no "
                            "policy_ref: name the policy that should sample references "
                            "(--policy SPEC)")
                    pol = policies[(env_name, ref)] = resolve_policy(ref, env_name)
                loaded = str(pol.policy_version)
                if tree_version is not None and loaded != tree_version:
                    raise ReferenceJobError(
                        f"tree {batch.column('tree_id')[0].as_py()!r} was sampled by policy "
                        f"version {tree_version!r}, but its policy_ref {ref!r} now loads "
                        f"version {loaded!r}; pass --policy to sample references with "
                        "another policy")
                report.versions[env_name] = None
                version = tree_version
            else:
                pol, version = policies[(env_name, None)], target

            def factory(name: str = env_name) -> Environment:
                return make_env(name, **(env_kwargs or {}))

            wins = run_references(pol, factory, starts, config, counters,
                                  on_chunk=advance)
            _commit_references(store, batch, wins, config, version, report)
            report.leaves += sum(s.leaf_reward is not None for s in starts)
    report.rollouts, report.env_steps = counters.rollouts, counters.env_steps
    report.policy_calls = counters.policy_calls
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["DEFAULT_MAX_STEPS", "PolicySpec", "ReferenceConfig", "ReferenceJobError",
           "ReferenceReport", "Start", "collect_references", "commit_key", "load_starts",
           "mix_seed", "policy_versions", "reference_children", "reference_rows", "resolve_policy",
           "run_references"]
