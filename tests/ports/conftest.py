"""The scripts under scripts/ are user programs run by test_scripts.py, not test modules: pytest must not import
them (the repository runs with --doctest-modules, which would import every .py file it collects)."""

collect_ignore_glob = ["scripts/*.py"]
