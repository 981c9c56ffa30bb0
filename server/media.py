"""Image content parts -> decoded, validated RGB `PIL.Image.Image`, safely.

Accepts the chat shape ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (or
``"image_url": "<url>"``) and the Responses shape ``{"type": "input_image", "image_url": "<url>"}``.
URLs: ``data:image/...;base64,...`` always; ``http(s)://`` only for ``--allowed-media-domains`` hosts;
``file://`` only under ``--allowed-local-media-path``. Every failure is a `MediaError` (a 400 naming
the part); nothing else escapes and nothing hangs (sizes and pixel counts are capped before decoding,
fetches have a total deadline).

``detail`` (auto/low/high) is validated but does not change the decoding: Gemma 4's image processor
resizes every image to a fixed soft-token budget, so there is no low/high-resolution variant to pick.

Transparency is composited on white (what an image viewer on a light page shows); the first frame of
an animated GIF/APNG/WebP is used; the EXIF orientation is applied (what browsers show). Plain sync
code for the chat worker processes: no asyncio, no torch.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, ImageOps

Fetch = Callable[[str, float, int], bytes]

# Pillow format names we decode ("MPO" is the multi-picture JPEG many phone cameras write)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DECODED_OK = frozenset(_FORMATS) | {"MPO"}
_DETAILS = ("auto", "low", "high")
_WS = re.compile(rb"[\t\n\r ]+")
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class MediaPolicy:
    """Limits and sources allowed for images in one server (see the module docstring)."""

    max_image_bytes: int = 20 * 2**20  # encoded bytes per image
    max_image_pixels: int = 40_000_000  # width * height from the header, checked before decoding
    max_images: int = 16  # per request
    allowed_domains: tuple[str, ...] = ()  # http(s) hosts (exact or subdomain); empty: no network fetch
    local_media_dir: str | None = None  # file:// only under this directory; None: file:// refused
    fetch_timeout_s: float = 10.0


class MediaError(ValueError):
    """An invalid or refused image: a 400 whose `param` names the content part."""

    def __init__(self, message: str, param: str):
        self.reason = message
        self.param = param
        super().__init__(f"{param}: {message}")

    @property
    def message(self) -> str:
        """The full message (param-prefixed), for the error body."""
        return str(self)


def check_image_count(n: int, policy: MediaPolicy) -> None:
    """Raise MediaError (param "messages") when a request carries more than policy.max_images images."""
    if n > policy.max_images:
        raise MediaError(f"too many images: {n} (at most {policy.max_images} per request)", "messages")


def image_from_part(part: dict, param: str, policy: MediaPolicy, fetch: Fetch | None = None) -> Image.Image:
    """Decode one image content part into an RGB image; MediaError (naming `param`) on any problem.

    `fetch(url, timeout_s, max_bytes)` fetches http(s) URLs of allowed hosts; default: `make_fetch(policy)`.
    """
    try:
        url = _url_of(part, param)
        data = _load_bytes(url, param, policy, fetch)
        return _decode(data, param, policy)
    except MediaError:
        raise
    except Exception as e:  # anything unforeseen (a Pillow plugin bug, MemoryError...) is still a 400
        raise MediaError(f"invalid image: {type(e).__name__}: {e}", param) from e


# ---- the part's shape -------------------------------------------------------------------------------


def _url_of(part: object, param: str) -> str:
    if not isinstance(part, dict):
        raise MediaError("an image content part must be an object", param)
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        detail = part.get("detail")
        if isinstance(ref, dict):
            detail = ref.get("detail", detail)
            url = ref.get("url")
        else:
            url = ref
        if url is None:
            raise MediaError("image_url.url is required", param)
    elif kind == "input_image":
        url = part.get("image_url")
        detail = part.get("detail")
        if isinstance(url, dict):  # lenient: the chat object shape inside a Responses part
            detail = url.get("detail", detail)
            url = url.get("url")
        if url is None:
            if part.get("file_id") is not None:
                raise MediaError("file_id is not supported; send image_url", param)
            raise MediaError("input_image needs image_url", param)
    else:
        raise MediaError(f"unsupported content part type {kind!r} for an image", param)
    if detail is not None and detail not in _DETAILS:
        raise MediaError(f"detail must be one of 'auto', 'low', 'high', not {detail!r}", param)
    if not isinstance(url, str):
        raise MediaError("the image URL must be a string", param)
    url = url.strip()
    if not url:
        raise MediaError("the image URL is empty", param)
    return url


# ---- bytes from a URL -------------------------------------------------------------------------------


def _load_bytes(url: str, param: str, policy: MediaPolicy, fetch: Fetch | None) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme == "data":
        return _data_url_bytes(url, param, policy)
    if scheme in ("http", "https"):
        return _http_bytes(url, param, policy, fetch)
    if scheme == "file":
        return _file_bytes(url, param, policy)
    if not scheme:
        raise MediaError("the image URL must be a data:, http(s):// or file:// URL", param)
    raise MediaError(f"unsupported image URL scheme {scheme!r}; send a data: URL (base64)", param)


def _too_big(n: int, policy: MediaPolicy) -> str:
    return f"image is too large: {n} bytes (at most {policy.max_image_bytes})"


def _data_url_bytes(url: str, param: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data URL (no ',')", param)
    fields = [f.strip() for f in head.split(";")]
    mime = fields[0].lower()
    is_b64 = any(f.lower() == "base64" for f in fields[1:])
    if not mime.startswith("image/"):
        raise MediaError(f"data URL media type must be image/*, not {mime or 'text/plain'!r}", param)
    limit = policy.max_image_bytes
    if not is_b64:  # RFC 2397 percent-encoded bytes
        if len(payload) > 3 * limit:
            raise MediaError(_too_big(len(payload) // 3, policy), param)
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        # base64 is 4/3 the size: refuse by length before decoding (generous slack for line breaks)
        if len(payload) > (limit + 2) // 3 * 4 * 2 + 64:
            raise MediaError(_too_big(len(payload) * 3 // 4, policy), param)
        try:
            raw = _WS.sub(b"", payload.encode("ascii"))
        except UnicodeEncodeError:
            raise MediaError("invalid base64 in data URL (non-ASCII characters)", param) from None
        if len(raw) > (limit + 2) // 3 * 4:
            raise MediaError(_too_big(len(raw) * 3 // 4, policy), param)
        raw += b"=" * (-len(raw) % 4)  # lenient: clients that drop the padding
        try:
            if b"-" in raw or b"_" in raw:
                data = base64.b64decode(raw, altchars=b"-_", validate=True)
            else:
                data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("invalid base64 in data URL", param) from None
    if len(data) > limit:
        raise MediaError(_too_big(len(data), policy), param)
    if not data:
        raise MediaError("the data URL is empty", param)
    return data


def _host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for d in domains:
        d = d.lower().strip().strip(".")
        if d and (host == d or host.endswith("." + d)):
            return True
    return False


def _check_http_url(url: str, param: str, policy: MediaPolicy) -> None:
    if not policy.allowed_domains:
        raise MediaError(
            "fetching image URLs is disabled; start the server with --allowed-media-domains HOST "
            "to allow it, or send the image as a data: URL (base64)",
            param,
        )
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError:
        raise MediaError("malformed image URL", param) from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise MediaError("malformed image URL (no host)", param)
    if not _host_allowed(host, policy.allowed_domains):
        raise MediaError(f"host {host!r} is not in --allowed-media-domains", param)


def _http_bytes(url: str, param: str, policy: MediaPolicy, fetch: Fetch | None) -> bytes:
    _check_http_url(url, param, policy)
    fetcher = fetch if fetch is not None else make_fetch(policy)
    try:
        data = fetcher(url, policy.fetch_timeout_s, policy.max_image_bytes)
    except MediaError as e:
        raise MediaError(e.reason, param) from None
    except Exception as e:
        raise MediaError(f"could not fetch the image URL: {type(e).__name__}: {e}", param) from None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaError("could not fetch the image URL (no bytes)", param)
    data = bytes(data)
    if len(data) > policy.max_image_bytes:
        raise MediaError(_too_big(len(data), policy), param)
    if not data:
        raise MediaError("the fetched image is empty", param)
    return data


def make_fetch(policy: MediaPolicy) -> Fetch:
    """The default `fetch`: urllib, a total deadline, a size cap while streaming, and redirects
    followed only to http(s) hosts in policy.allowed_domains."""

    class _Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = 5

        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[override]
            _check_http_url(newurl, "redirect", policy)  # raises MediaError: the caller re-labels it
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    opener = urllib.request.build_opener(_Redirects)

    def fetch_blocking(url: str, timeout_s: float, max_bytes: int, deadline: float) -> bytes:
        req = urllib.request.Request(url, headers={"User-Agent": "swaserve", "Accept": "image/*"})
        try:
            with opener.open(req, timeout=timeout_s) as resp:
                length = resp.headers.get("Content-Length")
                if length and length.strip().isdigit() and int(length) > max_bytes:
                    raise MediaError(_too_big(int(length), policy), "")
                buf = bytearray()
                while time.monotonic() < deadline:
                    chunk = resp.read1(_CHUNK)  # read1: one recv, so a slow drip meets the deadline
                    if not chunk:
                        return bytes(buf)
                    buf += chunk
                    if len(buf) > max_bytes:
                        raise MediaError(f"image is too large: over {max_bytes} bytes", "")
                raise MediaError(f"fetching the image took longer than {timeout_s:g} s", "")
        except urllib.error.HTTPError as e:
            raise MediaError(f"fetching the image URL failed: HTTP {e.code}", "") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, MediaError):
                raise e.reason from None
            raise MediaError(f"could not fetch the image URL: {e.reason}", "") from None

    def fetch(url: str, timeout_s: float, max_bytes: int) -> bytes:
        # urllib's timeout is per socket operation (and DNS has none): a watchdog thread bounds the
        # whole fetch; a fetch past it is abandoned (a daemon thread, ended by its own socket timeouts)
        deadline = time.monotonic() + timeout_s
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["data"] = fetch_blocking(url, timeout_s, max_bytes, deadline)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=run, name="swaserve-media-fetch", daemon=True)
        worker.start()
        worker.join(timeout_s + 0.5)
        if worker.is_alive():
            raise MediaError(f"fetching the image took longer than {timeout_s:g} s", "")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["data"]  # type: ignore[return-value]

    return fetch


def _file_bytes(url: str, param: str, policy: MediaPolicy) -> bytes:
    if policy.local_media_dir is None:
        raise MediaError(
            "file:// image URLs are disabled; start the server with --allowed-local-media-path DIR "
            "to allow them",
            param,
        )
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        raise MediaError("malformed file:// URL", param) from None
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must name a local path (file:///path)", param)
    path = urllib.parse.unquote(parts.path)
    if not path or "\x00" in path:
        raise MediaError("malformed file:// URL", param)
    root = os.path.realpath(policy.local_media_dir)
    real = os.path.realpath(path)  # follows symlinks and collapses '..'
    try:
        inside = os.path.commonpath([root, real]) == root
    except ValueError:
        inside = False
    if not inside:
        raise MediaError("the file is outside --allowed-local-media-path", param)
    try:
        # O_NONBLOCK: a FIFO inside the directory must not hang the open; the fstat refuses it after
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise MediaError("file not found", param) from None
    except OSError as e:
        raise MediaError(f"cannot open the file: {e.strerror}", param) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError("not a regular file", param)
        if st.st_size > policy.max_image_bytes:
            raise MediaError(_too_big(st.st_size, policy), param)
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:
            data = f.read(policy.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise MediaError(_too_big(len(data), policy), param)
    if not data:
        raise MediaError("the file is empty", param)
    return data


# ---- decoding ---------------------------------------------------------------------------------------


def _decode(data: bytes, param: str, policy: MediaPolicy) -> Image.Image:
    # catch_warnings: DecompressionBombWarning becomes an error here only; the filters are restored
    # on exit (Pillow's own limit, Image.MAX_IMAGE_PIXELS, also applies; it is left as it is)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=_FORMATS) as im:
                if im.format not in _DECODED_OK:
                    raise MediaError(f"unsupported image format {im.format}", param)
                w, h = im.size
                if w <= 0 or h <= 0:
                    raise MediaError(f"invalid image size {w}x{h}", param)
                if w * h > policy.max_image_pixels:
                    raise MediaError(
                        f"image has too many pixels: {w}x{h} (at most {policy.max_image_pixels})", param
                    )
                im.seek(0)  # animated GIF / APNG / WebP: the first frame
                im.load()
                try:
                    upright = ImageOps.exif_transpose(im)
                except Exception:  # broken EXIF: show the pixels as stored, as browsers do
                    upright = im
                return _to_rgb(upright)
        except MediaError:
            raise
        except Image.UnidentifiedImageError:
            raise MediaError("not an image (or not PNG, JPEG, WebP, GIF or BMP)", param) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise MediaError(f"image has too many pixels ({e})", param) from None
        except Exception as e:  # truncated/corrupt data: OSError, SyntaxError, EOFError, struct.error...
            raise MediaError(f"corrupt or truncated image: {type(e).__name__}: {e}", param) from None


def _to_rgb(im: Image.Image) -> Image.Image:
    """A new RGB image; transparency composited on white; 16-bit grayscale scaled to 8 bits."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        im = im.convert("I").point(lambda v: v * (1 / 257)).convert("L")
    has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La")
    if has_alpha or (im.mode in ("P", "L", "RGB", "1") and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return im.convert("RGB")  # always a copy, independent of the source file
