"""Git's C-style quoting of unusual paths (``"a/t\\303\\244b"``), both directions.

Git quotes a path in diff headers when it holds control characters, quotes, backslashes or
non-ASCII bytes; reading such headers literally would produce wrong paths.
"""

from __future__ import annotations

from .text import decode, encode

_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_QUOTED = {value: key for key, value in _ESCAPES.items()}


def unquote_path(token: str) -> str:
    """Undo git quoting when ``token`` is a quoted path; return other tokens unchanged."""
    if len(token) < 2 or not (token.startswith('"') and token.endswith('"')):
        return token
    body = encode(token[1:-1])
    out = bytearray()
    index = 0
    while index < len(body):
        byte = body[index]
        if byte != 0x5C or index + 1 == len(body):
            out.append(byte)
            index += 1
            continue
        escape = chr(body[index + 1])
        if escape in "01234567":
            digits = body[index + 1 : index + 4]
            out.append(int(digits.decode("ascii"), 8) & 0xFF)
            index += 1 + len(digits)
        else:
            out.append(_ESCAPES.get(escape, body[index + 1]))
            index += 2
    return decode(bytes(out))


def needs_quoting(path: str) -> bool:
    data = encode(path)
    return any(byte < 0x20 or byte >= 0x7F or byte in (0x22, 0x5C) for byte in data)


def quote_path(path: str) -> str:
    """Quote ``path`` the way git does in headers, or return it unchanged if plain."""
    if not needs_quoting(path):
        return path
    out = []
    for byte in encode(path):
        if byte in _QUOTED:
            out.append("\\" + _QUOTED[byte])
        elif byte < 0x20 or byte >= 0x7F:
            out.append("\\%03o" % byte)
        else:
            out.append(chr(byte))
    return '"' + "".join(out) + '"'
