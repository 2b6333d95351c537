"""``python -m archon.server``: the built-in rollout server (see ``archon.server.app``)."""

from archon.server.app import main

if __name__ == "__main__":
    main()
