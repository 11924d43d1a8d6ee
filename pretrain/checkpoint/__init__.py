"""Checkpoints: saved and loaded through their owners, never half-written, verified before they are
trusted, re-cut by parameter name for another layout, and which one a run loads."""
