"""Tests of pretrain/."""
