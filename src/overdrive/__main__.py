"""``python -m overdrive``: the same CLI as the ``overdrive`` command, for environments without its script.

Example:
    $ python -m overdrive env
"""

from overdrive.cli.main import main

if __name__ == "__main__":
    main()
