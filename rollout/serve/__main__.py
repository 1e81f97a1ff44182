"""``python -m rollout.serve``: the same as ``rollout-serve``."""

from rollout.serve.cli import main

if __name__ == "__main__":
    main()
