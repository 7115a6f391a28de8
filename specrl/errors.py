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


class EngineUnavailableError(SpecrlError):
    """The engine thread is not running (it failed, or the server is shutting down)."""

    http_status = 503
    error_type = "service_unavailable"


class AuthError(SpecrlError):
    """Admin API: missing bearer token (401)."""

    http_status = 401
    error_type = "authentication_error"


class ForbiddenError(SpecrlError):
    """Admin API: wrong token, or the admin API is disabled (403)."""

    http_status = 403
    error_type = "permission_error"


# ---- weights: the store and hot swaps -----------------------------------------------------
class WeightsError(SpecrlError):
    """A checkpoint that cannot be stored, found or swapped in."""

    http_status = 400
    error_type = "invalid_request_error"


class WeightsNameError(WeightsError):
    """An unknown role or a version name that is not allowed."""


class WeightsNotFoundError(WeightsError):
    """A version, or a directory to publish, that does not exist."""

    http_status = 404
    error_type = "not_found_error"


class WeightsConflictError(WeightsError):
    """Publishing under an explicit version name that is already taken."""

    http_status = 409
    error_type = "conflict_error"


class CorruptWeightsError(WeightsConflictError):
    """A stored version that does not match its manifest (corrupt, truncated, modified, misplaced)."""


class SwapError(WeightsError):
    """A checkpoint that does not fit the serving model (architecture, shapes, unreadable)."""


class SwapInProgressError(WeightsConflictError):
    """A second swap while one is loading or pending."""
