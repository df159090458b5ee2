"""The store on object storage against the local-directory store: append and ``siblings``.

The same batches are appended alternately to a local store and to an ``s3://`` store on
moto's S3 server (started here on 127.0.0.1 at a free port, stopped at the end), then the
``siblings`` query runs alternately on both. One run prints both timings and their ratio.
moto is a Python server on loopback: it has no network latency but is slower per request
than a real object store, so the ratio is a cost of the request pattern (requests per
append, per query), not a forecast for a given cloud region.

    .venv/bin/python -m benchmarks.bench_store_s3 [--appends 12] [--trees 40] [--repeat 5]

Needs the ``.[s3]`` extra.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from pathlib import Path

from benchmarks._common import Timings, print_timings, timed
from rollout_store import Store, connect
from rollout_store.moto_server import (
    create_bucket_when_up,
    free_port,
    start_moto_server,
    stop_process,
)
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.tree import TreeBatch

SIBLINGS = "SELECT count(*), sum(n_leaves), sum(n_success) FROM siblings"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=12)
    parser.add_argument("--trees", type=int, default=40, help="trees per append")
    parser.add_argument("--repeat", type=int, default=5, help="siblings query runs each")
    args = parser.parse_args()
    port = free_port()
    proc = start_moto_server(port)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    try:
        create_bucket_when_up(endpoint, "bench", proc)
        with tempfile.TemporaryDirectory() as tmp:
            local = Store(Path(tmp) / "local", create=True)
            remote = Store(f"s3://bench/{uuid.uuid4().hex[:8]}", create=True)
            appends = {"local": Timings("append, local"), "s3": Timings("append, s3")}
            nodes = 0
            for i in range(args.appends):
                batch = bel_shaped_batch(args.trees, seed=i, tree_prefix=f"t{i}",
                                         snapshot_bytes=64)
                nodes += batch.nodes.num_rows
                order = (("local", local), ("s3", remote)) if i % 2 == 0 else (
                    ("s3", remote), ("local", local))
                for name, store in order:
                    def append(s: Store = store, b: TreeBatch = batch, k: str = f"k{i}") -> None:
                        s.append_trees(b, key=k)
                    appends[name].seconds.append(timed(append))
            queries = {"local": Timings("siblings, local"), "s3": Timings("siblings, s3")}
            answers = {}
            for r in range(args.repeat):
                order = (("local", local), ("s3", remote)) if r % 2 == 0 else (
                    ("s3", remote), ("local", local))
                for name, store in order:
                    def run(s: Store = store, n: str = name) -> None:
                        answers[n] = connect(s).execute(SIBLINGS).fetchall()
                    queries[name].seconds.append(timed(run))
            assert answers["local"] == answers["s3"], answers
            print(f"{args.appends} appends of {args.trees} trees ({nodes:,} nodes in all); "
                  f"siblings = connect + query over them, {answers['s3'][0][0]:,} rows")
            print_timings([appends["local"], appends["s3"]], appends["local"])
            print()
            print_timings([queries["local"], queries["s3"]], queries["local"])
            print()
            print(f"ratio s3/local: append {appends['s3'].min / appends['local'].min:.2f}x "
                  f"(median {appends['s3'].median / appends['local'].median:.2f}x), "
                  f"siblings {queries['s3'].min / queries['local'].min:.2f}x "
                  f"(median {queries['s3'].median / queries['local'].median:.2f}x)")
    finally:
        stop_process(proc)


if __name__ == "__main__":
    main()
