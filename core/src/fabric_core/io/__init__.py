"""Checkpoint I/O plugins: how checkpoints reach storage and come back."""

from __future__ import annotations

from fabric_core.io.checkpoint_io import CheckpointIO, TorchCheckpointIO, atomic_save

__all__ = ["CheckpointIO", "TorchCheckpointIO", "atomic_save"]
