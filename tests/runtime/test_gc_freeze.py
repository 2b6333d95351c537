"""Startup objects are frozen out of the garbage collector's way and handed back when the run ends."""

from __future__ import annotations

import gc

from archon.runtime.gc_freeze import freeze_startup_objects, thaw_startup_objects


def _collected_ids() -> set[int]:
    """Ids of the objects the collector walks (every generation but the permanent one)."""
    return {id(o) for o in gc.get_objects()}


def test_freeze_exempts_what_is_alive_and_thaw_hands_it_back():
    alive = [[i] for i in range(1000)]  # lists: tracked by the collector
    ids = {id(a) for a in alive}
    assert ids <= _collected_ids()
    try:
        frozen = freeze_startup_objects()
        # Frozen objects that die leave the permanent generation: a thread of an earlier test may free some
        # meanwhile, so the count can only have fallen since the freeze.
        assert frozen >= len(alive) and 0 < gc.get_freeze_count() <= frozen
        assert not ids & _collected_ids()
        later = [0]  # made after the freeze: collected as usual
        assert id(later) in _collected_ids()
    finally:
        thaw_startup_objects()
    assert gc.get_freeze_count() == 0 and ids <= _collected_ids()
