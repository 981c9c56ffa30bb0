"""JSON schema string `format`s as regular expressions, for strings in Gemma's tool-call syntax.

response_format goes through llguidance's JSON schema support, which enforces these formats itself; a
tool argument is not JSON (server/chat/tool_grammar.py), so its strings get these expressions. Each is a
*subset* of what the format allows, written so that every match is valid under a format-checking
validator (tests/server/chat/test_schema_grammar.py checks them with jsonschema_rs): ASCII digits,
February stops at the 28th, hostnames have at most three labels (each starting with a letter), an
email's local part at most 62 characters, IPv6 is the full eight-group form, URIs are
scheme://host[:port]/path. The same names as llguidance's formats.
"""

from __future__ import annotations

_DAY = (r"(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
        r"|(?:0[13578]|1[02])-31)")
DATE = r"[0-9]{4}-" + _DAY
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = _LABEL + r"(?:\." + _LABEL + r"){0,2}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX4 = r"[0-9a-fA-F]{1,4}"
_DTIME = r"T(?:[0-9]{1,2}H(?:[0-9]{1,2}M(?:[0-9]{1,2}S)?)?|[0-9]{1,2}M(?:[0-9]{1,2}S)?|[0-9]{1,2}S)"
_DDATE = r"(?:[0-9]{1,4}Y(?:[0-9]{1,2}M(?:[0-9]{1,2}D)?)?|[0-9]{1,2}M(?:[0-9]{1,2}D)?|[0-9]{1,3}D)"

FORMATS: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE + "T" + TIME,
    "duration": "P(?:" + _DDATE + "(?:" + _DTIME + ")?|" + _DTIME + "|[0-9]{1,2}W)",
    "email": r"[A-Za-z0-9_+-]{1,20}(?:\.[A-Za-z0-9_+-]{1,20}){0,2}@" + _LABEL + r"(?:\." + _LABEL + r"){1,2}",
    "hostname": HOSTNAME,
    "ipv4": _OCTET + r"(?:\." + _OCTET + r"){3}",
    "ipv6": _HEX4 + r"(?::" + _HEX4 + r"){7}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "uri": r"[a-z][a-z0-9+.-]{0,15}://" + HOSTNAME + r"(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~-]{0,32}){0,4}",
}
