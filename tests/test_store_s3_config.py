"""An ``s3://`` store must name where it lives: an endpoint or a region (issue 16).

Without either, the AWS SDKs and pyarrow default to AWS's public endpoint in us-east-1, so
a user who forgot ``AWS_ENDPOINT_URL`` for their MinIO would send credentials and data to
AWS. The store refuses instead, in one named line, before any request. No server needed:
the refusal happens before anything is contacted, and the accepted configurations are
checked on the ``Location`` they build (which contacts nothing either). The last test
(Delta checkpoints on S3) starts moto's server on 127.0.0.1 (the ``.[s3]`` extra).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, read_arrow
from rollout_store import store as store_mod
from rollout_store.maintenance import verify
from rollout_store.moto_server import (
    create_bucket_when_up,
    free_port,
    start_moto_server,
    stop_process,
)
from rollout_store.objectstore import (
    ENDPOINT_ENV,
    ENDPOINT_ONLY_REGION,
    REGION_ENV,
    Location,
    S3ConfigError,
)
from rollout_store.schema import SCHEMAS

ALL = (*ENDPOINT_ENV, *REGION_ENV)


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No endpoint and no region in the environment (credentials set: they do not count)."""
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return monkeypatch


def test_no_endpoint_and_no_region_is_refused(bare_env: pytest.MonkeyPatch) -> None:
    for create in (False, True):
        with pytest.raises(S3ConfigError) as info:
            Store("s3://some-bucket/prefix", create=create)
        message = str(info.value)
        assert "\n" not in message
        assert "AWS_ENDPOINT_URL" in message and "AWS_REGION" in message


def test_the_cli_prints_the_refusal_in_one_line(bare_env: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(app, ["store", "info", "--store", "s3://some-bucket/prefix"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no endpoint or region configured" in lines[0], result.output


@pytest.mark.parametrize("name", REGION_ENV)
def test_a_region_alone_means_aws_in_that_region(bare_env: pytest.MonkeyPatch,
                                                 name: str) -> None:
    bare_env.setenv(name, "eu-west-3")
    loc = Location("s3://some-bucket/prefix")
    assert loc.config is not None
    assert loc.config.endpoint is None and loc.config.region == "eu-west-3"
    assert loc.storage_options() == {"AWS_REGION": "eu-west-3", "conditional_put": "etag",
                                     "AWS_ACCESS_KEY_ID": "testing",
                                     "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.mark.parametrize("name", ENDPOINT_ENV)
def test_an_endpoint_alone_is_enough(bare_env: pytest.MonkeyPatch, name: str) -> None:
    bare_env.setenv(name, "http://127.0.0.1:9")
    loc = Location("s3://some-bucket/prefix")
    assert loc.config is not None
    assert loc.config.endpoint == "http://127.0.0.1:9"
    assert loc.config.region == ENDPOINT_ONLY_REGION
    options = loc.storage_options()
    assert options is not None and options["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"


def test_a_local_store_needs_neither(bare_env: pytest.MonkeyPatch, tmp_path: object) -> None:
    Store(f"{tmp_path}/s", create=True)


@pytest.fixture
def moto_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, a bucket, and the AWS variables; yields a store URI."""
    pytest.importorskip("moto", reason="needs the s3 extra: pip install -e '.[s3]'")
    port = free_port()
    proc = start_moto_server(port)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        create_bucket_when_up(env["AWS_ENDPOINT_URL"], "cfg", proc)
        yield f"s3://cfg/{uuid.uuid4().hex[:8]}/store"
    finally:
        stop_process(proc)


def _metric(step: int) -> pa.Table:
    return pa.table({"run_id": ["cp"], "step": [step], "name": ["loss"], "value": [1.0],
                     "created_at": pa.array([0], SCHEMAS["metrics"].field("created_at").type)},
                    schema=SCHEMAS["metrics"])


def test_checkpoints_on_s3_keep_keys_and_rows(moto_env: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's Delta checkpoints (``store.CHECKPOINT_EVERY``) on object storage."""
    import boto3

    monkeypatch.setattr(store_mod, "CHECKPOINT_EVERY", 3)
    store = Store(moto_env, create=True)
    for step in range(1, 8):
        store.append_metrics(_metric(step), key=f"m{step}")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                          region_name="us-east-1")
    prefix = moto_env[len("s3://cfg/"):] + "/metrics/_delta_log/"
    names = {o["Key"][len(prefix):] for o in client.list_objects_v2(
        Bucket="cfg", Prefix=prefix)["Contents"]}
    assert {f"{v:020d}.checkpoint.parquet" for v in (3, 6)} <= names
    hint = client.get_object(Bucket="cfg", Key=prefix + "_last_checkpoint")["Body"].read()
    assert json.loads(hint)["version"] == 6
    again = Store(moto_env)
    assert again.append_metrics(_metric(1), key="m1").skipped == ["metrics"]
    assert read_arrow(again, "metrics").num_rows == 7
    report = verify(again)
    assert report.ok, report.problems
