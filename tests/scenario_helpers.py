"""Scenarios written inline in tests, as TOML text."""

import textwrap
import tomllib

from slicesched.config import Scenario, parse_scenario


def scenario(text: str, source: str = "<scenario>") -> Scenario:
    """The scenario an indented TOML string describes."""
    return parse_scenario(tomllib.loads(textwrap.dedent(text)), source=source)
