"""server/media.py: image content parts -> RGB PIL images, and every way one is refused.

No network: http(s) goes through a fake fetch, except the default urllib fetch, which is driven against
a loopback http.server on 127.0.0.1 (redirects, the streaming size cap)."""

from __future__ import annotations

import base64
import http.server
import io
import os
import random
import struct
import threading
import time
import urllib.parse
import warnings
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from swaserve.server.media import MediaError, MediaPolicy, check_image_count, image_from_part, make_fetch

P = "messages[1].content[2].image_url"
POLICY = MediaPolicy()
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str, detail: str | None = None) -> dict:
    ref: dict = {"url": url}
    if detail is not None:
        ref["detail"] = detail
    return {"type": "image_url", "image_url": ref}


def decode(url: str, policy: MediaPolicy = POLICY, **kw) -> Image.Image:
    return image_from_part(part(url), P, policy, **kw)


def refused(p: dict, phrase: str, policy: MediaPolicy = POLICY, param: str = P, **kw) -> MediaError:
    with pytest.raises(MediaError) as ei:
        image_from_part(p, param, policy, **kw)
    err = ei.value
    assert err.param == param
    assert phrase in str(err), str(err)
    assert str(err).startswith(param)
    return err


def noise(size: tuple[int, int], seed: int = 0) -> Image.Image:
    rnd = random.Random(seed)
    return Image.frombytes("RGB", size, rnd.randbytes(size[0] * size[1] * 3))


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR claims w x h (8-bit RGB), with a tiny IDAT: nothing near w*h is ever stored."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


# ---- formats ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,mime,kw",
    [
        ("PNG", "image/png", {}),
        ("JPEG", "image/jpeg", {"quality": 95}),
        ("WEBP", "image/webp", {"lossless": True}),
        ("GIF", "image/gif", {}),
        ("BMP", "image/bmp", {}),
    ],
)
def test_formats_round_trip(fmt: str, mime: str, kw: dict) -> None:
    src = Image.new("RGB", (37, 23), RED)
    im = decode(data_url(encode(src, fmt, **kw), mime))
    assert im.mode == "RGB" and im.size == (37, 23)
    r, g, b = im.getpixel((5, 5))
    assert r > 240 and g < 15 and b < 15


def test_declared_mime_may_differ_from_the_content() -> None:
    # a PNG declared as image/jpeg decodes (llama.cpp and vLLM sniff the bytes too)
    im = decode(data_url(encode(Image.new("RGB", (4, 3), BLUE), "PNG"), "image/jpeg"))
    assert im.size == (4, 3) and im.getpixel((0, 0)) == BLUE


def test_data_url_leniency() -> None:
    png = encode(Image.new("RGB", (4, 3), RED), "PNG")
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i : i + 60] for i in range(0, len(b64), 60))
    assert decode(f"data:image/png;base64,{wrapped}").size == (4, 3)  # line breaks
    assert decode(f"data:image/png;base64,{b64.rstrip('=')}").size == (4, 3)  # missing padding
    assert decode(f"DATA:IMAGE/PNG;charset=x;BASE64,{b64}").size == (4, 3)  # case, parameters
    urlsafe = base64.urlsafe_b64encode(png).decode()
    assert decode(f"data:image/png;base64,{urlsafe}").size == (4, 3)
    assert decode("  " + data_url(png) + " ").size == (4, 3)
    quoted = urllib.parse.quote_from_bytes(png)
    assert decode(f"data:image/png,{quoted}").size == (4, 3)  # RFC 2397 percent-encoding, no base64


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (8, 6), RED), Image.new("RGB", (8, 6), BLUE)]
    kw = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **kw)
    with Image.open(io.BytesIO(data)) as check:
        assert getattr(check, "n_frames", 1) == 2
    im = decode(data_url(data, f"image/{fmt.lower()}"))
    assert im.mode == "RGB" and im.size == (8, 6)
    assert im.getpixel((3, 3)) == RED


def test_modes_to_rgb() -> None:
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 0, 255, 0))  # fully transparent: white after compositing
    im = decode(data_url(encode(rgba, "PNG")))
    assert im.mode == "RGB" and im.getpixel((0, 0)) == WHITE and im.getpixel((1, 1)) == RED

    pal = Image.new("P", (4, 4), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.putpixel((0, 0), 0)
    im = decode(data_url(encode(pal, "PNG", transparency=0)))
    assert im.getpixel((0, 0)) == WHITE and im.getpixel((1, 1)) == RED

    la = Image.new("LA", (4, 4), (100, 255))
    assert decode(data_url(encode(la, "PNG"))).getpixel((0, 0)) == (100, 100, 100)

    gray16 = Image.new("I;16", (4, 4), 40000)
    im = decode(data_url(encode(gray16, "PNG")))
    assert im.mode == "RGB" and im.getpixel((0, 0)) == (155, 155, 155)  # 40000 / 257, not clipped

    cmyk = Image.new("CMYK", (4, 4), (0, 255, 255, 0))
    r, g, b = decode(data_url(encode(cmyk, "JPEG", quality=95), "image/jpeg")).getpixel((1, 1))
    assert r > 240 and g < 15 and b < 15

    one = Image.new("1", (4, 4), 1)
    assert decode(data_url(encode(one, "BMP"), "image/bmp")).getpixel((0, 0)) == WHITE


def test_exif_orientation_applied() -> None:
    src = Image.new("RGB", (20, 10), RED)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    im = decode(data_url(encode(src, "JPEG", exif=exif.tobytes()), "image/jpeg"))
    assert im.size == (10, 20)


# ---- refused data ------------------------------------------------------------------------------------


def test_wrong_mime_and_non_image_bytes() -> None:
    png = encode(Image.new("RGB", (4, 4)), "PNG")
    refused(part(data_url(png, "text/plain")), "must be image/*")
    refused(part("data:;base64," + base64.b64encode(png).decode()), "'text/plain'")
    refused(part(data_url(b"hello, this is not an image at all")), "not an image")
    refused(part(data_url(b"%PDF-1.4 " + b"x" * 100)), "not an image")
    tiff = encode(Image.new("RGB", (4, 4)), "TIFF")
    refused(part(data_url(tiff, "image/tiff")), "not an image")  # a format not on the list
    refused(part("data:image/png;base64"), "no ','")
    refused(part("data:image/png;base64,"), "empty")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated(fmt: str) -> None:
    data = encode(noise((64, 64)), fmt)
    refused(part(data_url(data[: len(data) // 2])), "truncated")
    refused(part(data_url(data[:20])), "")  # header only: not an image or truncated, a MediaError


def test_corrupt_payload() -> None:
    data = bytearray(encode(noise((32, 32)), "PNG"))
    data[60:200] = b"\xff" * 140  # garbage in the IDAT stream
    refused(part(data_url(bytes(data))), "")


def test_bad_base64() -> None:
    refused(part("data:image/png;base64,iVBOR!!!!"), "invalid base64")
    refused(part("data:image/png;base64,A"), "invalid base64")
    refused(part("data:image/png;base64,ïïïï"), "invalid base64")


def test_decompression_bomb_header_fails_fast() -> None:
    data = png_header_only(100_000, 100_000)
    t0 = time.perf_counter()
    refused(part(data_url(data)), "too many pixels")
    assert time.perf_counter() - t0 < 1.0
    # over the policy, under Pillow's own limit: our check, before any decoding
    t0 = time.perf_counter()
    refused(part(data_url(png_header_only(8000, 8000))), "8000x8000")
    assert time.perf_counter() - t0 < 1.0


def test_pillow_bomb_warning_is_an_error_locally() -> None:
    # policy allows it, Pillow's MAX_IMAGE_PIXELS (~89 M) warns: an error here, the filters restored
    before = list(warnings.filters)
    big = MediaPolicy(max_image_pixels=10**12)
    refused(part(data_url(png_header_only(10_000, 10_000))), "too many pixels", policy=big)
    assert warnings.filters == before


def test_pixel_limit_on_a_real_image() -> None:
    url = data_url(encode(Image.new("RGB", (20, 10)), "PNG"))
    refused(part(url), "20x10", policy=MediaPolicy(max_image_pixels=199))
    assert decode(url, MediaPolicy(max_image_pixels=200)).size == (20, 10)


def test_over_size_bytes() -> None:
    data = encode(noise((64, 64)), "PNG")
    small = MediaPolicy(max_image_bytes=len(data) - 1)
    refused(part(data_url(data)), "too large", policy=small)
    assert decode(data_url(data), MediaPolicy(max_image_bytes=len(data))).size == (64, 64)
    # refused by the base64 length alone, before decoding (an invalid payload would otherwise say so)
    refused(
        part("data:image/png;base64," + "!" * 10_000), "too large", policy=MediaPolicy(max_image_bytes=100)
    )


def test_too_many_images() -> None:
    check_image_count(16, POLICY)
    with pytest.raises(MediaError) as ei:
        check_image_count(17, POLICY)
    assert ei.value.param == "messages" and "too many images" in str(ei.value)
    with pytest.raises(MediaError):
        check_image_count(3, MediaPolicy(max_images=2))


# ---- part shapes and detail -------------------------------------------------------------------------


def test_shapes() -> None:
    url = data_url(encode(Image.new("RGB", (5, 4), RED), "PNG"))
    assert image_from_part({"type": "image_url", "image_url": url}, P, POLICY).size == (5, 4)
    resp = {"type": "input_image", "image_url": url, "detail": "high"}
    assert image_from_part(resp, "input[0].content[1]", POLICY).size == (5, 4)
    refused(
        {"type": "input_image", "file_id": "file-abc"},
        "file_id is not supported; send image_url",
        param="input[0].content[1]",
    )
    refused({"type": "input_image"}, "needs image_url")
    refused({"type": "image_url", "image_url": {}}, "url is required")
    refused({"type": "image_url", "image_url": {"url": 3}}, "must be a string")
    refused({"type": "image_url", "image_url": {"url": "  "}}, "empty")
    refused({"type": "input_audio", "input_audio": {}}, "unsupported content part type")
    refused(["not", "a", "dict"], "must be an object")  # type: ignore[arg-type]


@pytest.mark.parametrize("detail", ["auto", "low", "high", None])
def test_detail_ok(detail: str | None) -> None:
    url = data_url(encode(Image.new("RGB", (5, 4)), "PNG"))
    assert image_from_part(part(url, detail), P, POLICY).size == (5, 4)  # detail never changes decoding


def test_detail_invalid() -> None:
    url = data_url(encode(Image.new("RGB", (5, 4)), "PNG"))
    refused(part(url, "medium"), "detail must be one of")
    refused({"type": "input_image", "image_url": url, "detail": "ultra"}, "detail must be one of")


@pytest.mark.parametrize(
    "url,phrase",
    [
        ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
        ("javascript:alert(1)", "unsupported image URL scheme 'javascript'"),
        ("images/a.png", "must be a data:, http(s):// or file:// URL"),
        ("/etc/passwd", "must be a data:, http(s):// or file:// URL"),
        ("//example.com/a.png", "must be a data:, http(s):// or file:// URL"),
    ],
)
def test_other_schemes(url: str, phrase: str) -> None:
    refused(part(url), phrase)


# ---- http(s) -----------------------------------------------------------------------------------------


class FakeFetch:
    def __init__(self, result: bytes | Exception) -> None:
        self.result = result
        self.calls: list[tuple[str, float, int]] = []

    def __call__(self, url: str, timeout_s: float, max_bytes: int) -> bytes:
        self.calls.append((url, timeout_s, max_bytes))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_http_disabled_by_default() -> None:
    fetch = FakeFetch(b"")
    refused(part("https://example.com/a.png"), "--allowed-media-domains HOST", fetch=fetch)
    refused(part("http://example.com/a.png"), "fetching image URLs is disabled", fetch=fetch)
    assert fetch.calls == []


def test_http_allowed_domain() -> None:
    png = encode(Image.new("RGB", (6, 7), BLUE), "PNG")
    policy = MediaPolicy(allowed_domains=("example.com",), fetch_timeout_s=3.0)
    fetch = FakeFetch(png)
    for url in ["https://example.com/a.png", "http://cdn.Example.COM./x?y=1", "https://example.com:8443/a"]:
        assert decode(url, policy, fetch=fetch).size == (6, 7)
    assert fetch.calls[0] == ("https://example.com/a.png", 3.0, policy.max_image_bytes)
    n = len(fetch.calls)
    for url, host in [
        ("https://evil.com/a.png", "evil.com"),
        ("https://notexample.com/a.png", "notexample.com"),
        ("https://example.com.evil.com/a.png", "example.com.evil.com"),
        ("https://example.com@evil.com/a.png", "evil.com"),
    ]:
        refused(part(url), f"host '{host}' is not in --allowed-media-domains", policy=policy, fetch=fetch)
    refused(part("https:///a.png"), "no host", policy=policy, fetch=fetch)
    refused(part("http://[::1/a.png"), "malformed", policy=policy, fetch=fetch)
    assert len(fetch.calls) == n


def test_http_fetch_failures() -> None:
    policy = MediaPolicy(allowed_domains=("example.com",), max_image_bytes=1000)
    url = "https://example.com/a.png"
    refused(
        part(url),
        "could not fetch the image URL: OSError: boom",
        policy=policy,
        fetch=FakeFetch(OSError("boom")),
    )
    refused(part(url), "could not fetch", policy=policy, fetch=FakeFetch(TimeoutError("timed out")))
    refused(part(url), "too large", policy=policy, fetch=FakeFetch(b"x" * 1001))
    refused(part(url), "not an image", policy=policy, fetch=FakeFetch(b"<html></html>"))
    refused(part(url), "empty", policy=policy, fetch=FakeFetch(b""))
    refused(part(url), "no bytes", policy=policy, fetch=FakeFetch("text"))  # type: ignore[arg-type]


class _Handler(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/img.png":
            body = self.png
        elif self.path == "/big":  # no Content-Length: the cap works while streaming
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x" * 1000)
            return
        elif self.path in ("/drip-body", "/drip-headers"):  # never finishes within the fetch timeout
            if self.path == "/drip-body":
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
            else:
                self.wfile.write(b"HTTP/1.0 200 OK\r\n")
            try:
                for i in range(30):
                    time.sleep(0.1)
                    self.wfile.write(b"x" if self.path == "/drip-body" else b"X-%d: y\r\n" % i)
                    self.wfile.flush()
            except OSError:  # the client gave up: the point of the test
                pass
            return
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            target = self.path.split("?to=", 1)[1]
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def loopback() -> Iterator[str]:
    _Handler.png = encode(Image.new("RGB", (9, 8), RED), "PNG")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_default_fetch_loopback(loopback: str) -> None:
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), max_image_bytes=10_000, fetch_timeout_s=5.0)
    assert decode(f"{loopback}/img.png", policy).size == (9, 8)
    assert decode(f"{loopback}/redirect?to={loopback}/img.png", policy).size == (9, 8)
    port = loopback.rsplit(":", 1)[1]
    refused(
        part(f"{loopback}/redirect?to=http://localhost:{port}/img.png"),
        "host 'localhost' is not in --allowed-media-domains",
        policy=policy,
    )
    refused(part(f"{loopback}/redirect?to=file:///etc/passwd"), "HTTP 302", policy=policy)  # urllib refuses
    refused(part(f"{loopback}/big"), "too large", policy=policy)
    refused(part(f"{loopback}/missing"), "HTTP 404", policy=policy)
    assert make_fetch(policy)(f"{loopback}/img.png", 5.0, 10_000) == _Handler.png


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers"])
def test_default_fetch_total_deadline(loopback: str, path: str) -> None:
    # each recv is well within the socket timeout; the whole fetch is not: refused near timeout_s
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.4)
    t0 = time.monotonic()
    refused(part(loopback + path), "took longer than 0.4 s", policy=policy)
    assert time.monotonic() - t0 < 2.0  # the drip lasts 3 s


# ---- file:// -----------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path) -> tuple[str, str]:
    inside = tmp_path / "media"
    (inside / "sub").mkdir(parents=True)
    Image.new("RGB", (3, 2), RED).save(inside / "sub" / "a.png")
    Image.new("RGB", (3, 2), BLUE).save(tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", inside / "escape.png")
    os.symlink(inside / "sub" / "a.png", inside / "link.png")
    return str(inside), str(tmp_path)


def test_file_refused_by_default(media_dir: tuple[str, str]) -> None:
    inside, _ = media_dir
    refused(part(f"file://{inside}/sub/a.png"), "--allowed-local-media-path DIR")


def test_file_inside_and_outside(media_dir: tuple[str, str]) -> None:
    inside, root = media_dir
    policy = MediaPolicy(local_media_dir=inside)
    assert decode(f"file://{inside}/sub/a.png", policy).getpixel((0, 0)) == RED
    assert decode(f"file://localhost{inside}/sub/a.png", policy).size == (3, 2)
    assert decode(f"file://{inside}/link.png", policy).size == (3, 2)  # a symlink that stays inside
    assert decode(f"file://{inside}/sub/../sub/a.png", policy).size == (3, 2)
    outside = "is outside --allowed-local-media-path"
    refused(part(f"file://{root}/outside.png"), outside, policy=policy)
    refused(part(f"file://{inside}/../outside.png"), outside, policy=policy)
    refused(part(f"file://{inside}/%2E%2E/outside.png"), outside, policy=policy)
    refused(part(f"file://{inside}/escape.png"), outside, policy=policy)  # symlink pointing outside
    refused(part(f"file://{inside}-evil/a.png"), outside, policy=policy)  # a sibling with the prefix
    refused(part(f"file://{inside}/nope.png"), "file not found", policy=policy)
    refused(part(f"file://{inside}/sub"), "not a regular file", policy=policy)
    refused(part(f"file://otherhost{inside}/sub/a.png"), "local path", policy=policy)
    small = MediaPolicy(local_media_dir=inside, max_image_bytes=10)
    refused(part(f"file://{inside}/sub/a.png"), "too large", policy=small)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_file_fifo_does_not_hang(media_dir: tuple[str, str]) -> None:
    inside, _ = media_dir
    os.mkfifo(os.path.join(inside, "pipe.png"))
    refused(
        part(f"file://{inside}/pipe.png"), "not a regular file", policy=MediaPolicy(local_media_dir=inside)
    )
