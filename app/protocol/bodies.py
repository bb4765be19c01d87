"""Request bodies and the encodings inside them: gzip or deflate bodies inflated within max_body_bytes, base64.

tritonclient.http compresses request bodies when asked (`request_compression_algorithm`). The Twisted site
bounds the compressed body as it arrives; here the inflated size is bounded too, as it is produced, so a
small body that would inflate past the limit is refused (413) after at most `limit + 1` bytes of output,
never held whole. Pure functions over bytes; no Flask.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib

from ..errors import BodyTooLarge, InvalidBody, UnsupportedContentEncoding

_WBITS = {"gzip": 31, "x-gzip": 31}  # gzip header and trailer
MAX_MEMBERS = 64  # concatenated gzip members; more is an odd body, not a useful one
_BASE64 = re.compile(rb"^[A-Za-z0-9+/=_\-\s]*$")


def inflate(data: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Return the body decoded per its Content-Encoding (identity, gzip or deflate), at most `limit` bytes.

    Raise BodyTooLarge past the limit, InvalidBody for corrupt or truncated data, and
    UnsupportedContentEncoding for any other coding (stacked codings included).
    """
    coding = (content_encoding or "").strip().lower()
    if coding in ("", "identity"):
        return data
    if coding in _WBITS:
        wbits = _WBITS[coding]
    elif coding == "deflate":
        # HTTP's deflate is the zlib format (RFC 9110), as tritonclient sends it; some clients send raw
        # deflate, which has no zlib header: accept both.
        wbits = 15 if _zlib_header(data) else -15
    else:
        raise UnsupportedContentEncoding(
            f"Content-Encoding {coding[:40]!r} is not accepted; send gzip, deflate or identity")
    out = bytearray()
    rest = data
    for _ in range(MAX_MEMBERS):
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
            if len(out) <= limit and not inflater.unconsumed_tail:
                out += inflater.flush(limit + 1 - len(out))
        except zlib.error as exc:
            raise InvalidBody(f"the {coding} body is corrupt: {exc}") from None
        if len(out) > limit:
            raise BodyTooLarge(f"the {coding} body inflates to more than the limit of {limit} bytes")
        if not inflater.eof:
            raise InvalidBody(f"the {coding} body is truncated")
        rest = inflater.unused_data
        if not rest or wbits != 31:
            if rest:
                raise InvalidBody(f"the {coding} body has {len(rest)} bytes after its end")
            return bytes(out)
    raise InvalidBody(f"the {coding} body has more than {MAX_MEMBERS} members")


def _zlib_header(data: bytes) -> bool:
    """True if the data starts with a zlib header (deflate method, and the check bits that RFC 1950 asks)."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def decode_base64(item, where: str) -> bytes:
    """Decode one base64 string (standard or URL-safe alphabet, padding optional, a data URL's prefix allowed)."""
    if not isinstance(item, str):
        raise InvalidBody(f"{where} must be a base64 string")
    data = item.encode("ascii", "replace")
    if data.startswith(b"data:"):  # tolerate data URLs: data:image/png;base64,....
        data = data.split(b",", 1)[-1]
    if not _BASE64.match(data):
        raise InvalidBody(f"{where} is not valid base64")
    data = re.sub(rb"\s+", b"", data).replace(b"-", b"+").replace(b"_", b"/")
    try:
        return base64.b64decode(data + b"=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidBody(f"{where} is not valid base64") from None


def json_object(data: bytes, what: str, expected: str = "a JSON object") -> dict:
    """Parse `what` (e.g. "the body") as a JSON object; nesting too deep for the parser is a 400, never a crash."""
    try:
        document = json.loads(data)
    except RecursionError:
        raise InvalidBody(f"{what} is nested too deeply") from None
    except ValueError as exc:
        raise InvalidBody(f"{what} is not valid JSON: {str(exc)[:100]}") from None
    if not isinstance(document, dict):
        raise InvalidBody(f"{what} must be {expected}")
    return document
