"""Errors the engine's users handle (light to import: no torch)."""


class EngineDeadError(RuntimeError):
    pass
