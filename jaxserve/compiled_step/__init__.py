"""What a compiled step is, apart from the code that compiles it: the grid of padded shapes
compiled at start-up (buckets.py) and the bytes of each device a compiled step takes, from
XLA's own figures (memory.py).

The backend picks the default grid and sizes the KV cache from a step's memory; the runner
compiles the grid and measures the steps; the engine's plan builds the grid. None of this
imports the backend or the runner, so both may import it.
"""
