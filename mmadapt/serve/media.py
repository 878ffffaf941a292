"""Images and videos named by a request (`image_url` / `video_url` parts), loaded under the server's `MediaPolicy`.

Three kinds of URL, each checked before anything is decoded:
- `data:<type>;base64,<data>`: images of type image/png, image/jpeg, image/webp or image/gif (the bytes must be one of
  those four formats, whatever the label says); the size is computed from the base64 length before decoding it;
- a local path (`file:///abs/path`, `/abs/path` or a path relative to the root): only when the server has an
  `image_root`, and only if the path, resolved with its symlinks, lies under the resolved root (`..` and links
  leading out are refused);
- `http(s)://...`: refused unless `allow_remote`; then fetched within one total deadline (`remote_timeout` seconds for
  connecting, the headers and the body together, redirects included) and a byte limit, with no proxy, from public
  addresses only: every connection (redirects included) resolves the host once, refuses it if any address is
  loopback, private, link-local or reserved (unless inside `remote_networks`) and connects to the address it checked.
  Only http(s) is spoken: a redirect to any other scheme (ftp:, file:, data:) is refused. Any other failed fetch is one
  generic message (the cause goes to the server's log, not to the client).

An image goes through three steps, so that a request can be budgeted before it costs memory (`mmadapt.serve.budget`):
`stage_image` (its encoded bytes or its path, signature checked, nothing decoded), `image_header` (width x height from
the header, checked against `max_pixels`), `decode_image` (`mmadapt.data.images.load_image`: its allow-list of
formats, colour policy, EXIF rotation, so a served image is decoded exactly as a training image). Videos become files
the data pipeline reads (a data URL is written into the request's scratch directory); their headers are budgeted by
the server and their limits apply when they are processed. Every failure is a `400` `APIError` naming the part
(`param`) and the reason.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmadapt.data.images import DEFAULT_MAX_PIXELS, FORMATS, EmbeddedImage, ImageSource, image_size, load_image
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
    with `allow_remote` and only from public addresses (or those inside `remote_networks`, CIDRs such as
    "10.1.0.0/16": an internal image store), within `remote_timeout` seconds in total (connecting, headers and body,
    redirects included); at most `max_image_bytes` per image and
    `max_video_bytes` per video (encoded), and `max_pixels` per image (the data settings' `max_image_pixels`)."""

    def __post_init__(self) -> None:
        if not self.remote_timeout > 0:
            raise ValueError(f"remote_timeout must be > 0 seconds, got {self.remote_timeout}")
        for net in self.remote_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as e:
                raise ValueError(f"remote_networks: {net!r} is not a network such as 10.1.0.0/16 ({e})") from None

    image_root: Path | None = None
    allow_remote: bool = False
    max_image_bytes: int = 20 * 1024 * 1024
    max_video_bytes: int = 256 * 1024 * 1024
    max_pixels: int = DEFAULT_MAX_PIXELS
    remote_timeout: float = 10.0
    remote_networks: tuple[str, ...] = ()


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
    source = stage_image(url, policy, param)
    image_header(source, policy, param)
    return decode_image(source, policy, param)


def stage_image(url: str, policy: MediaPolicy, param: str) -> ImageSource:
    """The encoded image `url` names, nothing decoded: a data URL's or a remote image's bytes (`EmbeddedImage`, its
    signature checked), or a local file under the image root (its path)."""
    if url.startswith("data:"):
        media_type, data = _data_url(url, policy.max_image_bytes, param, "image")
        if media_type not in IMAGE_TYPES:
            raise bad_request(f"a data URL image must be image/png, image/jpeg, image/webp or image/gif, got "
                              f"{media_type or 'no type'}", param=param, code="invalid_image_format")
        return _embedded(data, param)
    if _is_remote(url):
        return _embedded(_fetch(url, policy, policy.max_image_bytes, param, "image"), param)
    return _local_path(url, policy, param, "image")


def stage_image_file(path: str | os.PathLike, policy: MediaPolicy, param: str) -> Path:
    """An image file the server itself stored (a page's upload), checked as a data URL's bytes are: its size against
    `max_image_bytes` before it is read, then its signature; nothing decoded."""
    size = os.stat(path).st_size
    if size > policy.max_image_bytes:
        raise bad_request(f"the image is {size} bytes, over the server's limit of {policy.max_image_bytes} bytes "
                          "(--max-image-bytes): send a smaller image", param=param, code="image_too_large")
    with open(path, "rb") as f:
        head = f.read(16)
    if image_format(head) is None:
        raise bad_request("the file is not a PNG, JPEG, WebP or GIF image (its first bytes are no such signature)",
                          param=param, code="invalid_image_format")
    return Path(path)


def load_image_file(path: str | os.PathLike, policy: MediaPolicy, param: str) -> Any:
    """The decoded RGB image in the file at `path` (`stage_image_file`'s checks, then the pixel count from the
    header before any pixel is decoded); a 400 `APIError` about `param` otherwise."""
    return decode_image(stage_image_file(path, policy, param), policy, param)


def compact_image(path: Path, decoded_bytes: int, policy: MediaPolicy, param: str) -> bytes:
    """The bytes to keep of a staged image file whose pixels decode to `decoded_bytes`: its own when they are no
    more, else its pixels decoded and re-encoded as PNG (lossless: the same pixels) - never much more than its
    pixels, whatever the file weighs (a 20 MB PNG of 16 x 16 pixels is kept in under a kilobyte)."""
    if os.stat(path).st_size <= decoded_bytes:
        return path.read_bytes()
    encoded = io.BytesIO()
    decode_image(path, policy, param).save(encoded, format="PNG", compress_level=1)
    return encoded.getvalue()


def image_header(source: ImageSource, policy: MediaPolicy, param: str) -> tuple[int, int]:
    """(width, height) of a staged image from its header alone, its pixels checked against `max_pixels`."""
    try:
        return image_size(source, max_pixels=policy.max_pixels)
    except DataProblem as e:
        raise _refusal(e, param) from None


def decode_image(source: ImageSource, policy: MediaPolicy, param: str) -> Any:
    """A staged image decoded as training decodes it (`load_image`: colour modes, EXIF rotation)."""
    try:
        return load_image(source, max_pixels=policy.max_pixels)
    except DataProblem as e:
        raise _refusal(e, param) from None


def _refusal(problem: DataProblem, param: str) -> APIError:
    code = "image_too_large" if problem.reason == "image_too_large" else "invalid_image"
    return bad_request(f"the image cannot be used: {problem.reason}: {problem.detail}", param=param, code=code)


def _embedded(data: bytes, param: str) -> EmbeddedImage:
    if image_format(data) is None:
        raise bad_request("the image is not PNG, JPEG, WebP or GIF data (its first bytes are no such signature)",
                          param=param, code="invalid_image_format")
    return EmbeddedImage(data, param)


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
    """The body at a remote URL, at most `max_bytes`, all of it (connections, redirects, headers, body) within the
    policy's `remote_timeout` (`Deadline`), from a public address only (each connection, redirects included, checked
    by `_public_connection`), over http(s) only. Every failure is one generic message: the server is no probe of what
    it can reach (which ports answer, which names resolve)."""
    if not policy.allow_remote:
        raise bad_request(f"remote {kind} URLs are off on this server; send the {kind} as a data: URL (or start the "
                          "server with --allow-remote-images)", param=param, code="remote_media_disabled")
    try:
        with Deadline(policy.remote_timeout) as deadline:
            data = _read_within(url, policy, max_bytes, param, kind, deadline)
    except APIError:
        raise
    except RefusedRedirect as e:
        raise bad_request(f"the {kind} URL redirects to a {e.scheme}: URL; this server fetches http(s) only, "
                          "redirects included", param=param, code=f"invalid_{kind}_url") from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        log.info("fetching %s failed: %s: %s", url, type(e).__name__, e)  # the server's log, not the client's answer
        raise bad_request(f"could not fetch the {kind} at that URL: this server fetches only public http(s) "
                          f"addresses, within {policy.remote_timeout:g} s in total (connecting, headers and body; "
                          "--remote-timeout)", param=param, code=f"invalid_{kind}_url") from None
    if len(data) > max_bytes:
        raise bad_request(f"the {kind} at {url} is over the limit of {max_bytes} bytes (--max-{kind}-bytes)",
                          param=param, code=f"{kind}_too_large")
    return data


def _read_within(url: str, policy: MediaPolicy, max_bytes: int, param: str, kind: str, deadline: Deadline) -> bytes:
    """The first `max_bytes` + 1 bytes at `url`; a `TimeoutError` once `deadline` has passed (its timer cuts the
    connection, and a body cut short is never taken for a whole one)."""
    with _opener(policy, deadline).open(url, timeout=deadline.left()) as response:  # http(s) only: _is_remote
        length = response.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise bad_request(f"the {kind} at {url} is {length} bytes, over the limit of {max_bytes} "
                              f"(--max-{kind}-bytes)", param=param, code=f"{kind}_too_large")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = response.read(min(64 * 1024, max_bytes + 1 - size))
            deadline.left()  # raises once the time is up, whatever the read returned
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)


class Deadline:
    """One fetch's whole time: `left()` is the time that remains (a `TimeoutError` when none does), and the sockets
    the fetch opens are `watch`ed: when the time is up, a timer shuts them down, so a read blocked on a server that
    sends a byte now and then returns at once. A socket timeout alone bounds each read, not their sum: a byte a
    second held a fetch for as long as the server liked."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, time.monotonic() + seconds
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.expired = False
        self.timer = threading.Timer(seconds, self.expire)
        self.timer.daemon = True

    def __enter__(self) -> Deadline:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0 or self.expired:
            raise TimeoutError(f"the fetch took over its {self.seconds:g} s")
        return left

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.append(sock)
            if self.expired:
                _cut(sock)

    def expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                _cut(sock)


def _cut(sock: socket.socket) -> None:
    """End a connection's reads and writes now, from any thread (the owner's blocked `recv` returns)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed, or never connected
        pass


class RefusedRedirect(urllib.error.URLError):
    """A redirect to a URL that is not http(s) (ftp:, file:, data:, ...)."""

    def __init__(self, scheme: str) -> None:
        super().__init__(f"a redirect to a {scheme}: URL")
        self.scheme = scheme


class RefusedAddress(OSError):
    """A remote URL whose host resolves to a loopback, private, link-local or otherwise non-public address."""


def allowed_address(address: str, policy: MediaPolicy) -> bool:
    """Whether the server may connect to `address`: a global (public) unicast address, or one inside the policy's
    `remote_networks` (an internal image store the operator named)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in ipaddress.ip_network(net, strict=False) for net in policy.remote_networks):
        return True
    return ip.is_global and not ip.is_multicast


def _public_connection(policy: MediaPolicy, deadline: Deadline) -> Any:
    """`socket.create_connection` that resolves the host once, refuses it unless every address it resolves to is
    allowed, and connects to that checked address (no second lookup a rebinding name could answer differently),
    within what is left of the fetch's `deadline` (which watches the socket)."""
    def create(address: tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,
               source_address: Any = None, **_: Any) -> socket.socket:
        host, port = address
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not found or not all(allowed_address(info[4][0], policy) for info in found):
            raise RefusedAddress(f"{host} resolves to a non-public address")
        family, kind, proto, _, where = found[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())  # each blocking call at most what is left; the timer bounds their sum
            deadline.watch(sock)
            sock.connect(where)
        except BaseException:
            sock.close()
            raise
        return sock

    return create


class _OnlyHTTPRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects (their limits, loop detection), refusing every target that is not http(s): urllib itself
    follows ftp: too."""

    def http_error_302(self, req: Any, fp: Any, code: int, msg: str, headers: Any) -> Any:
        target = headers.get("location") or headers.get("uri")
        scheme = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, target or "")).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise RefusedRedirect(scheme)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener(policy: MediaPolicy, deadline: Deadline) -> urllib.request.OpenerDirector:
    """urllib speaking http(s) only - no proxy, ftp, file or data handlers (`build_opener` would add them) - with
    every connection (the first and each redirect's) through `_public_connection` and watched by `deadline` (an
    https connection again once wrapped in TLS: the wrapper owns the socket from then on)."""
    connect = _public_connection(policy, deadline)

    class HTTP(http.client.HTTPConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = connect

    class HTTPS(http.client.HTTPSConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = connect

        def connect(self) -> None:  # http.client's, with the handshake after the wrapped socket is watched
            http.client.HTTPConnection.connect(self)
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host, do_handshake_on_connect=False)
            deadline.watch(self.sock)
            self.sock.do_handshake()

    class Handler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(HTTP, req)

        def https_open(self, req: Any) -> Any:
            return self.do_open(HTTPS, req, context=self._context)

    opener = urllib.request.OpenerDirector()
    for handler in (Handler(), _OnlyHTTPRedirects(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor(), urllib.request.UnknownHandler()):
        opener.add_handler(handler)
    return opener


def _scratch_file(scratch: Path, data: bytes, suffix: str) -> str:
    """`data` written to a new file in the request's scratch directory (named by a counter and one of VIDEO_TYPES'
    suffixes, never by the request)."""
    path = scratch / f"video-{len(list(scratch.iterdir()))}{suffix}"
    path.write_bytes(data)
    log.debug("wrote %d bytes of video to %s", len(data), path)
    return str(path)
