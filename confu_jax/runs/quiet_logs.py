"""Keeping orbax's log lines a user cannot act on out of the CLIs' output (no heavy imports: the
training CLI installs this before JAX starts a backend)."""

from __future__ import annotations

import logging as pylog


class _OrbaxLogFilter(pylog.Filter):
    """Drops orbax's records a user cannot act on (see :func:`quiet_orbax_logs`)."""

    def __init__(self, info_too: bool):
        super().__init__()
        self.info_too = info_too

    def filter(self, record: pylog.LogRecord) -> bool:
        if "/orbax/" not in record.pathname:
            return True
        if self.info_too and record.levelno < pylog.WARNING:
            return False
        # Opening a finished run's checkpoints read-only (decoding, init_from, inspection) is what we
        # ask for; orbax warns about every read-only manager.
        return not record.getMessage().startswith("Given directory is read only")


_READ_ONLY_FILTER = _OrbaxLogFilter(info_too=False)
_CHATTER_FILTER = _OrbaxLogFilter(info_too=True)


def quiet_read_only_warning() -> None:
    """Drop only orbax's "Given directory is read only" warning (``Checkpointer(read_only=True)``)."""
    absl_logger = pylog.getLogger("absl")
    if _READ_ONLY_FILTER not in absl_logger.filters:
        absl_logger.addFilter(_READ_ONLY_FILTER)


def quiet_orbax_logs() -> None:
    """CLIs: drop orbax's INFO chatter (every save phase, handler registrations, throughput lines)
    and its read-only warning; its other warnings and errors still show. Idempotent. orbax logs
    through absl's logger, so the filter sits there."""
    absl_logger = pylog.getLogger("absl")
    if _CHATTER_FILTER not in absl_logger.filters:
        absl_logger.addFilter(_CHATTER_FILTER)
