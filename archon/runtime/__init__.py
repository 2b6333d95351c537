"""Process hooks of a run: kill-and-resume drill points (``drill``), the startup objects kept
out of the garbage collector's way (``gc_freeze``), and N forked ranks of one process group on
one machine (``fork_ranks``: the rehearsal's and the tests' ranks)."""
