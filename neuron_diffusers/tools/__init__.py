"""Developer tools, off the generation path: plan inspection (`plan/`), benchmarks (`bench/`) and `spawn`.

Nothing a generation runs imports from here.
"""
