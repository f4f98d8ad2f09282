"""Reading an image a client sent: a data: URL, base64, a local file path (or file:// URL), raw
bytes, or (only when the server allows it) an http(s) URL; checked against size limits before it
is decoded, so a huge or broken image is an `ImageInputError` naming the problem, never a crash."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.request
from dataclasses import dataclass
from typing import Any

MB = 1 << 20


class ImageInputError(ValueError):
    """A request's image cannot be used (unreadable, too large, too many, not matching the
    prompt's image tokens): a 400 about the request's image field. The message starts with
    where the image was in the request (e.g. `image_data[0]`)."""


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be: bytes per image (encoded), pixels per image, images per
    request, and whether http(s) URLs are fetched (a security surface: off by default)."""

    max_bytes: int = 20 * MB
    max_pixels: int = 6000 * 6000
    max_images: int = 8
    allow_remote: bool = False
    fetch_timeout: float = 10.0


def load_image(source: Any, limits: ImageLimits, where: str) -> Any:
    """The RGB `PIL.Image` of `source`; ImageInputError naming `where` (e.g. "image_data[0]")
    and the problem otherwise."""
    from PIL import Image, UnidentifiedImageError

    data = _read_bytes(source, limits, where)
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageInputError(
                f"{where}: the image has {width}x{height} pixels, more than the "
                f"{limits.max_pixels} allowed"
            )
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"{where}: the image cannot be decoded ({exc})") from None
    return image.convert("RGB")


def _read_bytes(source: Any, limits: ImageLimits, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, dict) and "url" in source:  # {"url": ...} (OpenAI's image_url)
        return _read_bytes(source["url"], limits, where)
    elif not isinstance(source, str) or not source:
        raise ImageInputError(f"{where}: an image is a data: URL, a file path, base64 or an URL")
    elif source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise ImageInputError(f"{where}: a data: URL image must be base64-encoded")
        data = _b64(payload, limits, where)
    elif source.startswith(("http://", "https://")):
        data = _fetch(source, limits, where)
    elif source.startswith("file://") or os.path.isfile(source):
        data = _read_file(source.removeprefix("file://"), limits, where)
    else:
        data = _b64(source, limits, where)
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"{where}: the image is larger than {limits.max_bytes} bytes")
    return data


def _b64(payload: str, limits: ImageLimits, where: str) -> bytes:
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ImageInputError(f"{where}: the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(
            f"{where}: not a data: URL, an existing file, an URL or valid base64"
        ) from None


def _read_file(path: str, limits: ImageLimits, where: str) -> bytes:
    try:
        if os.path.getsize(path) > limits.max_bytes:
            raise ImageInputError(f"{where}: the image is larger than {limits.max_bytes} bytes")
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ImageInputError(f"{where}: cannot read the image file ({exc.strerror})") from None


def _fetch(url: str, limits: ImageLimits, where: str) -> bytes:
    if not limits.allow_remote:
        raise ImageInputError(
            f"{where}: image URLs are not fetched unless the server runs with "
            "--allow-remote-images; send a data: URL instead"
        )
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as response:  # noqa: S310
            data = response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as exc:
        raise ImageInputError(f"{where}: cannot fetch the image ({exc})") from None
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"{where}: the image is larger than {limits.max_bytes} bytes")
    return data
