"""Repository tools, not part of the installed package: the generators of the docs' generated
blocks (``config_reference``, ``healthy_runs``). Run from the repository root:

    .venv/bin/python -m tools.config_reference docs/rl.md
    .venv/bin/python -m tools.healthy_runs docs/recipes/*.md

Tests import them to check that the docs hold exactly what they generate.
"""
