"""``python -m rollout.serve``: the same as ``rollout-serve``."""

from .cli import main

if __name__ == "__main__":
    main()
