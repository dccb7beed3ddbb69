"""Errors the engine raises. worker/errors.py maps each class to one gRPC status code."""


class EngineError(Exception):
    """Base class: a request the engine refused; nothing was changed."""


class ConfigError(EngineError):
    """A configuration or checkpoint that cannot run; raised at start-up."""


class InvalidArgument(EngineError):
    """Malformed input: bad token ids, empty or duplicate batch entries, over-long prompts."""


class NotFound(EngineError):
    """An unknown sequence id."""


class FailedPrecondition(EngineError):
    """A call out of order for the sequence's state (decode before prefill, step on a finished sequence)."""


class ResourceExhausted(EngineError):
    """No free slot or KV blocks, or a batch above the limit. busy: the request fits once live sequences end (no
    free slot or blocks now, though the cache could hold it), so a caller may wait and retry."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


class LoadCancelled(Exception):
    """A model load stopped by engine.loader.cancel_loading() (a signal during start-up); not an error
    of the configuration."""


class OutOfRange(EngineError):
    """A position outside what is kept: a KV-event cursor older than the log or beyond its end."""
