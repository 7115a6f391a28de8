"""One error hierarchy. Every user-facing error carries a message a person can act on.

The API layer maps these to OpenAI-shaped responses in one place (`http_status`,
`error_type`); the CLI prints `message` on one line and exits non-zero.
"""


class SpecrlError(Exception):
    """Base class of every error specrl raises on purpose."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(SpecrlError):
    """The caller asked for something impossible (bad prompt, bad sampling parameters)."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(SpecrlError):
    """Unknown model alias or a model directory that does not exist."""

    http_status = 404
    error_type = "not_found_error"


class ModelFetchError(SpecrlError):
    """The default model could not be downloaded or converted."""

    error_type = "model_fetch_error"


class IncompatibleDrafterError(SpecrlError):
    """A drafter whose hidden size, vocabulary or architecture does not fit the target."""

    http_status = 400
    error_type = "invalid_request_error"


class QueueFullError(SpecrlError):
    """The engine is saturated: the waiting queue is at its bound."""

    http_status = 429
    error_type = "rate_limit_error"
