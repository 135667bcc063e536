"""The cluster tier's block write and budget counter: one atomic script per block, a counter read strictly.

A block is a value key and a metadata key on one slot (one hash tag). :data:`PUT_SCRIPT` writes them together,
server side, so a write never leaves them disagreeing:

- the value key is empty: ``SET NX`` of the value, then the metadata; answers ``1`` (stored, new bytes);
- the value key holds exactly these bytes (another writer of the same prefix): the metadata is set to agree with
  them; answers ``2`` (stored, no new bytes);
- anything else (a foreign or planted value, another type, other bytes): nothing is written; answers ``0``.

The usage counter (``INCRBY``) is read bounded (``GETRANGE``) and trusted only as a decimal integer in
``[0, 2**63)`` with no sign, spaces or underscores: :func:`parse_usage` answers None for anything else, and the
caller refuses the write (a planted negative counter must not open the budget).
"""

from __future__ import annotations

import re

__all__ = ["PUT_NEW", "PUT_REFUSED", "PUT_SAME", "PUT_SCRIPT", "USAGE_READ_BYTES", "parse_usage"]

PUT_REFUSED, PUT_NEW, PUT_SAME = 0, 1, 2

# KEYS: value key, metadata key. ARGV: the value, its metadata, the TTL in ms ("0": none).
PUT_SCRIPT = """
local px = tonumber(ARGV[3])
local function set(key, value, nx)
  local args = {'SET', key, value}
  if px > 0 then args[#args + 1] = 'PX'; args[#args + 1] = px end
  if nx then args[#args + 1] = 'NX' end
  return redis.call(unpack(args))
end
if set(KEYS[1], ARGV[1], true) then
  set(KEYS[2], ARGV[2], false)
  return 1
end
if redis.call('TYPE', KEYS[1])['ok'] == 'string' and redis.call('STRLEN', KEYS[1]) == #ARGV[1]
    and redis.call('GET', KEYS[1]) == ARGV[1] then
  set(KEYS[2], ARGV[2], false)
  return 2
end
return 0
"""

USAGE_READ_BYTES = 20  # 2**63 - 1 has 19 digits: one more byte tells a longer (untrusted) counter apart
_USAGE = re.compile(rb"0|[1-9][0-9]{0,18}")


def parse_usage(raw: object) -> int | None:
    """A usage counter as read (``GETRANGE 0 19``): its bytes, or None when it cannot be trusted.

    ``b""`` (no counter yet) is 0. Anything but the decimal form ``INCRBY`` writes, within ``[0, 2**63)``, is None:
    negative, signed, spaced, fractional, non-ASCII, too long, or not bytes at all (an error reply)."""
    if not isinstance(raw, bytes):
        return None
    if raw == b"":
        return 0
    if not _USAGE.fullmatch(raw):
        return None
    used = int(raw)
    return used if used < 2**63 else None
