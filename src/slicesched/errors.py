"""Errors a user can fix: bad input files and scenario fields.

The CLI turns an ``InputError`` into one line on stderr and exit status 2, with no
traceback, so every loader raises it (never a bare ValueError) for malformed input.
"""

from __future__ import annotations


class InputError(Exception):
    """Malformed user input, located by file, line and field."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.file, self.line, self.field, self.message = file, line, field, message
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = ""
        if self.file:
            where = str(self.file) + (f":{self.line}" if self.line is not None else "")
        if self.field:
            where = f"{where}: field '{self.field}'" if where else f"field '{self.field}'"
        line = f"{where}: {self.message}" if where else self.message
        return " ".join(line.split())  # one line, whatever a library put in the message
