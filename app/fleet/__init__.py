"""`python -m app fleet`: several servers on one machine's GPUs, inside a memory budget."""
