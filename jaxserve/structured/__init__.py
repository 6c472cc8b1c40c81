"""Structured output: grammar compilation (frontend side) and per-sequence grammar state
(engine core side) producing each step's token bitmask."""
