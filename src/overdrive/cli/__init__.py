"""The ``overdrive`` command line: one module per verb, each exposing a click ``command``."""
