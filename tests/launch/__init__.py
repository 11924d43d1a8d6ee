"""Tests of launch/."""
