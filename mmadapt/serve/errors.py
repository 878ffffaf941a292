"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status they travel under.

Every refusal of the server is an `APIError`: the handlers turn it into that body, so a client (the `openai` package
raises `BadRequestError`, `AuthenticationError`, `RateLimitError`, ... from the status) sees why in `message` and
which request field in `param`. The codes the server uses are listed in docs/serving.md. A message never holds an
absolute path of the server's (`without_paths`): a file is named by its last part.
"""

from __future__ import annotations

import re
from typing import Any

ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s'\"/<>]+/)+([^\s'\"/<>]*)")
"""An absolute POSIX path inside a message (not a URL's path: that follows a host name); group 1 is its last part."""


def without_paths(message: str) -> str:
    """`message` with each absolute path replaced by its last part: a client learns nothing of the server's files
    (its temporary directories, the image root, the installation) from an error."""
    return ABSOLUTE_PATH.sub(lambda m: m.group(1) or "<path>", message)

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "server_error"}


class APIError(Exception):
    """A request the server refuses or could not answer: HTTP `status`, a one-line `message` saying what and how to
    fix it, the request field it concerns (`param`, e.g. "messages[0].content[1].image_url") and a short `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = without_paths(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
