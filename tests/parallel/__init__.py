"""Tests of parallel/."""
