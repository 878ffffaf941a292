"""Images and videos named by a request (`image_url` / `video_url` parts), loaded under the server's `MediaPolicy`.

Three kinds of URL, each checked before anything is decoded:
- `data:<type>;base64,<data>`: images of type image/png, image/jpeg, image/webp or image/gif (the bytes must be one of
  those four formats, whatever the label says); the size is computed from the base64 length before decoding it;
- a local path (`file:///abs/path`, `/abs/path` or a path relative to the root): only when the server has an
  `image_root`, and only if the path, resolved with its symlinks, lies under the resolved root (`..` and links
  leading out are refused);
- `http(s)://...`: refused unless `allow_remote` (then fetched with a timeout and a byte limit).

Images are then opened by `mmadapt.data.images.load_image` (its allow-list of formats, `FORMATS`; the pixel count
read from the header and checked against `max_pixels` before any pixel is decoded; colour policy, EXIF rotation), so
a served image is decoded exactly as a training image. Videos become files the data pipeline reads (a data URL is
written into the request's scratch directory); its limits apply when the video is processed. Every failure is a
`400` `APIError` naming the part (`param`) and the reason.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmadapt.data.images import DEFAULT_MAX_PIXELS, FORMATS, load_image
from mmadapt.data.problems import DataProblem
from mmadapt.serve.errors import APIError, bad_request

log = logging.getLogger(__name__)

IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF"}
"""The data-URL image types a request may send, and the Pillow format each is (all four in `FORMATS`)."""
assert set(IMAGE_TYPES.values()) <= set(FORMATS)
VIDEO_TYPES = {"video/mp4": ".mp4", "video/webm": ".webm", "video/quicktime": ".mov", "video/x-matroska": ".mkv",
               "video/x-msvideo": ".avi"}


@dataclass(frozen=True, kw_only=True)
class MediaPolicy:
    """What a request may point at: local files only under `image_root` (None: no local files), remote URLs only
    with `allow_remote`; at most `max_image_bytes` per image and `max_video_bytes` per video (encoded), and
    `max_pixels` per image (the data settings' `max_image_pixels`)."""

    image_root: Path | None = None
    allow_remote: bool = False
    max_image_bytes: int = 20 * 1024 * 1024
    max_video_bytes: int = 256 * 1024 * 1024
    max_pixels: int = DEFAULT_MAX_PIXELS
    remote_timeout: float = 10.0


def image_format(data: bytes) -> str | None:
    """The format of encoded image bytes by their signature: one of IMAGE_TYPES' formats, else None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def load_image_url(url: str, policy: MediaPolicy, param: str) -> Any:
    """The decoded RGB image `url` names (see the module docstring), or a 400 `APIError` about `param`."""
    if url.startswith("data:"):
        media_type, data = _data_url(url, policy.max_image_bytes, param, "image")
        if media_type not in IMAGE_TYPES:
            raise bad_request(f"a data URL image must be image/png, image/jpeg, image/webp or image/gif, got "
                              f"{media_type or 'no type'}", param=param, code="invalid_image_format")
        return _decode(data, policy, param)
    if _is_remote(url):
        return _decode(_fetch(url, policy, policy.max_image_bytes, param, "image"), policy, param)
    return _load(_local_path(url, policy, param, "image"), policy, param)


def load_image_file(path: str | os.PathLike, policy: MediaPolicy, param: str) -> Any:
    """The decoded RGB image in the file at `path` (an upload the server itself stored), checked as a data URL's
    bytes are: its size against `max_image_bytes` before it is read, its signature, then its pixel count against
    `max_pixels` before any pixel is decoded; a 400 `APIError` about `param` otherwise."""
    size = os.stat(path).st_size
    if size > policy.max_image_bytes:
        raise bad_request(f"the image is {size} bytes, over the server's limit of {policy.max_image_bytes} bytes: send "
                          "a smaller image", param=param, code="image_too_large")
    with open(path, "rb") as f:
        head = f.read(16)
    if image_format(head) is None:
        raise bad_request("the file is not a PNG, JPEG, WebP or GIF image (its first bytes are no such signature)",
                          param=param, code="invalid_image_format")
    return _load(Path(path), policy, param)


def video_file(url: str, policy: MediaPolicy, param: str, scratch: Path) -> str:
    """A file holding the video `url` names (a data URL or a remote video written into `scratch`, a local path as
    it is), or a 400 `APIError` about `param`; decoding and its limits are the data pipeline's."""
    if url.startswith("data:"):
        media_type, data = _data_url(url, policy.max_video_bytes, param, "video")
        if media_type not in VIDEO_TYPES:
            raise bad_request(f"a data URL video must be one of {', '.join(VIDEO_TYPES)}, got "
                              f"{media_type or 'no type'}", param=param, code="invalid_video_format")
        return _scratch_file(scratch, data, VIDEO_TYPES[media_type])
    if _is_remote(url):
        data = _fetch(url, policy, policy.max_video_bytes, param, "video")
        suffix = Path(urllib.parse.urlparse(url).path).suffix.lower()
        return _scratch_file(scratch, data, suffix if suffix in VIDEO_TYPES.values() else ".mp4")
    return str(_local_path(url, policy, param, "video"))


def _data_url(url: str, max_bytes: int, param: str, kind: str) -> tuple[str, bytes]:
    """(media type, decoded bytes) of a base64 data URL; the size is checked from the base64 length first."""
    header, comma, data = url.partition(",")
    fields = header[len("data:"):].split(";")
    if not comma or "base64" not in fields[1:]:
        raise bad_request(f"the {kind} data URL must be base64-encoded: data:<type>;base64,<data>", param=param,
                          code=f"invalid_{kind}_url")
    size = len(data) * 3 // 4
    if size > max_bytes:
        raise bad_request(f"the {kind} is about {size} bytes, over the server's limit of {max_bytes} bytes: send a "
                          f"smaller {kind}", param=param, code=f"{kind}_too_large")
    try:
        return fields[0].strip().lower(), base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"the {kind} data URL is not valid base64 ({e})", param=param,
                          code=f"invalid_{kind}_url") from None


def _decode(data: bytes, policy: MediaPolicy, param: str) -> Any:
    """Encoded image bytes -> the decoded image, through `load_image` on a private temporary file."""
    found = image_format(data)
    if found is None:
        raise bad_request("the image is not PNG, JPEG, WebP or GIF data (its first bytes are no such signature)",
                          param=param, code="invalid_image_format")
    with tempfile.NamedTemporaryFile(prefix="mmadapt-serve-", suffix=f".{found.lower()}") as f:
        f.write(data)
        f.flush()
        return _load(Path(f.name), policy, param)


def _load(path: Path, policy: MediaPolicy, param: str) -> Any:
    try:
        return load_image(path, max_pixels=policy.max_pixels)
    except DataProblem as e:
        code = "image_too_large" if e.reason == "image_too_large" else "invalid_image"
        raise bad_request(f"the image cannot be used: {e.reason}: {e.detail}", param=param, code=code) from None


def _is_remote(url: str) -> bool:
    return urllib.parse.urlparse(url).scheme.lower() in ("http", "https")


def _local_path(url: str, policy: MediaPolicy, param: str, kind: str) -> Path:
    """The resolved local file `url` names, if it lies under the resolved image root."""
    parsed = urllib.parse.urlparse(url)
    if (parsed.scheme and parsed.scheme != "file") or parsed.netloc not in ("", "localhost"):
        raise bad_request(f"unsupported {kind} URL {url[:60]!r}: use a data: URL, a path (or file:///path) under "
                          "the image root, or http(s) when the server allows remote media", param=param,
                          code=f"invalid_{kind}_url")
    if policy.image_root is None:
        raise bad_request(f"local {kind} paths are off on this server; send the {kind} as a data: URL, or start the "
                          "server with --image-root DIR to read files under DIR", param=param,
                          code="local_media_disabled")
    name = urllib.parse.unquote(parsed.path) if parsed.scheme == "file" else url
    if "\x00" in name:
        raise bad_request(f"the {kind} path holds a NUL character", param=param, code=f"invalid_{kind}_url")
    root = Path(os.path.realpath(policy.image_root))
    resolved = Path(os.path.realpath(root / name))  # an absolute name replaces the root, and is checked the same way
    if resolved != root and root not in resolved.parents:
        raise bad_request(f"the {kind} path {url!r} resolves outside the image root (paths and symlinks must stay "
                          "under --image-root)", param=param, code="path_outside_root")
    if not resolved.is_file():  # a directory, a pipe or a device is never opened
        raise bad_request(f"no {kind} file at {url!r} under the image root", param=param, code=f"invalid_{kind}_url")
    return resolved


def _fetch(url: str, policy: MediaPolicy, max_bytes: int, param: str, kind: str) -> bytes:
    """The body at a remote URL, at most `max_bytes`, within the policy's timeout."""
    if not policy.allow_remote:
        raise bad_request(f"remote {kind} URLs are off on this server; send the {kind} as a data: URL (or start the "
                          "server with --allow-remote-images)", param=param, code="remote_media_disabled")
    try:
        with urllib.request.urlopen(url, timeout=policy.remote_timeout) as response:  # http(s) only: _is_remote
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise bad_request(f"the {kind} at {url} is {length} bytes, over the limit of {max_bytes}",
                                  param=param, code=f"{kind}_too_large")
            data = response.read(max_bytes + 1)
    except APIError:
        raise
    except (OSError, ValueError) as e:
        raise bad_request(f"could not fetch the {kind} at {url}: {e}", param=param,
                          code=f"invalid_{kind}_url") from None
    if len(data) > max_bytes:
        raise bad_request(f"the {kind} at {url} is over the limit of {max_bytes} bytes", param=param,
                          code=f"{kind}_too_large")
    return data


def _scratch_file(scratch: Path, data: bytes, suffix: str) -> str:
    """`data` written to a new file in the request's scratch directory (named by a counter and one of VIDEO_TYPES'
    suffixes, never by the request)."""
    path = scratch / f"video-{len(list(scratch.iterdir()))}{suffix}"
    path.write_bytes(data)
    log.debug("wrote %d bytes of video to %s", len(data), path)
    return str(path)
