"""How a storage URI becomes an fsspec file system (driver side).

``s3://bucket/prefix`` goes to fsspec, which finds the scheme's package (a missing one is a
:class:`~ddptrain.errors.ConfigError` naming the extra to install). What Ray also accepts is
understood: pyarrow's URI options (``s3://bucket/prefix?region=...&endpoint_override=...``)
are turned into the s3fs (or gcsfs) arguments that mean the same; an option ddptrain cannot map,
and credentials in the URI (they would be saved with the run), are refused with what to do
instead. The S3 clients ddptrain builds itself try each request 3 times (botocore's
"standard" mode) instead of botocore's default 5, unless ``AWS_MAX_ATTEMPTS`` or
``AWS_RETRY_MODE`` say otherwise: with the endpoint gone, each call fails in about a second.
Their connect and read timeouts (5 s and 15 s, s3fs's) are never longer than
``DDPTRAIN_STORAGE_TIMEOUT_S``.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ddptrain import _env
from ddptrain.errors import ConfigError

__all__ = ["EXTRAS", "filesystem_for", "import_fsspec"]

# Which extra installs a scheme's file system.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
# pyarrow's S3 and GCS URI options (``FileSystem.from_uri``) that ddptrain maps; pyarrow accepts
# a few more, which are refused with a hint.
_S3_OPTIONS = ("region", "endpoint_override", "scheme", "allow_bucket_creation", "allow_bucket_deletion")
_GCS_OPTIONS = ("endpoint_override", "scheme", "project_id")
_S3_ATTEMPTS = 3


def import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:
        raise ConfigError(
            "Remote storage needs fsspec, which is not installed: `pip install ddptrain[s3]` "
            "(or ddptrain[gcs], ddptrain[azure]; or `pip install fsspec` and the scheme's package)."
        ) from exc
    return fsspec


def _endpoint(options: dict[str, str]) -> str | None:
    endpoint = options.get("endpoint_override")
    if not endpoint:
        return None
    return endpoint if "://" in endpoint else f"{options.get('scheme') or 'https'}://{endpoint}"


def _uri_options(uri: str, scheme: str, query: str) -> dict[str, Any]:
    """The fsspec arguments of a URI's query (pyarrow's option names)."""
    options = dict(parse_qsl(query, keep_blank_values=True))
    known = _S3_OPTIONS if scheme in ("s3", "s3a") else _GCS_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"`storage_path` {uri!r}: the URI option(s) {', '.join(map(repr, unknown))} are not understood "
            f"(ddptrain understands {', '.join(known)} in a {scheme}:// URI, as Ray does). Build the file "
            "system yourself and pass it: `RunConfig(storage_path='bucket/prefix', "
            "storage_filesystem=fs)`."
        )
    kwargs: dict[str, Any] = {}
    endpoint = _endpoint(options)
    if scheme in ("s3", "s3a"):
        if options.get("region"):
            kwargs["client_kwargs"] = {"region_name": options["region"]}
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        elif options.get("scheme"):
            kwargs["use_ssl"] = options["scheme"] != "http"
    else:
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if options.get("project_id"):
            kwargs["project"] = options["project_id"]
    return kwargs


def _client_options(scheme: str) -> dict[str, Any]:
    """Settings of the S3 clients ddptrain builds: fewer botocore retries (see the module's doc),
    and socket timeouts no longer than ddptrain's own bound (so that a call it gave up on ends
    soon in the background too)."""
    if scheme not in ("s3", "s3a"):
        return {}
    try:
        bound_s = _env.storage_timeout_s()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config: dict[str, Any] = {"connect_timeout": min(5.0, bound_s), "read_timeout": min(15.0, bound_s)}
    if not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        config["retries"] = {"mode": "standard", "total_max_attempts": _S3_ATTEMPTS}
    return {"config_kwargs": config}


def filesystem_for(uri: str) -> tuple[Any, str, bool]:
    """The fsspec file system of ``uri``, the path on it, and whether the URI had options (then
    paths are shown without the scheme, with the file system beside them, as Ray does).

    Raises:
        ConfigError: The scheme's package is not installed, fsspec does not know the scheme, or
            the URI carries credentials or options ddptrain cannot map.
    """
    fsspec = import_fsspec()
    scheme = uri.split("://", 1)[0].lower()
    base, _, query = uri.partition("?")
    pyarrow_like = scheme in ("s3", "s3a", "gs", "gcs")
    if not pyarrow_like:
        base, query = uri, ""  # other schemes' own syntax (hdfs://...?replication=, az://container@account) is fsspec's
    if pyarrow_like and "@" in urlsplit(base).netloc:
        raise ConfigError(
            f"`storage_path` {uri.split('@', 1)[-1]!r}: credentials in the URI are refused: they would be saved "
            "with the run. Give them through the environment (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) "
            "or pass `storage_filesystem=`."
        )
    kwargs = {**(_uri_options(uri, scheme, query) if query else {}), **_client_options(scheme)}
    try:
        fs, path = fsspec.core.url_to_fs(base, **kwargs)
    except ImportError as exc:
        extra = EXTRAS.get(scheme)
        hint = f"`pip install ddptrain[{extra}]`" if extra else "install the fsspec implementation of that scheme"
        raise ConfigError(
            f"`storage_path` {uri!r} needs a file system for {scheme}:// that is not installed: {hint}."
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"`storage_path` {uri!r}: fsspec knows no file system for {scheme}:// ({exc}).") from exc
    return fs, path, bool(query)
