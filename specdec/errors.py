"""Errors shared by several layers, defined below all of them.

Each is re-exported where it was first defined (``specdec.config.ConfigError``,
``specdec.engine.executor.ExecutorError``, ``specdec.model.registry.ModelNotFoundError``), so
either import path names the same class.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is allowed."""


class ModelNotFoundError(ValueError):
    """The model name is neither a known alias nor an existing file or folder."""


class ExecutorError(RuntimeError):
    """A worker died or failed: the in-flight requests cannot finish on this executor."""
