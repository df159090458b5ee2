"""Where a store lives: a local directory or an object-store prefix (``s3://bucket/prefix``).

One code base serves both. A ``Location`` abstracts the three things the store does with
its storage, and the rest of ``rollout_store`` goes through it:

* **Data files** go through ``pyarrow.fs``: ``LocalFileSystem`` semantics (plain paths) for a
  directory, ``S3FileSystem`` for ``s3://``. Our Parquet writer streams into an S3 multipart
  upload that becomes visible only when it completes, so a writer killed mid-file leaves no
  object (at worst an incomplete multipart upload, which no listing shows; a bucket
  lifecycle rule "abort incomplete multipart uploads after N days" reclaims its parts).
  Visibility rules are unchanged: readers read the files one committed Delta version lists,
  and S3's read-after-write and list consistency (strong since 2020) means a committed
  version's files and log are visible to every reader at once.
* **Delta commits** go through delta-rs with ``storage_options`` (``storage_options()``).
  delta-rs 1.6 writes each commit file ``_delta_log/<version>.json`` with a conditional put
  (``If-None-Match: *``, object_store's ``PutMode::Create``); with conditional puts disabled
  it refuses to commit to S3 at all (we tried). We set ``conditional_put=etag``, which S3
  (since 2024), MinIO, R2 and moto honour: two writers racing for one version get one
  success and one ``412 Precondition Failed``, and delta-rs retries the loser at the next
  version. No ``AWS_S3_ALLOW_UNSAFE_RENAME`` and no DynamoDB are needed; the tests commit
  from two processes at once and count every commit.
* **Locks** (``lock``): a local store keeps its ``fcntl.flock`` lock files (``.append.lock``,
  ``.compact.lock``). flock does not reach across machines, so an object store uses a
  *lease lock object* at the same key under the prefix (``LeaseLock``):

  - acquire: ``PutObject`` of ``{owner, lease_s}`` with ``If-None-Match: *``; exactly one
    contender succeeds and remembers the object's ETag;
  - expiry is judged on the server's clock only: the lock object's ``Last-Modified`` plus its
    ``lease_s`` against the ``Date`` header of the ``HEAD`` that read it, so client clock skew
    does not matter. A contender that finds an expired lease deletes it with ``If-Match``
    its ETag (so only that exact stale lease is broken, never a fresh one that replaced it)
    and tries again; otherwise it waits (bounded backoff, ``timeout_s`` in all);
  - a holder renews the lease from a heartbeat thread every ``lease_s / 4`` with a
    ``PutObject`` ``If-Match`` its ETag, and checks synchronously (``check``: one more
    conditional renewal) right before each Delta commit it makes under the lock. A holder
    paused past its lease (its lock broken and taken by another) fails that check and
    stops before its commit point with ``LockLostError``: nothing it wrote is visible;
  - release: ``DeleteObject`` with ``If-Match`` its ETag.

  A holder killed with ``kill -9`` leaves its lease behind: the next appender waits at most
  ``lease_s`` (default ``DEFAULT_LEASE_S``; ``ROLLOUT_STORE_LOCK_LEASE_S`` overrides it).
  What the lock protects is the same as locally: the duplicate-tree-id and same-key checks
  at the commit point of an append, and the inputs of a compaction. A third lease,
  ``.create.lock``, serialises creating the tables of a new store: delta-rs retries a
  create that lost the race for version 0 as a second metadata commit (version 1), which
  the tests caught when two processes created one store at once (a local store takes the
  same lock as an ``flock``: the race is the same on a file system). The Delta log itself
  never depends on it (conditional puts keep every commit, lock or not); the one window
  left is a holder stalled for longer than the lease between its last check and its
  commit (seconds against a 60 s lease), documented here rather than hidden.
* **DuckDB** reads a remote store through Arrow datasets over the same ``S3FileSystem``
  (``reader.connect`` registers one per table). DuckDB's ``httpfs`` extension would be the
  native route, but DuckDB extensions download at run time and fail offline,
  and none on PyPI matches DuckDB 2.0.

Credentials come from the standard AWS environment variables: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (optionally ``AWS_SESSION_TOKEN``), ``AWS_REGION`` (or
``AWS_DEFAULT_REGION``) and, for an S3-compatible server, ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``. One of the two must be set: with neither, an ``s3://`` store is
refused (``S3ConfigError``) instead of silently going to AWS's public endpoint in
``us-east-1`` (a test or a MinIO user who forgot the endpoint would otherwise send their
credentials and data to AWS). A region alone means AWS S3 in that region; an endpoint
without a region uses ``us-east-1``, which S3-compatible servers accept. Plain ``http://``
endpoints are allowed for loopback hosts (a test server on 127.0.0.1) and elsewhere only
with ``AWS_ALLOW_HTTP=true``.

Needs the optional extra ``.[s3]`` (boto3 for the lease locks' conditional requests,
which pyarrow's filesystem does not expose).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rollout_store.errors import StoreError

S3_SCHEME = "s3://"
DEFAULT_LEASE_S = 60.0
LEASE_ENV = "ROLLOUT_STORE_LOCK_LEASE_S"
LOCK_TIMEOUT_S = 900.0  # give up waiting for a lock after this long (one-line error)
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # first set wins
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
ENDPOINT_ONLY_REGION = "us-east-1"  # the signing region with an endpoint but no region


class ObjectStoreError(StoreError):
    """The object store cannot be reached or used as asked (one line, no traceback)."""


class S3ConfigError(ObjectStoreError):
    """An ``s3://`` store with neither an endpoint nor a region configured."""


class LockLostError(ObjectStoreError):
    """A lease lock was broken by another process while we held it."""


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names an object-store prefix (``s3://...``)."""
    return _remote_uri(path) is not None


def _remote_uri(path: str | os.PathLike[str]) -> str | None:
    text = os.fspath(path) if not isinstance(path, str) else path
    if text.startswith(S3_SCHEME):
        return text.rstrip("/")
    # pathlib folds "s3://b/p" into "s3:/b/p": a command-line option typed as a Path.
    if isinstance(path, PurePath) and text.startswith("s3:/") and len(text) > 4:
        return (S3_SCHEME + text[4:]).rstrip("/")
    return None


class ObjectPath:
    """A ``s3://bucket/prefix`` URI with the little of ``pathlib`` the store uses (``/``)."""

    __slots__ = ("uri",)

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")

    def __truediv__(self, part: str | os.PathLike[str]) -> ObjectPath:
        return ObjectPath(f"{self.uri}/{os.fspath(part).strip('/')}")

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"ObjectPath({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    @property
    def name(self) -> str:
        return self.uri.rsplit("/", 1)[-1]

    @property
    def bucket(self) -> str:
        return self.uri[len(S3_SCHEME):].split("/", 1)[0]

    @property
    def key(self) -> str:
        """The key (prefix) inside the bucket, without a leading slash."""
        rest = self.uri[len(S3_SCHEME):]
        return rest.split("/", 1)[1] if "/" in rest else ""


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


class S3Config:
    """Endpoint, region and credentials from the standard AWS environment variables
    (an endpoint or a region is required: see the module docstring)."""

    def __init__(self) -> None:
        self.endpoint = _env(*ENDPOINT_ENV)
        region = _env(*REGION_ENV)
        if self.endpoint is None and region is None:
            raise S3ConfigError(
                "s3:// store: no endpoint or region configured; set AWS_ENDPOINT_URL (or "
                "AWS_ENDPOINT_URL_S3) for an S3-compatible server, or AWS_REGION (or "
                "AWS_DEFAULT_REGION) for AWS S3 (not defaulting to AWS's public endpoint)")
        self.region = region or ENDPOINT_ONLY_REGION
        self.access_key = _env("AWS_ACCESS_KEY_ID")
        self.secret_key = _env("AWS_SECRET_ACCESS_KEY")
        self.session_token = _env("AWS_SESSION_TOKEN")
        self.scheme = "https"
        self.host: str | None = None
        if self.endpoint:
            parsed = urlparse(self.endpoint)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ObjectStoreError(f"AWS_ENDPOINT_URL={self.endpoint!r}: expected "
                                       "http(s)://host[:port]")
            self.scheme, self.host = parsed.scheme, parsed.netloc
            allow = (os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes")
                     or parsed.hostname in _LOOPBACK)
            if self.scheme == "http" and not allow:
                raise ObjectStoreError(f"endpoint {self.endpoint} is plain http: allowed for "
                                       "loopback hosts only, or set AWS_ALLOW_HTTP=true")

    def filesystem(self) -> pafs.S3FileSystem:
        kwargs: dict[str, Any] = {"region": self.region, "scheme": self.scheme}
        if self.host:
            kwargs["endpoint_override"] = self.host
        if self.access_key and self.secret_key:
            kwargs.update(access_key=self.access_key, secret_key=self.secret_key,
                          session_token=self.session_token)
        return pafs.S3FileSystem(**kwargs)

    def storage_options(self) -> dict[str, str]:
        """delta-rs (object_store) options: the same endpoint and credentials, and conditional
        puts for the commit files (see the module docstring)."""
        out = {"AWS_REGION": self.region, "conditional_put": "etag"}
        if self.endpoint:
            out["AWS_ENDPOINT_URL"] = self.endpoint
            if self.scheme == "http":
                out["AWS_ALLOW_HTTP"] = "true"
        if self.access_key and self.secret_key:
            out.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        if self.session_token:
            out["AWS_SESSION_TOKEN"] = self.session_token
        return out

    def client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ObjectStoreError("writing to an s3:// store needs boto3: install the "
                                   "extra, pip install 'rollout-trees[s3]'") from None
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            aws_session_token=self.session_token,
            config=Config(retries={"max_attempts": 3, "mode": "standard"},
                          connect_timeout=10, read_timeout=30))


class Location:
    """A store root: ``path`` (a ``Path`` or an ``ObjectPath``) and how to reach it.

    ``fs_path`` maps a path as the store names it (absolute local path or ``s3://`` URI)
    to the path its ``fs`` expects; ``filesystem`` is None for a local store, so local reads
    go through pyarrow exactly as before."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        uri = _remote_uri(path)
        self.remote = uri is not None
        self.path: Path | ObjectPath
        self.config: S3Config | None = None
        if uri is None:
            self.path = Path(path).absolute()
            self.fs: pafs.FileSystem = pafs.LocalFileSystem()
        else:
            self.path = ObjectPath(uri)
            if not self.path.bucket:
                raise ObjectStoreError(f"{uri}: no bucket named (expected s3://bucket/prefix)")
            self.config = S3Config()
            self.fs = self.config.filesystem()
        self._client: Any = None

    @property
    def filesystem(self) -> pafs.FileSystem | None:
        return self.fs if self.remote else None

    def storage_options(self) -> dict[str, str] | None:
        return None if self.config is None else self.config.storage_options()

    def client(self) -> Any:
        if self._client is None:
            assert self.config is not None
            self._client = self.config.client()
        return self._client

    def fs_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path) if not isinstance(path, str | ObjectPath) else str(path)
        return text[len(S3_SCHEME):] if self.remote and text.startswith(S3_SCHEME) else text

    def table_uri(self, name: str) -> str:
        return str(self.path / name)

    # --------------------------------------------------------------- files
    def bucket_exists(self) -> bool:
        assert isinstance(self.path, ObjectPath)
        try:
            info = self.fs.get_file_info(self.path.bucket)
        except OSError as exc:
            raise ObjectStoreError(f"{self.path}: cannot reach the object store: "
                                   f"{first_line(exc)}") from None
        return bool(info.type == pafs.FileType.Directory)

    def sizes(self, directory: str) -> dict[str, int]:
        """``{path: size}`` of the files directly in ``directory`` (one listing)."""
        selector = pafs.FileSelector(self.fs_path(directory), allow_not_found=True)
        base = directory.rstrip("/") + "/"
        return {base + info.base_name: int(info.size or 0)
                for info in self.fs.get_file_info(selector)
                if info.type == pafs.FileType.File}

    def size(self, path: str) -> int | None:
        """The size of the file at ``path``, or None when there is none."""
        if not self.remote:
            try:
                return os.stat(path).st_size
            except FileNotFoundError:
                return None
        info = self.fs.get_file_info(self.fs_path(path))
        return None if info.type == pafs.FileType.NotFound else int(info.size or 0)

    def read_table(self, path: str, **kwargs: Any) -> pa.Table:
        return pq.read_table(self.fs_path(path), filesystem=self.filesystem, **kwargs)

    def parquet_file(self, path: str, **kwargs: Any) -> pq.ParquetFile:
        if not self.remote:
            return pq.ParquetFile(path, **kwargs)
        return pq.ParquetFile(self.fs.open_input_file(self.fs_path(path)), **kwargs)

    def delete(self, path: str) -> None:
        self.fs.delete_file(self.fs_path(path))

    @contextlib.contextmanager
    def local_copy(self, path: str) -> Iterator[str]:
        """A local file with the bytes of ``path`` (the path itself for a local store)."""
        if not self.remote:
            yield path
            return
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rtrees-") as tmp:
            local = os.path.join(tmp, os.path.basename(path))
            with self.fs.open_input_stream(self.fs_path(path)) as src, open(local, "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
            yield local

    # --------------------------------------------------------------- locks
    @contextlib.contextmanager
    def lock(self, name: str, mode: str = "a") -> Iterator[Lease]:
        """An exclusive lock named ``name`` at the store root (see the module docstring)."""
        if not self.remote:
            assert isinstance(self.path, Path)
            with open(self.path / name, mode) as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield Lease()
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
            return
        assert isinstance(self.path, ObjectPath)
        lease = LeaseLock(self.client(), self.path.bucket,
                          f"{self.path.key}/{name}" if self.path.key else name)
        lease.acquire()
        try:
            yield lease
        finally:
            lease.release()


class Lease:
    """A held lock; ``check`` raises ``LockLostError`` if it is no longer ours (a flock is
    ours until released, so the local one never raises)."""

    def check(self) -> None:
        return None


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV)
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        raise ObjectStoreError(f"{LEASE_ENV}={raw!r}: expected a number of seconds") from None
    if not 1 <= value <= 3600:
        raise ObjectStoreError(f"{LEASE_ENV}={raw!r}: expected 1 to 3600 seconds")
    return value


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


_CONFLICT = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


class LeaseLock(Lease):
    """An exclusive lease on one object, by conditional requests (module docstring)."""

    def __init__(self, client: Any, bucket: str, key: str, lease_s: float | None = None,
                 timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.lease_s = lease_seconds() if lease_s is None else lease_s
        self.timeout_s = timeout_s
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.etag: str | None = None
        self._lost = False
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "lease_s": self.lease_s}).encode()

    def acquire(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        while True:
            try:
                resp = self.client.put_object(Bucket=self.bucket, Key=self.key,
                                              Body=self._body(), IfNoneMatch="*")
                self.etag = resp["ETag"]
                break
            except ClientError as exc:
                if _error_code(exc) not in _CONFLICT:
                    raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: cannot take the "
                                           f"lock: {first_line(exc)}") from None
            except BotoCoreError as exc:
                raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: cannot take the "
                                       f"lock: {first_line(exc)}") from None
            self._break_if_expired()
            if time.monotonic() > deadline:
                raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: still held by another "
                                       f"process after {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                        name=f"lease:{self.key}")
        self._thread.start()

    def _break_if_expired(self) -> None:
        """Delete the current lock object if its lease ran out (judged on the server clock)."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                return  # released meanwhile: the next put may win
            raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: cannot read the lock: "
                                   f"{first_line(exc)}") from None
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key,
                                          IfMatch=head["ETag"])["Body"].read()
            lease = float(json.loads(body)["lease_s"])
        except ClientError:
            return  # replaced meanwhile: look again next round
        except (ValueError, KeyError, TypeError):
            lease = self.lease_s  # not ours to parse: treat it as a default lease
        server_now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (server_now - head["LastModified"]).total_seconds()
        if age > lease:
            with contextlib.suppress(ClientError):  # another contender broke it first
                self.client.delete_object(Bucket=self.bucket, Key=self.key,
                                          IfMatch=head["ETag"])

    def _renew(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        with self._mutex:
            if self._lost or self.etag is None:
                raise LockLostError(f"s3://{self.bucket}/{self.key}: lock lost")
            try:
                resp = self.client.put_object(Bucket=self.bucket, Key=self.key,
                                              Body=self._body(), IfMatch=self.etag)
            except ClientError as exc:
                if _error_code(exc) in _CONFLICT | _MISSING:
                    self._lost = True
                    raise LockLostError(
                        f"s3://{self.bucket}/{self.key}: our lease expired and another "
                        "process took the lock; stopped before committing") from None
                raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: cannot renew the "
                                       f"lock: {first_line(exc)}") from None
            except BotoCoreError as exc:
                raise ObjectStoreError(f"s3://{self.bucket}/{self.key}: cannot renew the "
                                       f"lock: {first_line(exc)}") from None
            self.etag = resp["ETag"]

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self._renew()
            except ObjectStoreError:
                if self._lost:
                    return  # check() reports it before the next commit

    def check(self) -> None:
        self._renew()

    def release(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._mutex:
            if self.etag is not None and not self._lost:
                with contextlib.suppress(ClientError, BotoCoreError):  # expired: already gone
                    self.client.delete_object(Bucket=self.bucket, Key=self.key,
                                              IfMatch=self.etag)
            self.etag = None


def first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


def locate(path: str | os.PathLike[str]) -> Location:
    return Location(path)


__all__ = ["DEFAULT_LEASE_S", "LEASE_ENV", "Lease", "LeaseLock", "Location", "LockLostError",
           "ObjectPath", "ObjectStoreError", "S3ConfigError", "is_remote", "locate"]
