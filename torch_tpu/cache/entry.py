"""The envelope of one cache entry: checked, self-describing, pickle-free.

Owns: turning (key, payload, metadata) into bytes and back, and refusing any
blob that is truncated, corrupt, or stored under another key. Does not own
where entries live (store.py) or what a payload means (executable.py).

Layout (all integers big-endian):

    magic    8 bytes   b"TPUXC\\x00\\x01\\n"
    length   4 bytes   header length
    header   UTF-8 JSON {"key": ..., "size": payload length, ...metadata}
    payload  `size` bytes
    digest   32 bytes  SHA-256 of magic + length + header + payload

The digest covers the key (in the header) and the content, so a blob copied
under another name, cut short, or flipped by one bit is refused. Only JSON and
raw bytes are decoded: nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import struct

MAGIC = b"TPUXC\x00\x01\n"
_LENGTH = struct.Struct(">I")
_DIGEST = 32
_MAX_HEADER = 1 << 16


class CorruptEntry(ValueError):
    """A blob that is not a valid entry for the key asked for."""


def encode(key: str, payload: bytes, **metadata) -> bytes:
    """The entry bytes for `payload` stored under `key`; `metadata` must be JSON-serializable."""
    header = json.dumps({**metadata, "key": key, "size": len(payload)}, sort_keys=True).encode()
    if len(header) > _MAX_HEADER:
        raise ValueError("cache entry metadata too large")
    body = MAGIC + _LENGTH.pack(len(header)) + header + bytes(payload)
    return body + hashlib.sha256(body).digest()


def decode(key: str, blob: bytes) -> tuple[dict, bytes]:
    """(metadata, payload) of an entry, or CorruptEntry if it is not a whole, intact entry for `key`."""
    blob = bytes(blob)
    fixed = len(MAGIC) + _LENGTH.size
    if len(blob) < fixed + _DIGEST or not blob.startswith(MAGIC):
        raise CorruptEntry("not a torch_tpu cache entry (bad magic or too short)")
    (header_length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    if header_length > _MAX_HEADER or fixed + header_length + _DIGEST > len(blob):
        raise CorruptEntry("truncated entry header")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptEntry("checksum mismatch (truncated or corrupt entry)")
    try:
        header = json.loads(body[fixed:fixed + header_length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptEntry(f"unreadable entry header: {err}") from None
    if not isinstance(header, dict) or header.get("key") != key:
        raise CorruptEntry("entry stored under another key")
    payload = body[fixed + header_length:]
    if header.get("size") != len(payload):
        raise CorruptEntry("payload length does not match the header")
    return header, payload
