"""A tool call written as one JSON object, ``{"name": "f", "arguments": {...}}``, read from a prefix.

The name is the first "name" member, once it is a complete non-empty string. The arguments are the raw
text of the first member named by one of `argument_keys` (not re-serialized, so streamed fragments and the
final value agree): the whole value once complete, else the value scanned so far without its trailing
whitespace (a later scan may put a value character there, never take one away). An object that is over
(closed, broken, or cut off by the end of a final text) without an arguments member has arguments "{}".
Each is a prefix of what a longer text gives, because the scan is prefix-stable (see json_scan).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenos.tool_parsers.base import ParsedCall
from tokenos.tool_parsers.json_scan import ObjectScan, scan_object

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ObjectCall:
    name: str | None  # None until known; a call is reported only once it is
    arguments: str
    # Where the text after the object resumes: after its "}", at the point it broke, or at the end of a
    # final text; None while the object may still grow.
    resume: int | None
    broken: bool = False


def read_object_call(
    text: str, start: int, final: bool, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
) -> ObjectCall:
    scan = scan_object(text, start)
    over = scan.closed or scan.broken or final
    resume = scan.stop if over else None
    return ObjectCall(_name(scan), _arguments(text, scan, argument_keys, over), resume, scan.broken)


def take_object_call(text: str, pos: int, final: bool, calls: list[ParsedCall]) -> tuple[bool, int | None]:
    """Read the call object at `pos` of a sequence of them, appending it to `calls` once it has a name.
    (False, where the next one may start) to go on; (True, where content starts, or None for none)
    when the sequence ends here: an object without a name becomes content (when over), a broken one
    hands the rest of the text to content, an incomplete one ends the parse for now."""
    obj = read_object_call(text, pos, final)
    if obj.name is None:
        return True, None if obj.resume is None else pos
    calls.append(ParsedCall(obj.name, obj.arguments))
    if obj.resume is None:
        return True, None
    if obj.broken:
        return True, obj.resume
    return False, obj.resume


def _name(scan: ObjectScan) -> str | None:
    member = scan.first("name")
    return member.string if member is not None and member.string else None


def _arguments(text: str, scan: ObjectScan, keys: tuple[str, ...], over: bool) -> str:
    member = scan.first(*keys)
    if member is None:
        return "{}" if over else ""
    if member.end is not None:
        return text[member.start : member.end]
    # Incomplete: the scan stopped inside this value (it is always the last member then).
    return text[member.start : scan.stop].rstrip()
