"""Blocking S3 requests with real conditional headers: the only place that talks HTTP.

minio-py signs the requests (presigned URLs, so no header is ever rewritten), and one
urllib3 pool with bounded timeouts and no retries sends them. ``put_object`` of minio is
not used: it turns ``If-Match``/``If-None-Match`` into ``x-amz-meta-*`` user metadata,
which silently drops the condition.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
from datetime import timedelta
from typing import Any

import urllib3
from minio import Minio
from minio.error import S3Error

__all__ = ["BadResponse", "Store"]

#: A presigned URL carries the signature and the credential scope in its query string.
_QUERY = re.compile(r"\?[^\s'\")]*")
_PRESIGN_FOR = timedelta(minutes=5)
#: 412: the condition failed; 409: a concurrent conditional write to the same key won.
_LOST_RACE = (409, 412)


class BadResponse(Exception):
    """The store answered with a status or body this provider does not understand."""


def strip_query(text: str) -> str:
    """Drop the query strings (signatures, credential scope) from URLs inside *text*."""
    return _QUERY.sub("?...", text)


class Store:
    """One bucket of one S3 endpoint; every method blocks and is bounded by *timeout*."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        access_key: str | None,
        secret_key: str | None,
        session_token: str | None,
        region: str | None,
        secure: bool,
        cert_check: bool,
        ca_certs: str | None,
        timeout: float,
        credentials: Any = None,
    ) -> None:
        pool_kwargs: dict[str, Any] = {
            "timeout": urllib3.Timeout(connect=timeout, read=timeout),
            "retries": False,  # the election owns retries and timing
            "maxsize": 16,
        }
        if secure:
            pool_kwargs["cert_reqs"] = ssl.CERT_REQUIRED if cert_check else ssl.CERT_NONE
            if ca_certs:
                pool_kwargs["ca_certs"] = ca_certs
        self.http = urllib3.PoolManager(**pool_kwargs)
        self.bucket = bucket
        self.client = Minio(
            endpoint,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            secure=secure,
            region=region,
            http_client=self.http,
            credentials=credentials,
            cert_check=cert_check,
        )
        self._count_lock = threading.Lock()
        self.requests = 0

    def _send(
        self,
        method: str,
        key: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        url = self.client.get_presigned_url(method, self.bucket, key, expires=_PRESIGN_FOR)
        with self._count_lock:
            self.requests += 1
        return self.http.request(
            method, url, body=body, headers=headers, redirect=False, preload_content=True
        )

    def get(self, key: str) -> tuple[str, dict[str, Any]] | None:
        """Return ``(etag, record)`` of *key*, or None when it does not exist."""
        response = self._send("GET", key)
        if response.status == 404 and b"NoSuchKey" in response.data:
            return None
        if response.status != 200:
            raise BadResponse(_describe("GET", response))
        etag = response.headers.get("ETag")
        if not etag:
            raise BadResponse("GET answered without an ETag")
        try:
            record = json.loads(response.data)
        except ValueError as exc:
            raise BadResponse(f"{key} does not hold a multilock record: {exc}") from None
        if not isinstance(record, dict):
            raise BadResponse(f"{key} does not hold a multilock record")
        return etag, record

    def put(self, key: str, record: dict[str, Any], *, if_match: str | None = None) -> str | None:
        """Write *record* only if *key* has ETag *if_match* (None: only if it does not exist).

        Return the new ETag, or None when the condition failed (someone else wrote first).
        """
        body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
        headers = {"Content-Type": "application/json"}
        if if_match is None:
            headers["If-None-Match"] = "*"
        else:
            headers["If-Match"] = if_match
        response = self._send("PUT", key, body, headers)
        if response.status in _LOST_RACE:
            return None
        if response.status != 200:
            raise BadResponse(_describe("PUT", response))
        etag = response.headers.get("ETag")
        if not etag:
            raise BadResponse("PUT answered without an ETag")
        return str(etag)

    def ensure_bucket(self) -> None:
        """Create the bucket unless it exists (several processes may race: that is fine)."""
        if self.client.bucket_exists(self.bucket):
            return
        try:
            self.client.make_bucket(self.bucket)
        except S3Error as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def close(self) -> None:
        self.http.clear()


def _describe(method: str, response: urllib3.BaseHTTPResponse) -> str:
    code = re.search(rb"<Code>([^<]{1,64})</Code>", response.data or b"")
    detail = code.group(1).decode(errors="replace") if code else "no error code"
    return f"{method} answered HTTP {response.status} ({detail})"
