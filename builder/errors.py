"""The builder's error tree: every failure of `ifb build` is a BuildError with a clear message."""

from __future__ import annotations


class BuildError(Exception):
    """Base of every error raised while building an engine."""


class UnsupportedModelError(BuildError):
    """The source's architecture (or one of its features) is not one the network implements."""


class LimitsError(BuildError):
    """A requested limit is invalid or beyond what the model supports."""


class SourceError(BuildError):
    """The model source is missing, unreadable or incomplete."""
