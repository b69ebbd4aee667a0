"""Errors the engine's users handle (light to import: no torch)."""


class EngineDeadError(RuntimeError):
    pass


class BadRequest(ValueError):
    """The request itself is wrong (a field's value, a prompt the model cannot run): the client's
    error, answered 400 / ``INVALID_ARGUMENT`` with this message by a server. A ``ValueError``,
    so offline callers that catch those keep working; a server answers 400 for this type (and
    for its request models' validation errors) only, never for any ``ValueError``."""


class RequestIdInUse(BadRequest):
    """A request id that another request on this engine (or replica) still holds. Refusing it
    must leave that other request alone: nothing is aborted by the id."""
